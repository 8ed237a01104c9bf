"""The optimiser: parameter groups, the learning-rate schedules, and clipping by moving groups."""

import pytest
import torch
from torch import nn

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.trainers.optim import clip_grad_norm, parameter_groups, policy_lr_multiplier


def test_policy_rate_is_zero_in_the_critic_warmup_then_warms_up_and_decays():
    rate = [policy_lr_multiplier(s, total_steps=10, warmup_steps=1, frozen_steps=4) for s in range(10)]
    # frozen for 4 steps; then (s - 4 + 1) / 2 of the linear decay from 1 at step 4 to 0 at step 10
    assert rate[:4] == [0.0] * 4
    assert rate[4:] == pytest.approx([0.5 * 1.0, 1 - 1 / 6, 1 - 2 / 6, 1 - 3 / 6, 1 - 4 / 6, 1 - 5 / 6])
    assert policy_lr_multiplier(3, total_steps=10, schedule="constant") == 1.0


def test_shared_parameters_are_counted_once():
    trunk, head = nn.Linear(4, 4), nn.Linear(4, 1)
    policy = nn.Sequential(trunk, nn.Linear(4, 8))
    critic = nn.Module()
    critic.backbone, critic.head = trunk, head  # a shared trunk: only the head is the critic's own
    groups = parameter_groups(policy, critic, lr=1e-5, value_head_lr=1e-3)
    assert [len(g["params"]) for g in groups] == [4, 2] and groups[1]["lr"] == 1e-3


def test_frozen_groups_do_not_throttle_the_moving_ones():
    """Critic warm-up: the policy's group is at rate 0. Its (large) gradients must not shrink the
    value head's through a shared clip norm; they are clipped on their own (AdamW still gathers
    them). Outside the warm-up every group shares one norm, as before."""
    policy, head = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [policy], "lr": 0.0}, {"params": [head], "lr": 1e-3}])
    policy.grad, head.grad = torch.tensor([300.0, 400.0, 0.0]), torch.tensor([0.3, 0.4])
    norm = clip_grad_norm(optimizer, max_norm=1.0)
    assert float(norm) == pytest.approx(0.5)  # the head's own norm, under the limit: untouched
    assert head.grad.tolist() == pytest.approx([0.3, 0.4])
    assert float(policy.grad.norm()) == pytest.approx(1.0)  # clipped by its own norm
    policy.grad = torch.tensor([float("nan"), 0.0, 0.0])  # a NaN where nothing moves still stops it
    assert not torch.isfinite(clip_grad_norm(optimizer, max_norm=1.0))
    optimizer.param_groups[0]["lr"] = 1e-5  # the policy trains: one global norm
    policy.grad, head.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([0.0, 0.0])
    assert float(clip_grad_norm(optimizer, max_norm=1.0)) == pytest.approx(5.0)
    assert float(policy.grad.norm()) == pytest.approx(1.0)


