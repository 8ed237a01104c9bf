"""What the components take from their caller: a plain TorchRL ClipPPOLoss is given the rollout's
keys and mask (and then updates exactly as make_ppo_loss's) or refused; a component called before
the step that writes its input is one ConfigError line naming the key and the step; a replay
buffer keeps its batch size or is refused; a NaN reward is refused, naming the reward and the
row; the collector takes its batch size from the environment."""

import logging

import pytest
import torch
from test_objectives import _prepared
from torchrl.objectives import ClipPPOLoss

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import TokenLevelActor
from rlhf_torchrl.objectives.loss_inputs import check_replay_buffer, use_rollout_keys
from rlhf_torchrl.trainers.update import make_minibatch_buffer, ppo_update


def _plain_loss(policy, critic, **kwargs):
    """TorchRL's ClipPPOLoss with make_ppo_loss's settings (clip 0.2, value clip 0.2, vf_coef 0.1
    as critic_coeff 0.05 on the l2 distance, no entropy bonus) and TorchRL's keys: not set up."""
    actor = TokenLevelActor(policy, temperature=0.7)
    return ClipPPOLoss(actor, critic, clip_epsilon=0.2, clip_value=0.2, critic_coeff=0.05,
                       loss_critic_type="l2", entropy_bonus=False, functional=False, **kwargs)


def _update(policy, critic, loss, td):
    optimizer = torch.optim.SGD([p for p in loss.parameters() if p.requires_grad], lr=1.0)
    return ppo_update(td, loss, optimizer, num_ppo_epochs=2, num_mini_batches=2,
                      replay_buffer=make_minibatch_buffer(8, 4, seed=0))


def test_a_plain_clip_ppo_loss_gets_the_layout_and_updates_as_make_ppo_loss(
        tiny_llama_dir, tokenizer, caplog):
    """Left at TorchRL's keys ("action", "action_log_prob", mask "auto": every position, pads
    included), ppo_update sets the rollout's keys and the response mask, says so once, and the
    weights then move exactly as make_ppo_loss's do (2 epochs x 2 minibatches, ragged rows)."""
    policy, ours, critic, td = _prepared(tiny_llama_dir, tokenizer, critic_init="policy")
    start = {k: v.detach().clone() for k, v in policy.named_parameters()}
    _update(policy, critic, ours, td.clone())
    assert any(not torch.equal(start[k], v) for k, v in policy.named_parameters())
    policy_p, _, critic_p, td_p = _prepared(tiny_llama_dir, tokenizer, critic_init="policy")
    plain = _plain_loss(policy_p, critic_p)
    assert plain.tensor_keys.action == "action" and plain.loss_mask_key == "auto"
    with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.objectives.loss_inputs"):
        _update(policy_p, critic_p, plain, td_p)
    (record,) = [r for r in caplog.records if r.name == "rlhf_torchrl.objectives.loss_inputs"]
    assert record.getMessage().startswith("ppo_update: set this ClipPPOLoss's keys for the rollout")
    assert "loss.loss_mask_key = ('masks', 'response')" in record.getMessage()
    assert plain.tensor_keys.action == K.RESPONSE_TOKENS and plain.loss_mask_key == K.RESPONSE_MASK
    for model, same in ((policy, policy_p), (critic, critic_p)):  # bit for bit (unmasked: 0.07 off)
        for (name, a), b in zip(model.named_parameters(), same.parameters()):
            assert torch.equal(a, b), name


def test_a_clip_ppo_loss_pointed_elsewhere_is_refused(tiny_llama_dir, tokenizer):
    """A key or mask set to another entry: one line naming it and the three-line set-up."""
    policy, _, critic, td = _prepared(tiny_llama_dir, tokenizer, critic_init="policy")
    loss = _plain_loss(policy, critic)
    loss.set_keys(sample_log_prob="my_log_probs")
    optimizer = torch.optim.SGD(loss.parameters(), lr=0.0)
    with pytest.raises(ConfigError) as info:
        ppo_update(td, loss, optimizer, num_ppo_epochs=1, num_mini_batches=1)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "ppo_update: this ClipPPOLoss reads sample_log_prob='my_log_probs', which the rollout "
        "does not hold: set it up as loss.set_keys(action=('tokens', 'response'), "
        "sample_log_prob=('log_probs', 'response')")
    assert "loss.loss_mask_key = ('masks', 'response')" in message
    loss = _plain_loss(policy, critic)
    loss.loss_mask_key = "my_mask"
    with pytest.raises(ConfigError, match="PPOTrainer: this ClipPPOLoss reads loss_mask_key='my_mask'"):
        use_rollout_keys(loss, where="PPOTrainer")
    loss.loss_mask_key = K.PROMPT_MASK  # an entry the rollout holds, but the wrong one
    with pytest.raises(ConfigError) as info:
        use_rollout_keys(loss, where="PPOTrainer")
    assert str(info.value).startswith(
        "PPOTrainer: this ClipPPOLoss reads loss_mask_key=('masks', 'prompt'), which is the "
        "rollout's prompt mask (keys.PROMPT_MASK), not its response mask (('masks', 'response')): "
        "set it up as loss.set_keys(")


