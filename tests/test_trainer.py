"""The trainer as a Python user builds it: components by hand, no Hydra; a hook, a swapped
component, and an exact resume through state_dict / load_checkpoint."""

import json
import math

import pytest
import torch
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import (
    KLRewardShaper,
    PPOTrainer,
    ResponseGAE,
    RolloutCollector,
    Scorer,
    TokenLevelActor,
    make_critic,
    make_generation_env,
    make_generation_policy,
    make_kl_controller,
    make_ppo_loss,
)
from rlhf_torchrl.hooks import Checkpointer, OnPolicyCheck
from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
from rlhf_torchrl.objectives import make_minibatch_buffer
from rlhf_torchrl.optim import make_optimizer

PROMPTS = [f"Tell me about the number {i}." for i in range(8)]


def length_reward(prompts, responses):
    return [len(r) / 20 for r in responses]


def build(model_dir, *, num_iterations=3, scorer=None, seed=0):
    """The README's Python example, at a tiny size."""
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
        return RolloutCollector(env, gen, tokenizer=tok, batch_size=4, seed=seed,
                                start_batch=start_batch)

    return PPOTrainer(
        collector=collector, scorer=scorer or Scorer({"length": (length_reward, 1.0)}),
        actor=actor, reference=ref, critic=critic,
        shaper=KLRewardShaper(make_kl_controller(0.05)), advantage=ResponseGAE(),
        loss_module=make_ppo_loss(actor, critic), optimizer=optimizer, scheduler=scheduler,
        replay_buffer=make_minibatch_buffer(4, 2, seed=seed), num_mini_batches=2,
        num_iterations=num_iterations, pad_token_id=tok.pad_token_id, forward_batch_size=4)


def test_trainer_from_components_with_a_hook(tiny_llama_dir):
    trainer = build(tiny_llama_dir)
    rows = []
    trainer.register_op("post_steps_log", lambda batch: {"my/rows": float(batch.shape[0])})
    trainer.register_op("log", rows.append)
    trainer.register_hook("on_policy_check", OnPolicyCheck())
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    trainer.fit()
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
