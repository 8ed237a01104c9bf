"""The on-policy guarantee: PPO's ratio is taken against the policy that sampled. Whether the
old log-probs can be those recorded while sampling (:func:`log_probs_from_sampling`), and the check
on the first batch that the recorded log-probs (and values) equal the training forward's
(:func:`check_on_policy`, within :func:`on_policy_tolerance`; :class:`OffPolicyError` when not).
"""

from __future__ import annotations

import torch

from rlhf_torchrl import keys as K


class OffPolicyError(RuntimeError):
    """Recorded log-probs disagree with the training forward: tokens were not drawn on-policy."""


@torch.no_grad()
def check_on_policy(rollout, actor, *, num_rows: int = 4, atol: float = 1e-3,
                    critic=None, tokens: torch.Tensor | None = None) -> dict[str, float]:
    """Recompute a few rows' sampled-token log-probs with ``actor`` and compare with the recorded ones.

    The ratio ``exp(new - old)`` of PPO's first minibatch is 1 only when the recorded ``old``
    log-probs are those of the distribution the loss computes. Raises :class:`OffPolicyError` when
    ``max |recorded - recomputed|`` over the valid tokens of the first ``num_rows`` rows exceeds
    ``atol``; returns ``{"max_abs_diff", "mean_abs_diff", "tokens"}`` otherwise.

    Args:
        rollout (tensordict.TensorDictBase): a rollout with recorded log-probs.
        actor (rlhf_torchrl.modules.TokenLevelActor): the policy's actor.
        num_rows: the rows compared (the first ones).
        atol: the largest difference allowed, in nats.
        critic (rlhf_torchrl.modules.TokenCritic | None): with values recorded while sampling
            (``"state_value"``, :class:`~rlhf_torchrl.collectors.sampling.ValueRecorder`), those are checked against the critic's
            forward too (same ``atol``; ``"value_max_abs_diff"``). None: log-probs only.
        tokens: (B, R) bool, compare these response tokens alone (partial rollouts: those the
            current weights sampled, :func:`~rlhf_torchrl.collectors.partial.current_tokens`);
            None: every valid token.

    Shapes: reads (B, P) prompt and (B, R) response tokens/masks and (B, R) ``("log_probs",
    "response")``.
    """
    if K.LOG_PROB not in rollout.keys(True):
        raise KeyError(
            "check_on_policy needs the log-probs recorded while sampling (('log_probs', "
            "'response')): build the generation policy with record_log_probs=True."
        )
    check_values = critic is not None and K.VALUE in rollout.keys()
    from rlhf_torchrl.modules.sequences import model_input_keys

    rows = rollout[:num_rows].select(*model_input_keys(rollout), K.LOG_PROB,
                                     *([K.VALUE] if check_values else [])).clone()
    recorded = rows.get(K.LOG_PROB)
    recomputed = actor.get_dist(rows).log_prob(rows.get(K.RESPONSE_TOKENS))
    mask = rows.get(K.RESPONSE_MASK)
    value_stats = _check_recorded_values(rows, critic, mask, atol) if check_values else {}
    if tokens is not None:
        mask = mask & tokens[:num_rows]
    gap = (recorded.double() - recomputed.double()).abs().masked_fill(~mask, 0.0)  # (B, R)
    n = int(mask.sum())
    stats = {"max_abs_diff": float(gap.max()), "mean_abs_diff": float(gap.sum()) / max(n, 1),
             "tokens": n}
    if not stats["max_abs_diff"] <= atol:  # NaN fails too
        row, t = divmod(int(gap.flatten().argmax()), mask.shape[1])
        raise OffPolicyError(
            f"Off-policy sampling: the log-probs recorded while sampling differ from the training "
            f"forward's by up to {stats['max_abs_diff']:.3g} nats (mean {stats['mean_abs_diff']:.3g}"
            f" over {stats['tokens']} tokens of {recorded.shape[0]} responses; worst: row {row}, "
            f"token {t}: {float(recorded[row, t]):.4f} recorded vs {float(recomputed[row, t]):.4f}),"
            f" over the tolerance {atol:g}. PPO's ratio would be wrong from the first step. Usual "
            "causes: a logits processor in the sampling path (e.g. the checkpoint's repetition "
            "penalty), a sampling temperature other than the loss's, or a generation backend "
            "whose numerics differ (bf16, another engine). Fix the cause, or raise "
            "generation.on_policy_tolerance (or set generation.check_on_policy=false) if the "
            "difference is expected."
        )
    return {**stats, **value_stats}