def test_the_trainer_sets_up_a_plain_loss_before_any_work(tiny_llama_dir, tokenizer, caplog):
    from rlhf_torchrl.trainers.ppo import PPOTrainer

    policy, _, critic, _ = _prepared(tiny_llama_dir, tokenizer, critic_init="policy")
    loss = _plain_loss(policy, critic)
    parts = dict(collector=[], scorer=None, actor=None, reference=None, critic=critic, shaper=None,
                 advantage=None, optimizer=None, num_iterations=1, pad_token_id=0)
    with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.objectives.loss_inputs"):
        PPOTrainer(loss_module=loss, **parts)
    assert loss.loss_mask_key == K.RESPONSE_MASK and "PPOTrainer: set this" in caplog.text
    with pytest.raises(ConfigError, match="replay_buffer samples with RandomSampler"):
        from torchrl.data import LazyStackStorage, ReplayBuffer

        PPOTrainer(loss_module=loss, replay_buffer=ReplayBuffer(storage=LazyStackStorage(8)), **parts)


def test_replay_buffers_keep_their_batch_size_or_are_refused():
    from torchrl.data import LazyStackStorage, RandomSampler, ReplayBuffer

    check_replay_buffer(make_minibatch_buffer(8, 4), rows=8, sizes=[4, 4])
    check_replay_buffer(make_minibatch_buffer(8), rows=7, sizes=[4, 3])  # no size of its own
    with pytest.raises(ConfigError, match=r"^replay_buffer has batch_size=4, but "
                                          r"num_mini_batches=2 splits the 7 rows into minibatches "
                                          r"of 4 and 3: .*make_minibatch_buffer\(7\)"):
        check_replay_buffer(make_minibatch_buffer(8, 4), rows=7, sizes=[4, 3])
    with pytest.raises(ConfigError, match=r"replay_buffer holds 4 rows and the rollout has 8"):
        check_replay_buffer(make_minibatch_buffer(4, 4), rows=8, sizes=[4, 4])
    with pytest.raises(ConfigError, match="replay_buffer samples with RandomSampler: the PPO "
                                          "epochs serve every row once per epoch"):
        check_replay_buffer(ReplayBuffer(storage=LazyStackStorage(8), sampler=RandomSampler()))
    with pytest.raises(ConfigError, match="filter_groups leaves fewer rows"):
        check_replay_buffer(make_minibatch_buffer(8, 4), filtered=True)


