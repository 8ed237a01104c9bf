"""The trainer as a Python user builds it: components by hand, no Hydra; a hook, a swapped
component, and an exact resume through state_dict / load_checkpoint."""

import json
import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import (
    KLRewardShaper,
    PPOTrainer,
    ReinforcePPAdvantage,
    ResponseGAE,
    RLOOAdvantage,
    RolloutCollector,
    Scorer,
    TokenLevelActor,
    UpdateSettings,
    make_critic,
    make_generation_env,
    make_generation_policy,
    make_kl_controller,
    make_ppo_loss,
)
from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors.asynchronous import AsyncCollector
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
from rlhf_torchrl.trainers.hooks import Checkpointer, OnPolicyCheck
from rlhf_torchrl.trainers.optim import make_optimizer
from rlhf_torchrl.trainers.update import make_minibatch_buffer

PROMPTS = [f"Tell me about the number {i}." for i in range(8)]


def length_reward(prompts, responses):
    return [len(r) / 20 for r in responses]


def build(model_dir, *, num_iterations=3, scorer=None, seed=0, wrap=None):
    """The README's Python example, at a tiny size (``wrap``: a function of the collector, the
    collector the trainer gets)."""
    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir, tok)
    reference = load_causal_lm(model_dir, tok).requires_grad_(False)
    critic = make_critic(policy=policy, tokenizer=tok, init="shared")
    actor = TokenLevelActor(policy, temperature=0.7, trunk_critic=critic)
    ref = TokenLevelActor(reference, temperature=0.7, out_key=("ref_log_probs", "response"))
    optimizer, scheduler = make_optimizer(policy, critic, lr=1e-3, value_head_lr=1e-3,
                                          total_steps=num_iterations * 2)

    def collector(start_batch, pending):  # built by fit(), at the batch a checkpoint stopped at
        env = make_generation_env(PROMPTS, tok, batch_size=4, seed=seed, start_batch=start_batch)
        gen = make_generation_policy(policy, tok, max_new_tokens=6, temperature=0.7,
                                     record_log_probs=True)
        collector = RolloutCollector(env, gen, tokenizer=tok, seed=seed, start_batch=start_batch)
        return wrap(collector) if wrap else collector

    return PPOTrainer(
        collector=collector, scorer=scorer or Scorer({"length": (length_reward, 1.0)}),
        actor=actor, reference=ref, critic=critic,
        shaper=KLRewardShaper(make_kl_controller(0.05)), advantage=ResponseGAE(),
        loss_module=make_ppo_loss(actor, critic), optimizer=optimizer, scheduler=scheduler,
        replay_buffer=make_minibatch_buffer(4, 2, seed=seed), update=UpdateSettings(num_mini_batches=2),
        num_iterations=num_iterations, pad_token_id=tok.pad_token_id, forward_batch_size=4)


def test_trainer_from_components_with_a_hook(tiny_llama_dir):
    trainer = build(tiny_llama_dir)
    rows = []
    trainer.register_op("post_steps_log", lambda batch: {"my/rows": float(batch.shape[0])})
    trainer.register_op("log", rows.append)
    trainer.register_hook("on_policy_check", OnPolicyCheck())
    # what a hook reads at each stage: the iteration running, and those done (the running one
    # counts from its update on)
    counters = []
    for stage in ("pre_collect", "post_steps", "checkpoint", "log"):
        trainer.register_op(stage, lambda *_, stage=stage: counters.append(
            (stage, trainer.iteration, trainer.iterations_done)))
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    trainer.fit()
    assert counters[:8] == [("pre_collect", 0, 0), ("post_steps", 0, 1), ("checkpoint", 0, 1),
                            ("log", 0, 1), ("pre_collect", 1, 1), ("post_steps", 1, 2),
                            ("checkpoint", 1, 2), ("log", 1, 2)]
    assert (trainer.iteration, trainer.iterations_done) == (3, 3)
    assert trainer.scheduler.last_epoch == 3 * 2  # UpdateSettings(num_mini_batches=2): 2 steps each
    assert len(rows) == 3 and [r["episode"] for r in rows] == [4, 8, 12]
    for row in rows:
        assert row["my/rows"] == 4.0
        for key in ("objective/kl", "objective/scores", "policy/approxkl_avg", "loss/value_avg",
                    "time/generation", "time/update", "time/total", "lr"):
            assert math.isfinite(row[key]), key
    after = trainer.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="Unknown stage 'after_update'"):
        trainer.register_op("after_update", print)


class ConstantScore(TensorDictModuleBase):
    """A swapped-in scorer: any TensorDict module that writes "score" (B,)."""

    in_keys, out_keys = [("masks", "response")], ["score"]

    def forward(self, td):
        td.set("score", td.get(("masks", "response")).sum(-1).float() / 10)
        return td


def test_a_swapped_scorer_is_the_one_the_loop_uses(tiny_llama_dir):
    rows = []
    trainer = build(tiny_llama_dir, num_iterations=1, scorer=ConstantScore())
    trainer.register_op("log", rows.append)
    trainer.fit()
    assert rows[0]["objective/scores"] == pytest.approx(0.6, abs=0.31)  # 1..6 tokens / 10


