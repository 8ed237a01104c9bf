"""The optimiser: parameter groups, the learning-rate schedules, and clipping by moving groups."""

import pytest
import torch
from torch import nn

from rlhf_torchrl.optim import clip_grad_norm, parameter_groups, policy_lr_multiplier


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