def test_ppo_update_keeps_the_buffers_batch_size(tiny_llama_dir, tokenizer, recwarn):
    """The buffer passed in is served as it is (no conflicting-size warning, its batch size
    unchanged); one whose size the minibatches do not have is refused before any step."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer)
    optimizer = torch.optim.SGD(loss.parameters(), lr=0.0)
    buffer = make_minibatch_buffer(8, 4, seed=0)
    ppo_update(td, loss, optimizer, num_ppo_epochs=1, num_mini_batches=2, replay_buffer=buffer)
    assert buffer.batch_size == 4 and not [w for w in recwarn if "batch_size" in str(w.message)]
    with pytest.raises(ConfigError, match="replay_buffer has batch_size=4, but num_mini_batches=4"):
        ppo_update(td, loss, optimizer, num_ppo_epochs=1, num_mini_batches=4, replay_buffer=buffer)


def _too_early(td):
    """Each component called one step too early, on ``td`` without what that step writes."""
    from rlhf_torchrl.objectives.advantages import (
        GRPOAdvantage,
        ReinforcePPAdvantage,
        ResponseGAE,
        RLOOAdvantage,
    )
    from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
    from rlhf_torchrl.rewards.scoring import Scorer

    shaped = (K.KL, K.REWARD, K.NON_SCORE_REWARD, K.DONE, K.TERMINATED, K.SHAPED_SCORE)
    advantages = (K.ADVANTAGE, K.VALUE_TARGET)
    return {  # name -> (call, the rollout it gets, the key it must name, the step that writes it)
        "scorer": (Scorer({"f": (lambda p, r: [0.0] * len(r), 1.0)}), td, K.PROMPT_TEXT, "collector"),
        "shaper": (KLRewardShaper(make_kl_controller(0.1)),
                   td.exclude(K.REF_LOG_PROB, *shaped, *advantages), K.REF_LOG_PROB, "reference pass"),
        "gae": (ResponseGAE(), td.exclude(K.VALUE, *advantages), K.VALUE, "critic's pass"),
        "grpo": (GRPOAdvantage(), td.exclude(*shaped, *advantages), K.REWARD, "reward shaper"),
        "rloo": (RLOOAdvantage(), td.exclude(*advantages), K.GROUP, "collector"),
        "reinforce_pp": (ReinforcePPAdvantage(), td.exclude(*shaped, *advantages), K.REWARD,
                         "reward shaper"),
    }


def test_each_too_early_call_is_one_line_naming_the_key(tiny_llama_dir, tokenizer):
    """KLRewardShaper before the reference pass, ResponseGAE before the values, the critic-free
    estimators before the shaper (or without groups), the loss and ppo_update before the
    advantages: one ConfigError line naming the key and the step that writes it (not TorchRL's
    "Critic network is not specified", not a TypeError from deep inside)."""
    policy, loss, critic, td = _prepared(tiny_llama_dir, tokenizer)
    calls = {name: (lambda m=m, t=t: m(t.clone()), key, step)
             for name, (m, t, key, step) in _too_early(td).items()}
    early = td.exclude(K.ADVANTAGE, K.VALUE_TARGET)
    optimizer = torch.optim.SGD(loss.parameters(), lr=0.0)
    calls["loss"] = (lambda: loss(early), K.ADVANTAGE, "advantage estimator")
    calls["ppo_update"] = (lambda: ppo_update(early, loss, optimizer, num_ppo_epochs=1,
                                              num_mini_batches=1), K.ADVANTAGE, "advantage estimator")
    plain = _plain_loss(policy, critic)
    calls["ppo_update, a plain ClipPPOLoss"] = (
        lambda: ppo_update(early, plain, optimizer, num_ppo_epochs=1, num_mini_batches=1),
        K.ADVANTAGE, "advantage estimator")
    for name, (call, key, step) in calls.items():
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and f"reads {key!r}, which this rollout does not have" in message, name
        assert f"it is written by the {step}" in message, (name, message)


def test_scorer_refuses_a_non_finite_reward_naming_it_and_the_row():
    import math

    from tensordict import TensorDict

    from rlhf_torchrl.rewards.scoring import Scorer

    def flaky(prompts, responses):
        return [1.0, math.nan, 0.5]

    td = TensorDict({K.PROMPT_TEXT: ["a", "b", "c"], K.RESPONSE_TEXT: ["x", "y", "z"],
                     K.HAS_STOP: torch.ones(3, dtype=torch.bool)}, batch_size=[3])
    with pytest.raises(ConfigError, match=r"^Reward 'flaky' returned non-finite values \(NaN or "
                                          r"inf\) at rows \[1\]"):
        Scorer({"flaky": (flaky, 1.0)})(td.clone())
    kept = Scorer({"flaky": (flaky, 1.0)}, allow_non_finite=True)(td)  # for the guards
    assert math.isnan(float(kept.get(K.SCORE)[1]))


def test_the_collector_takes_its_batch_size_from_the_environment(tiny_llama_dir, tokenizer):
    from rlhf_torchrl.collectors import (
        RolloutCollector,
        make_generation_env,
        make_generation_policy,
    )
    from rlhf_torchrl.modules import load_causal_lm

    env = make_generation_env(["a", "b", "c", "d"], tokenizer, batch_size=2, seed=0)
    policy = make_generation_policy(load_causal_lm(tiny_llama_dir, tokenizer), tokenizer,
                                    max_new_tokens=2, record_log_probs=True)
    collector = RolloutCollector(env, policy, tokenizer=tokenizer, total_batches=1)
    assert collector.batch_size == 2 and next(iter(collector)).shape == (2,)
    with pytest.raises(ConfigError, match=r"^RolloutCollector\(batch_size=4\) is not the "
                                          r"environment's batch size, 2 .*leave batch_size out"):
        RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=4)
    # an error of the Python API names its arguments, not the recipe's keys
    with pytest.raises(ConfigError, match=r"^batch_size=3 responses do not make whole groups of "
                                          r"samples_per_prompt=2"):
        make_generation_env(["a", "b"], tokenizer, batch_size=3, samples_per_prompt=2)