def test_critic_warmup_ends_when_its_signal_stops_improving():
    """explained_variance must rise by min_delta, value_loss fall by min_delta of its best; after
    `patience` iterations in a row without that (or max_iterations) the warm-up ends, at the
    optimiser steps taken so far."""
    from rlhf_torchrl.trainers.optim import CriticWarmup

    ev = CriticWarmup(10, until="explained_variance", patience=2, min_delta=0.05)
    ends = [ev.observe({"val/explained_variance": v}, steps_done=2 * (i + 1))
            for i, v in enumerate([-0.5, 0.2, 0.24, 0.3, 0.33, 0.34])]
    # 0.2 improves on -0.5; 0.24 (< 0.25) does not; 0.3 does; 0.33 and 0.34 do not: ends there
    assert ends == [False] * 5 + [True] and ev.iterations == 6 and not ev.running
    assert ev.best == 0.3 and ev.frozen_steps() == 12 and ev.warmup_iterations == 6
    assert [ev.trains_critic_alone(i) for i in (5, 6)] == [True, False]
    loss = CriticWarmup(10, until="value_loss", patience=1, min_delta=0.1)
    assert [loss.observe({"loss/value_avg": v}, steps_done=i) for i, v in
            enumerate([1.0, 0.85, 0.8])] == [False, False, True]  # 0.8 > 0.85 * 0.9
    capped = CriticWarmup(2, until="value_loss", patience=5)
    assert [capped.observe({"loss/value_avg": 1.0 / (i + 1)}, steps_done=i) for i in range(2)] \
        == [False, True]
    running = CriticWarmup(3, until="value_loss")
    assert running.frozen_steps() == float("inf") and running.warmup_iterations is None
    assert running.trains_critic_alone(7)
    fixed = CriticWarmup(3)  # a fixed count: known from the start
    assert fixed.warmup_iterations == 3 and [fixed.trains_critic_alone(i) for i in (2, 3)] == [True, False]
    assert not CriticWarmup(0).running and CriticWarmup(0).frozen_steps() == 0
    # a fixed count has no schedule of its own to follow: frozen_steps would hold the policy
    # forever, so it names the number make_optimizer needs instead
    with pytest.raises(ConfigError, match=r"CriticWarmup\(3\) runs a fixed number of iterations"):
        fixed.frozen_steps()
    copy = CriticWarmup(10, until="explained_variance")
    copy.load_state_dict(ev.state_dict())
    assert copy.state_dict() == ev.state_dict() and copy.frozen_steps() == 12
    with pytest.raises(ValueError, match="reads val/explained_variance"):
        CriticWarmup(3, until="explained_variance").observe({"loss/value_avg": 1.0}, steps_done=1)
    with pytest.raises(ValueError, match="explained_variance, value_loss"):
        CriticWarmup(3, until="reward")


def test_schedule_holds_the_policy_until_the_warmup_ends():
    """make_optimizer reads CriticWarmup.frozen_steps at every step: the policy's rate is 0 while
    the warm-up runs, whatever the step; when it ends refresh_lr sets the next step's rate (the
    warm-up ramp, then the decay from there), the value head's schedule runs from step 0."""
    from rlhf_torchrl.trainers.optim import CriticWarmup, make_optimizer, refresh_lr

    policy = nn.Linear(3, 3)
    critic = nn.Module()
    critic.backbone, critic.head = nn.Linear(3, 3), nn.Linear(3, 1)
    warmup = CriticWarmup(5, until="value_loss", patience=1)
    optimizer, scheduler = make_optimizer(policy, critic, lr=1.0, value_head_lr=1.0, total_steps=10,
                                          warmup_steps=1, critic_warmup_steps=warmup.frozen_steps)
    rates = []
    for step in range(4):
        optimizer.step()
        scheduler.step()
        rates.append([g["lr"] for g in optimizer.param_groups])
        if step % 2 == 1:  # an iteration of 2 steps
            if warmup.observe({"loss/value_avg": 1.0}, steps_done=scheduler.last_epoch):
                refresh_lr(scheduler)
    assert [r[0] for r in rates] == [0.0] * 4 and warmup.frozen_steps() == 4
    assert [r[1] for r in rates] == pytest.approx([0.9, 0.8, 0.7, 0.6])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # (4 - 4 + 1) / 2 of 1
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.6) and scheduler.last_epoch == 4
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 - 1 / 6)


def test_fused_and_foreach_adamw_give_the_loop_s_update():
    """AdamW fused (what adamw picks on CPU) and foreach: the for-loop's weights after 5 steps of
    two groups (weight decay, a second learning rate), to float rounding."""
    from rlhf_torchrl.trainers.optim import adamw

    torch.manual_seed(0)
    start = [torch.randn(7, 5), torch.randn(5), torch.randn(3, 3)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    weights = {}
    for kernel in ("loop", "fused", "foreach"):
        params = [nn.Parameter(p.clone()) for p in start]
        groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 1e-1}]
        kwargs = {"weight_decay": 0.1, "eps": 1e-5}
        optimizer = (adamw(groups, **kwargs) if kernel == "fused" else
                     torch.optim.AdamW(groups, foreach=kernel == "foreach", **kwargs))
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        weights[kernel] = [p.detach() for p in params]
        if kernel == "fused":
            assert optimizer.defaults["fused"]  # CPU has a fused AdamW
    for kernel in ("fused", "foreach"):
        for a, b in zip(weights[kernel], weights["loop"]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert not torch.equal(weights[kernel][0], start[0])