def _check_recorded_values(rows, critic, mask: torch.Tensor, atol: float) -> dict[str, float]:
    """The values recorded while sampling against ``critic``'s forward on the same ``rows``."""
    recorded = rows.get(K.VALUE).squeeze(-1)
    recomputed = critic(rows.exclude(K.VALUE)).get(K.VALUE).squeeze(-1)
    gap = (recorded.double() - recomputed.double()).abs().masked_fill(~mask, 0.0)
    worst = float(gap.max())
    if not worst <= atol:
        row, t = divmod(int(gap.flatten().argmax()), mask.shape[1])
        raise OffPolicyError(
            f"The values recorded while sampling differ from the critic's forward by up to "
            f"{worst:.3g} (row {row}, token {t}: {float(recorded[row, t]):.4f} recorded vs "
            f"{float(recomputed[row, t]):.4f}), over the tolerance {atol:g}: the sampling pass "
            "did not run the critic's trunk on the rollout's tokens (another model sampled, or "
            "its numerics differ). Recompute them with generation.log_probs_from_sampling=false."
        )
    return {"value_max_abs_diff": worst}


def low_precision(*, autocast: str | None = None, dtype: str = "float32") -> bool:
    """bf16/fp16 computation: autocast, or low-precision weights.

    Args:
        autocast: the autocast dtype's name (None: none).
        dtype: the weights' dtype.
    """
    return bool(autocast) or dtype in ("bfloat16", "float16")


def log_probs_from_sampling(*, backend: str = "transformers", autocast: str | None = None,
                            dtype: str = "float32", overlap: int | None = None,
                            setting: bool | None = None, partial_rollout: bool = False,
                            compiled: bool = False) -> bool:
    """Whether PPO's old log-probs can be those recorded while sampling (``setting`` decides when
    given). By default yes for the transformers backend in fp32, sampling with the weights being
    trained: its sampling forward is the training forward, so they are equal. No for vLLM or
    bf16/fp16, whose kernels round differently, and no when a sampler runs ``overlap`` >= 1
    updates ahead (its weights are older than the trainer's), or with ``partial_rollout`` (a
    paused response's earlier tokens come from older weights): PPO's first ratio would not be 1,
    so the trainer's forward recomputes them and the sampler's weight the loss (TIS; decoupled
    PPO, Hilton et al. 2021: the trust region is anchored at the policy being updated).

    Args:
        backend: a name in :data:`~rlhf_torchrl.collectors.backends.GENERATION_BACKENDS`: only
            one whose ``log_probs_match_training`` can record the old log-probs.
        autocast: the autocast dtype's name (None: none).
        dtype: the weights' dtype.
        overlap: the sampler's updates ahead (None: synchronous).
        setting: the user's choice (None: decide as above).
        partial_rollout: responses are sampled in segments by successive weights.
        compiled: the decode step is compiled (``generation.compile``): other kernels than the
            training forward's.
    """
    if setting is not None:
        return bool(setting)
    from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS

    return (not low_precision(autocast=autocast, dtype=dtype)
            and GENERATION_BACKENDS.get(backend).log_probs_match_training
            and not overlap and not partial_rollout and not compiled)


def on_policy_tolerance(*, autocast: str | None = None, dtype: str = "float32",
                        setting: float | None = None, sampler_dtype: str | None = None) -> float:
    """The on-policy check's tolerance (``setting`` when given): 1e-3 nats in fp32, 0.5 where the
    trainer or the sampler computes in bf16/fp16 (rounding alone gave up to 0.25 on SmolLM2 with
    bf16 autocast on CPU, 0.22 for a bf16 vLLM engine against an fp32 trainer).

    Args:
        autocast: the trainer's autocast dtype's name (None: none).
        dtype: the trainer's weights' dtype.
        setting: the user's tolerance, in nats (None: as above).
        sampler_dtype: the weights' dtype of a sampler of its own (a vLLM engine; None: the
            trainer's model samples).
    """
    if setting is not None:
        return float(setting)
    low = low_precision(autocast=autocast, dtype=dtype) or low_precision(dtype=sampler_dtype or dtype)
    return 0.5 if low else 1e-3
