"""PPO's old quantities of a rollout, without grad: the sampling policy's log-probs and entropy,
the reference's log-probs and the critic's values (the trainer's third phase)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.modules.actor import TokenLevelActor
from rlhf_torchrl.modules.critic import TokenCritic
from rlhf_torchrl.modules.sequences import model_input_keys


@torch.no_grad()
def compute_old_quantities(
    rollout: TensorDictBase,
    *,
    actor: TokenLevelActor,
    reference: TokenLevelActor,
    critic: TokenCritic | None = None,
    chunk_size: int = 16,
    exact_entropy: bool = True,
    recompute_log_probs: bool = False,
) -> TensorDictBase:
    """Old-policy log-probs and entropy, reference log-probs and values, without grad.

    Runs in chunks of ``chunk_size`` rows; writes ``("log_probs", "response")``,
    ``("entropy", "response")``, ``("ref_log_probs", "response")`` (B, R) and ``"state_value"``
    (B, R, 1) (none without a ``critic``: the critic-free estimators), all fp32 and 0 on pads. The entropy is exact (a softmax over the vocabulary) or,
    with ``exact_entropy=False``, the one-sample estimate ``-log p(y_t)`` (unbiased, since ``y_t`` was
    drawn from that same distribution; what TRL logs), which costs nothing.

    Log-probs (and entropies) already in the rollout, recorded while sampling
    (:func:`~rlhf_torchrl.collectors.make_generation_policy` with ``record_log_probs``), are kept
    and the policy is not run, unless ``recompute_log_probs``: a shared-trunk critic then runs the
    trunk alone, without the LM head. Without recorded entropies the entropy is then the sample
    estimate, whatever ``exact_entropy`` says (record them with ``record_entropy``). Values
    recorded while sampling (``value_head``) are kept the same way, and then only the reference
    runs; ``recompute_log_probs`` recomputes them too.

    Args:
        rollout: the scored rollout, written in place.
        actor: the policy's actor.
        reference: the reference's actor.
        critic: the critic (None: no values).
        chunk_size: rows per forward.
        exact_entropy: the entropy from the softmax over the vocabulary (False: ``-log p(y_t)``).
        recompute_log_probs: run the policy even where log-probs were recorded while sampling.
    """
    keys = rollout.keys(True)
    run_actor = recompute_log_probs or K.LOG_PROB not in keys
    run_critic = critic is not None and (recompute_log_probs or K.VALUE not in keys)
    outputs: dict = {K.REF_LOG_PROB: []}
    if run_critic:
        outputs[K.VALUE] = []
    if run_actor:
        outputs.update({K.LOG_PROB: [], K.ENTROPY: []})
    for chunk in rollout.select(*model_input_keys(rollout)).split(chunk_size):
        if run_actor:
            dist = actor.get_dist(chunk)
            log_prob = dist.log_prob(chunk.get(K.RESPONSE_TOKENS))
            outputs[K.LOG_PROB].append(log_prob)
            outputs[K.ENTROPY].append(dist.entropy() if exact_entropy else -log_prob)
            del dist  # free the (b, R, V) logits before the next forward
        if run_critic:  # takes a shared trunk's hidden states
            outputs[K.VALUE].append(critic(chunk).get(K.VALUE))
        outputs[K.REF_LOG_PROB].append(reference(chunk.clone(False)).get(reference.out_keys[0]))
    for key, parts in outputs.items():
        rollout.set(key, torch.cat(parts))
    if not run_actor and K.ENTROPY not in keys:
        rollout.set(K.ENTROPY, -rollout.get(K.LOG_PROB))  # the one-sample estimate (0 on pads)
    return rollout