def test_an_error_in_the_loop_shuts_the_sampler_down(tiny_llama_dir):
    """An error raised mid-run (here a hook's) leaves nothing sampling behind it: the background
    sampler's thread, which waits for the next weights, ends before the error reaches the
    caller (a Python session that catches it is not left with a thread, an engine or Ray workers
    holding the models)."""
    samplers = []

    def background(collector):
        samplers.append(AsyncCollector(collector, overlap=0))
        return samplers[0]

    def fail(*_):
        if trainer.iteration == 1:
            raise RuntimeError("a hook failed")

    trainer = build(tiny_llama_dir, wrap=background)
    trainer.register_op("post_steps", fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        trainer.fit()
    assert samplers[0]._thread is not None and not samplers[0]._thread.is_alive()


def test_checkpoint_and_load_checkpoint_resume_exactly(tmp_path, tiny_llama_dir):
    """3 iterations in one go, against 2 + a new trainer that loads checkpoint 2 and runs the
    third: the same metrics (time aside)."""
    def run(trainer):
        rows = []
        trainer.register_op("log", rows.append)
        trainer.register_hook("checkpoint", Checkpointer(str(tmp_path / trainer.tag), every=1))
        trainer.fit()
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    whole = build(tiny_llama_dir)
    whole.tag = "whole"
    expected = run(whole)
    first = build(tiny_llama_dir, num_iterations=3)
    first.tag = "cut"
    first.num_iterations = 2  # stopped after 2 (the schedule still spans 3)
    head = run(first)
    assert head == expected[:2]
    second = build(tiny_llama_dir)
    second.load_checkpoint(str(tmp_path / "cut" / "checkpoints" / "iter_00000002"))
    assert second.iteration == 2
    second.tag = "cut"
    tail = run(second)
    assert json.dumps(tail) == json.dumps(expected[2:])


def _phases(**components) -> PPOTrainer:
    """A trainer for its shaping, filtering and advantage phases alone (no model, no collector)."""
    return PPOTrainer(collector=[], scorer=None, actor=None, reference=None, loss_module=None,
                      optimizer=None, num_iterations=1, pad_token_id=0, **components)


def test_group_filter_needs_a_group_estimator_and_no_critic():
    for advantage, critic in ((ResponseGAE(), object()), (ReinforcePPAdvantage(), None),
                              (RLOOAdvantage(), object())):
        with pytest.raises(ConfigError, match="filter_groups .*give a group estimator"):
            _phases(critic=critic, shaper=None, advantage=advantage, filter_groups=True)
    assert _phases(critic=None, shaper=None, advantage=RLOOAdvantage(), filter_groups=True)


def test_group_filter_runs_before_the_advantages(monkeypatch):
    """Groups of 2 with scores (1, 1), (0, 2), (1, 5), whitened (mean kept), RLOO, the KL in the
    loss: the equal group is dropped before the advantages, so the whitening's spread is the
    kept rows' alone, x = (0, 2, 1, 5): var = 14/3 and A = (x_i - x_j) / sqrt(14/3) on each
    token. Shaping and RLOO on those 4 rows alone give the same."""
    import rlhf_torchrl.trainers.ppo as trainer_module

    def rollout():
        lengths = torch.tensor([3, 2, 3, 1, 2, 3])
        return TensorDict({K.SCORE: torch.tensor([1.0, 1.0, 0.0, 2.0, 1.0, 5.0]),
                           K.GROUP: torch.tensor([0, 0, 1, 1, 2, 2]),
                           K.RESPONSE_MASK: torch.arange(3) < lengths[:, None],
                           K.LOG_PROB: torch.zeros(6, 3), K.REF_LOG_PROB: torch.zeros(6, 3)}, [6])

    updated = []
    monkeypatch.setattr(trainer_module, "ppo_update",
                        lambda batch, *args, **kwargs: updated.append(batch) or {"loss": 0.0})
    shaper = KLRewardShaper(make_kl_controller(0.0), whiten_scores=True)
    trainer = _phases(critic=None, shaper=shaper, advantage=RLOOAdvantage(), filter_groups=True)
    batch, stats = trainer.optimise(rollout())
    (kept,) = updated
    assert trainer.metrics["group/filtered_frac"] == pytest.approx(1 / 3)
    assert kept.get(K.GROUP).tolist() == [1, 1, 2, 2]
    advantage, mask = kept.get(K.ADVANTAGE).squeeze(-1), kept.get(K.RESPONSE_MASK)
    expected = torch.tensor([-2.0, 2.0, -4.0, 4.0]) / math.sqrt(14 / 3)
    torch.testing.assert_close(advantage, expected[:, None] * mask)
    alone = rollout()[2:]
    RLOOAdvantage()(shaper(alone))
    torch.testing.assert_close(advantage, alone.get(K.ADVANTAGE).squeeze(-1))
    # every row is shaped (the metrics and the KL controller read them), whitened over all 6
    assert batch.shape[0] == 6 and float(batch.get(K.SHAPED_SCORE)[0]) == pytest.approx(
        (1 - 10 / 6) / math.sqrt(46 / 15) + 10 / 6, rel=1e-5)
