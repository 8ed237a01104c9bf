"""The critic's techniques through the recipe, with tiny overrides: groups of responses with a
critic and VAPO's settings, a critic warm-up that ends on its own, a critic warm-started from a
saved one."""

import json
import math

import pytest
import torch
from test_recipe import _cfg

from rlhf_torchrl.config import builders, checks
from rlhf_torchrl.errors import ConfigError


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_groups_with_a_critic_and_vapo_settings(tmp_path, tiny_llama_dir, monkeypatch):
    """generation.samples_per_prompt=2 with GAE (VAPO samples groups with a critic), with the
    separate lambdas, a critic pass and the positive-example NLL: the critic trains, the group
    statistics are logged, the run resumes from its checkpoint; whole groups go to each process."""
    overrides = ["ppo.batch_size=8", "generation.samples_per_prompt=2", "checkpoint.every=1",
                 "ppo.lmbda_critic=1.0", "ppo.lmbda_length_alpha=0.05", "ppo.critic_epochs=2",
                 "ppo.positive_nll_coef=0.1", "ppo.positive_nll_threshold=0.0"]
    trainer = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, *overrides))
    assert trainer.critic is not None and trainer.update.critic_epochs == 2
    assert (trainer.advantage.lmbda_critic, trainer.advantage.lmbda_length_alpha) == (1.0, 0.05)
    assert trainer.loss_module.positive_nll_coef == 0.1
    trainer.fit()
    rows = _rows(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["group/size"] == 2 and 0 <= row["group/equal_score_frac"] <= 1
        for key in ("loss/value_avg", "loss/value_critic_passes_avg", "loss/positive_nll_avg",
                    "val/explained_variance", "loss/policy_avg"):
            assert math.isfinite(row[key]), key
        assert row["policy/positive_token_frac"] > 0 and row["episode"] == 8 * (row["iteration"] + 1)
    resumed = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=3", *overrides))
    assert resumed.iteration == 2 and resumed.critic is not None
    monkeypatch.setenv("WORLD_SIZE", "2")  # 4 groups of 2 over 2 processes: whole groups each
    checks.check_config(_cfg(tmp_path, tiny_llama_dir, *overrides))
    with pytest.raises(ConfigError, match="group"):
        checks.check_config(_cfg(tmp_path, tiny_llama_dir, *overrides, "ppo.batch_size=6",
                                   "ppo.num_mini_batches=1"))


def test_critic_warmup_until_its_fit_stops_improving(tmp_path, tiny_llama_dir):
    """optim.critic_warmup_until=explained_variance with at most 3 warm-up iterations: no rise of
    10 is possible, so it ends after 2 (patience 1). Until then the policy stays (ratio 1, KL 0 on
    the next batch); the adaptive KL coefficient waits for the first batch of the moved policy; the
    update's buffer holds the current rollout alone (no data piles up in the critic-only
    iterations, OpenRLHF #1356); a resumed run keeps the warm-up's state and learning rates."""
    overrides = ["optim.critic_warmup=3", "optim.critic_warmup_until=explained_variance",
                 "optim.critic_warmup_patience=1", "optim.critic_warmup_min_delta=10",
                 "ppo.num_iterations=5", "eval.every=0", "ppo.kl_target=1.0", "ppo.kl_horizon=4",
                 "optim.lr_schedule=constant", "checkpoint.every=1"]
    trainer = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, *overrides))
    held = []
    trainer.register_op("post_steps", lambda: held.append(len(trainer.replay_buffer)))
    trainer.fit()
    rows = _rows(tmp_path)
    assert [r["critic_warmup"] for r in rows] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert held == [4] * 5  # ppo.batch_size rows, every iteration
    assert max(r["policy/approxkl_avg"] for r in rows[:2]) < 1e-9 < 1e-6 < rows[2]["policy/approxkl_avg"]
    assert max(abs(r["objective/kl"]) for r in rows[:3]) < 1e-3 < abs(rows[3]["objective/kl"])
    assert [r["lr"] for r in rows] == [0.0, 1e-3, 1e-3, 1e-3, 1e-3]  # the next step's rate
    coefs = [r["objective/kl_coef"] for r in rows]
    assert coefs[0] == coefs[1] == coefs[2] == coefs[3] != coefs[4]
    warmup = trainer.critic_warmup
    assert warmup.iterations == 2 and warmup.frozen_steps() == 4  # 2 iterations x 2 minibatches
    resumed = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, *overrides, "ppo.num_iterations=6"))
    assert resumed.critic_warmup.state_dict() == warmup.state_dict()
    assert [g["lr"] for g in resumed.optimizer.param_groups] == \
        [g["lr"] for g in trainer.optimizer.param_groups]
    with pytest.raises(ConfigError, match="optim.critic_warmup_until=value_loss ends the critic "
                                          "warm-up early: set optim.critic_warmup=N > 0"):
        checks.check_config(_cfg(tmp_path, tiny_llama_dir, "optim.critic_warmup_until=value_loss"))
    with pytest.raises(ConfigError, match="ppo.critic_epochs=1: the critic trains in each of the "
                                          "ppo.num_ppo_epochs=2"):
        checks.check_config(_cfg(tmp_path, tiny_llama_dir, "ppo.num_ppo_epochs=2",
                                   "ppo.critic_epochs=1"))


