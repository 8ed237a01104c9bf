"""The optimiser of policy and critic: parameter groups, learning-rate warm-up, critic warm-up.

Example:
    >>> optimizer, scheduler = make_optimizer(policy, critic, lr=1e-5, value_head_lr=1e-3,
    ...                                       total_steps=400, warmup_steps=10)
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError

SCHEDULES = ("linear", "constant")


def parameter_groups(policy: nn.Module, critic: nn.Module | None, *, lr: float,
                     critic_lr: float | None = None, value_head_lr: float | None = None) -> list[dict]:
    """AdamW groups: the policy (``lr``), the value head (``value_head_lr``, else ``critic_lr``,
    else ``lr``) and, for a separate critic, its trunk (``critic_lr``, else ``lr``).

    Shared parameters are counted once (a shared-trunk critic adds only its head); frozen ones
    (a LoRA base model) are left out. ``critic=None`` (critic-free): the policy's group alone.
    """
    policy_params = [p for p in policy.parameters() if p.requires_grad]
    if critic is None:
        return [{"params": policy_params, "lr": lr}]
    head = list(critic.head.parameters())
    seen = {id(p) for p in policy_params} | {id(p) for p in head}
    trunk_params = [p for p in critic.parameters() if p.requires_grad and id(p) not in seen]
    groups = [{"params": policy_params, "lr": lr},
              {"params": head, "lr": value_head_lr or critic_lr or lr}]
    if trunk_params:
        groups.append({"params": trunk_params, "lr": critic_lr or lr})
    return groups


def policy_lr_multiplier(step: int, *, total_steps: int, schedule: str = "linear",
                         warmup_steps: int = 0, frozen_steps: int = 0) -> float:
    """The policy's learning-rate multiplier at optimiser step ``step``.

    0 for the first ``frozen_steps`` (the critic warm-up: AdamW still gathers the policy's
    moments, so its first real step is not a sign step); then a linear rise from 0 over
    ``warmup_steps`` (Adam's first steps move every weight by about ``lr``, whatever its
    gradient) times the schedule (``linear``: from 1 after the warm-up to 0 at ``total_steps``;
    ``constant``: 1).
    """
    if step < frozen_steps:
        return 0.0
    warm = min(1.0, (step - frozen_steps + 1) / (warmup_steps + 1))
    return schedule_multiplier(step, total_steps=total_steps, schedule=schedule,
                               start=frozen_steps) * warm


def schedule_multiplier(step: int, *, total_steps: int, schedule: str = "linear",
                        start: int = 0) -> float:
    """``linear``: 1 at step ``start``, falling to 0 at ``total_steps``; ``constant``: 1."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    return 1.0 - (step - start) / (total_steps - start) if schedule == "linear" else 1.0


def make_optimizer(policy: nn.Module, critic: nn.Module | None, *, lr: float, total_steps: int,
                   critic_lr: float | None = None, value_head_lr: float | None = None,
                   weight_decay: float = 0.0, eps: float = 1e-5, schedule: str = "linear",
                   warmup_steps: int = 0, critic_warmup_steps: int = 0):
    """AdamW over :func:`parameter_groups` and its ``LambdaLR`` schedule; returns both.

    ``critic_warmup_steps``: the first optimiser steps train the critic alone
    (:func:`policy_lr_multiplier`); the critic's groups follow ``schedule`` from step 0.
    ``critic=None``: the policy alone (critic-free estimators).
    """
    if critic is None and critic_warmup_steps:
        raise ConfigError("A critic warm-up needs a critic: set optim.critic_warmup=0 with a "
                          "critic-free advantage estimator.")
    groups = parameter_groups(policy, critic, lr=lr, critic_lr=critic_lr, value_head_lr=value_head_lr)
    # fused: one kernel per step for all parameters (on CPU too), instead of a loop over tensors
    optimizer = torch.optim.AdamW(groups, weight_decay=weight_decay, eps=eps, fused=True)

    def policy_rate(step: int) -> float:
        return policy_lr_multiplier(step, total_steps=total_steps, schedule=schedule,
                                    warmup_steps=warmup_steps, frozen_steps=critic_warmup_steps)

    def critic_rate(step: int) -> float:
        return schedule_multiplier(step, total_steps=total_steps, schedule=schedule)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, [policy_rate] + [critic_rate] * (len(groups) - 1))
    return optimizer, scheduler


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of the parameters this step moves to a global norm of ``max_norm``
    (None: no clipping) and return their norm before clipping.

    Groups at learning rate 0 (the policy during the critic warm-up) are left out of that norm:
    gradients that move nothing must not throttle those that do (the value head). They are
    clipped by their own norm, since AdamW still gathers them into its moments; a non-finite norm
    there is returned instead, so that the caller's guard sees it before any step.
    """
    limit = max_norm if max_norm else float("inf")
    moving, still = [], []
    for group in optimizer.param_groups:
        (moving if group["lr"] > 0 else still).extend(group["params"])
    if not moving:  # every rate at 0: report the whole norm
        moving, still = still, []
    norm = torch.nn.utils.clip_grad_norm_(moving, limit)
    if still:
        still_norm = torch.nn.utils.clip_grad_norm_(still, limit)
        if not torch.isfinite(still_norm):
            return still_norm
    return norm
