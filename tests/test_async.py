"""Asynchronous collection: exact policy versions, and the synchronous run at zero overlap."""

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import (
    RolloutCollector,
    WeightSync,
    make_generation_env,
    make_generation_policy,
)
from rlhf_torchrl.collectors.asynchronous import AsyncCollector, ModelCopy
from rlhf_torchrl.collectors.on_policy import check_on_policy
from rlhf_torchrl.modules import TokenLevelActor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

PROMPTS = ["The film was", "I did not expect", "Its story", "The acting", "A slow start but",
           "Music and light", "The ending", "Nothing"]


@pytest.mark.parametrize("overlap", [0, 2])
def test_batch_k_is_sampled_by_version_k_minus_overlap(tiny_llama_dir, tokenizer, overlap):
    """The trainer changes the policy after every batch; each batch's recorded log-probs are those
    of exactly the version ``max(0, k - overlap)`` (kept as snapshots), never of another."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    sampling_copy = ModelCopy(policy)
    env = make_generation_env(PROMPTS, tokenizer, batch_size=4, seed=0)
    gen = make_generation_policy(sampling_copy.model, tokenizer, max_new_tokens=5,
                                 record_log_probs=True)
    sync = WeightSync(policy, sampling_copy)
    sync(0)
    collector = AsyncCollector(RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=4, seed=0),
                               sync, overlap=overlap)
    snapshots = [copy.deepcopy(policy.state_dict())]
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    versions = []
    for k, rollout in enumerate(collector):
        version = int(rollout.get(K.POLICY_VERSION)[0])
        versions.append(version)
        assert (rollout.get(K.POLICY_VERSION) == version).all()
        reference.load_state_dict(snapshots[version])
        check_on_policy(rollout, TokenLevelActor(reference), num_rows=4, atol=1e-4)
        if version != k:  # and it is not the trainer's current policy
            with pytest.raises(Exception, match="Off-policy"):
                check_on_policy(rollout, TokenLevelActor(policy), num_rows=4, atol=1e-4)
        if k == 4:
            break
        with torch.no_grad():  # "update" k: the trainer's policy moves
            policy.lm_head.weight.mul_(1.5)
        snapshots.append(copy.deepcopy(policy.state_dict()))
        collector.update_weights(k + 1)
    collector.shutdown()
    assert versions == [max(0, k - overlap) for k in range(5)]


def _run(tmp_path, model_dir, *overrides):
    import ppo
    from test_recipe import _cfg

    cfg = _cfg(tmp_path, model_dir, "ppo.num_iterations=3", *overrides)
    ppo.train(cfg)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items()
            if not k.startswith(("time/", "async/")) and k != "threads"}


def test_overlap_zero_is_the_synchronous_run(tmp_path, tiny_llama_dir):
    sync = _run(tmp_path / "sync", tiny_llama_dir)
    overlapped = _run(tmp_path / "async", tiny_llama_dir, "collection.overlap=0")
    assert [_comparable(m) for m in overlapped] == [_comparable(m) for m in sync]
    assert [m["async/staleness"] for m in overlapped] == [0, 0, 0]


def test_overlap_one_anchors_the_trust_region_at_the_current_policy(tmp_path, tiny_llama_dir):
    """A generation copy samples batch k + 1 while the trainer updates on batch k. By default the
    old log-probs are recomputed by the policy being updated (PPO's ratio is 1 at the first
    minibatch of every iteration, stale batches included) and the sampler's weight the surrogate
    by TIS, capped at 2 (decoupled PPO)."""
    from test_recipe import _cfg

    from rlhf_torchrl.config.builders import build_trainer

    trainer = build_trainer(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=3",
                                 "collection.overlap=1", "ppo.num_mini_batches=2"))
    first = {}  # iteration -> the first minibatch's losses and diagnostics
    forward = trainer.loss_module.forward

    def recording(td):
        out = forward(td)
        first.setdefault(trainer.iteration, out.detach().clone())
        return out

    trainer.loss_module.forward = recording
    trainer.fit()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["async/staleness"] for m in lines] == [0, 1, 1]
    for iteration in range(3):  # stale batches (1, 2) too
        assert float(first[iteration]["ratio"]) == pytest.approx(1.0, abs=1e-5)
        assert float(first[iteration]["approxkl"]) < 1e-10
    assert lines[0]["policy/behaviour_approxkl"] < 1e-8  # batch 0: the trainer's own weights
    assert lines[1]["policy/behaviour_approxkl"] > 1e-6  # batch 1: sampled before update 0
    for m in lines:
        assert 0 < m["policy/tis_weight_avg"] <= 2.0 and 0 <= m["policy/tis_capped_frac"] <= 1
        assert all(math.isfinite(v) for v in m.values())
        # tokens per second of the sampler's own time, not of the trainer's wait for the batch
        tokens = m["val/sequence_lengths"] * 4
        assert m["time/tokens_per_second"] == pytest.approx(tokens / m["time/sampling"])


def test_truncated_importance_sampling_weights_the_surrogate(tokenizer, tiny_llama_dir):
    """Hand check: with behaviour log-probs shifted by d from the old ones, every token's surrogate
    is weighted by min(exp(d), cap): the policy loss scales by that factor at ratio 1."""
    from rlhf_torchrl.data.rollout import probe_rollout
    from rlhf_torchrl.modules import compute_old_quantities, make_critic
    from rlhf_torchrl.objectives.ppo import make_ppo_loss

    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    actor = TokenLevelActor(policy)
    critic = make_critic(policy=policy, tokenizer=tokenizer, init="shared")
    rollout = probe_rollout(PROMPTS[:4], tokenizer, ["good", "bad film", "", "fine"])
    compute_old_quantities(rollout, actor=actor, reference=actor, critic=critic, chunk_size=4)
    mask = rollout.get(K.RESPONSE_MASK)
    rollout.set(K.ADVANTAGE, torch.where(mask, 1.0, 0.0).unsqueeze(-1))
    rollout.set(K.VALUE_TARGET, rollout.get(K.VALUE).clone())
    plain = make_ppo_loss(actor, critic)(rollout.clone())["loss_objective"]
    for shift, cap, factor in ((0.5, 10.0, math.exp(0.5)), (0.5, 1.2, 1.2), (-1.0, 2.0, math.exp(-1))):
        td = rollout.clone()
        td.set(K.BEHAVIOUR_LOG_PROB, td.get(K.LOG_PROB) - shift * mask)
        weighted = make_ppo_loss(actor, critic, tis_cap=cap)(td)["loss_objective"]
        torch.testing.assert_close(weighted, plain * factor, rtol=1e-5, atol=1e-7)


def test_evaluation_never_runs_beside_the_background_sampler(tiny_llama_dir, tokenizer):
    """overlap=0 with the transformers backend samples with the live policy in a background
    thread: a held-out evaluation (which samples with that same model, at its own temperature)
    must wait for the batch under way and hold the sampler back while it runs."""
    import threading

    from test_trainer import build

    from rlhf_torchrl.trainers.evaluation import Evaluator
    from rlhf_torchrl.trainers.hooks import Evaluation

    trainer = build(tiny_llama_dir, num_iterations=3)
    inner = trainer.collector
    trainer.collector = lambda start, pending: AsyncCollector(inner(start, pending), overlap=0,
                                                              start_version=start)
    policy = trainer.actor.model
    evaluator = Evaluator(PROMPTS[:4], tokenizer, trainer.scorer, max_new_tokens=6,
                          temperature=0.1, stop_token_ids=[tokenizer.eos_token_id])
    trainer.register_hook("evaluation", Evaluation(evaluator, every=1, policy=policy,
                                                   reference=policy))
    active, threads, overlaps = set(), [], []

    def enter(module, args):
        me = threading.get_ident()
        if active - {me}:
            overlaps.append(me)
        active.add(me)
        threads.append(me)

    def leave(module, args, out):
        active.discard(threading.get_ident())

    policy.register_forward_pre_hook(enter)
    policy.register_forward_hook(leave)
    trainer.fit()
    assert len(set(threads)) == 2  # the sampler's thread and the trainer's (evaluation, forwards)
    assert not overlaps


def test_checkpoint_waits_for_the_background_samplers_batch(tiny_llama_dir):
    """overlap=0 with the transformers backend samples with the trained model in a background
    thread. Under FSDP2 the sampler's forwards and a sharded checkpoint are both collectives:
    the checkpoint stage runs only once the batch the current weights owe is sampled, with the
    sampler held, so every process runs the two in the same order (never from two threads at
    once). tests/test_distributed.py runs FSDP2 with overlap=0 and checkpoints on 2 processes."""
    import threading

    from test_trainer import build

    trainer = build(tiny_llama_dir, num_iterations=3)
    inner = trainer.collector
    trainer.collector = lambda start, pending: AsyncCollector(inner(start, pending), overlap=0,
                                                              start_version=start)
    policy = trainer.actor.model
    sampling = set()  # threads inside a policy forward
    policy.register_forward_pre_hook(lambda m, args: sampling.add(threading.get_ident()))
    policy.register_forward_hook(lambda m, args, out: sampling.discard(threading.get_ident()))
    seen = []  # at each checkpoint: (batches sampled, weights version, forwards under way)

    def checkpoint():
        collector = trainer.collector
        seen.append((collector._sampled, collector.version, set(sampling)))

    trainer.register_op("checkpoint", checkpoint)
    trainer.fit()
    # weights of version v owe batch v: it is sampled, and no forward runs, at every checkpoint
    # (the last update's weights are not pushed: the run ends)
    assert seen == [(2, 1, set()), (3, 2, set()), (3, 2, set())]