def test_critic_warm_started_from_a_saved_critic(tmp_path, tiny_llama_dir, tokenizer):
    """value_model.warm_start=<a run's output_dir>: the new run's separate critic is the saved one
    (its newest checkpoint's value head and trunk), its policy and optimiser start fresh. A shared
    trunk is refused before any model loads, and by load_critic: the saved head was fitted to
    that run's trained policy, not to this run's fresh one. A path without a checkpoint too."""
    from rlhf_torchrl.modules import load_causal_lm, make_critic
    from rlhf_torchrl.trainers.warm_start import load_critic

    separate = "value_model.init=policy"
    first = builders.build_trainer(_cfg(tmp_path / "first", tiny_llama_dir, separate,
                                        "checkpoint.every=1", "ppo.num_iterations=1", "eval.every=0"))
    fresh_policy = {k: v.clone() for k, v in first.actor.model.state_dict().items()}
    first.fit()
    saved_head = first.critic.head.weight.detach().clone()
    saved_trunk = {k: v.detach().clone() for k, v in first.critic.backbone.state_dict().items()}
    assert saved_head.abs().sum() > 0  # (a fresh head is 0)
    assert any(not torch.equal(v, fresh_policy[f"model.{k}"]) for k, v in saved_trunk.items()
               if f"model.{k}" in fresh_policy)  # the saved critic's trunk trained
    second = builders.build_trainer(_cfg(tmp_path / "second", tiny_llama_dir, separate, "eval.every=0",
                                         f"value_model.warm_start={tmp_path / 'first'}"))
    assert torch.equal(second.critic.head.weight, saved_head)
    trunk = second.critic.backbone.state_dict()
    assert all(torch.equal(trunk[k], v) for k, v in saved_trunk.items())
    policy = second.actor.model.state_dict()
    assert all(torch.equal(policy[k], v) for k, v in fresh_policy.items())
    assert not second.optimizer.state  # no moments: a fresh optimiser
    refusal = (r"value_model.init=shared: a shared trunk is the policy's, so the saved value head "
               r"was fitted to that run's trained policy .*value_model.init=policy in both runs")
    with pytest.raises(ConfigError, match=refusal):
        checks.check_config(_cfg(tmp_path / "third", tiny_llama_dir, "value_model.init=shared",
                                 f"value_model.warm_start={tmp_path / 'first'}"))
    shared = make_critic(policy=load_causal_lm(tiny_llama_dir, tokenizer), tokenizer=tokenizer,
                         init="shared")
    with pytest.raises(ConfigError, match=refusal):
        load_critic(str(tmp_path / "first"), shared)
    assert shared.head.weight.abs().sum() == 0  # nothing loaded
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        checks.check_config(_cfg(tmp_path / "third", tiny_llama_dir, separate,
                                 f"value_model.warm_start={tmp_path / 'nowhere'}"))
