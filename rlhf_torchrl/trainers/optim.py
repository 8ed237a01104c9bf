"""The optimiser of policy and critic: parameter groups, learning-rate warm-up, critic warm-up
(a fixed number of iterations, or until the critic's fit stops improving: :class:`CriticWarmup`).

Example:
    >>> optimizer, scheduler = make_optimizer(policy, critic, lr=1e-5, value_head_lr=1e-3,
    ...                                       total_steps=400, warmup_steps=10)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

SCHEDULES = ("linear", "constant")


def parameter_groups(policy: nn.Module, critic: nn.Module | None, *, lr: float,
                     critic_lr: float | None = None, value_head_lr: float | None = None) -> list[dict]:
    """AdamW groups: the policy (``lr``), the value head (``value_head_lr``, else ``critic_lr``,
    else ``lr``) and, for a separate critic, its trunk (``critic_lr``, else ``lr``).

    Shared parameters are counted once (a shared-trunk critic adds only its head); frozen ones
    (a LoRA base model) are left out. ``critic=None`` (critic-free): the policy's group alone.

    Args:
        policy: the policy model.
        critic: the critic (a :class:`~rlhf_torchrl.modules.TokenCritic`), or None.
        lr: the policy's learning rate.
        critic_lr: the critic trunk's learning rate (None: ``lr``).
        value_head_lr: the value head's learning rate (None: ``critic_lr``, else ``lr``).
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

    Args:
        step: the optimiser step, 0 first.
        total_steps: the run's optimiser steps.
        schedule: ``linear`` or ``constant``.
        warmup_steps: the linear warm-up's steps, after the frozen ones.
        frozen_steps: steps at 0 (the critic warm-up).
    """
    if step < frozen_steps:
        return 0.0
    warm = min(1.0, (step - frozen_steps + 1) / (warmup_steps + 1))
    return schedule_multiplier(step, total_steps=total_steps, schedule=schedule,
                               start=frozen_steps) * warm


def schedule_multiplier(step: int, *, total_steps: int, schedule: str = "linear",
                        start: int = 0) -> float:
    """``linear``: 1 at step ``start``, falling to 0 at ``total_steps``; ``constant``: 1.

    Args:
        step: the optimiser step, 0 first.
        total_steps: the step at which ``linear`` reaches 0.
        schedule: ``linear`` or ``constant``.
        start: the step at which ``linear`` starts at 1.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    return 1.0 - (step - start) / (total_steps - start) if schedule == "linear" else 1.0


def make_optimizer(policy: nn.Module, critic: nn.Module | None, *, lr: float, total_steps: int,
                   critic_lr: float | None = None, value_head_lr: float | None = None,
                   weight_decay: float = 0.0, eps: float = 1e-5, schedule: str = "linear",
                   warmup_steps: int = 0,
                   critic_warmup_steps: int | Callable[[], float] = 0):
    """AdamW over :func:`parameter_groups` and its ``LambdaLR`` schedule; returns both.

    Args:
        policy: the policy model.
        critic: the critic (a :class:`~rlhf_torchrl.modules.TokenCritic`); None: the policy alone
            (critic-free estimators).
        lr: the policy's peak learning rate.
        total_steps: the run's optimiser steps (``linear`` reaches 0 there).
        critic_lr: the critic trunk's learning rate (None: ``lr``).
        value_head_lr: the value head's learning rate (None: ``critic_lr``, else ``lr``).
        weight_decay: AdamW's decoupled weight decay.
        eps: AdamW's ``eps``.
        schedule: ``linear`` (decay to 0 at ``total_steps``) or ``constant``.
        warmup_steps: the policy's linear warm-up from 0, in optimiser steps.
        critic_warmup_steps: the first optimiser steps train the critic alone
            (:func:`policy_lr_multiplier`), or a callable read at every step that gives their
            number (a warm-up that ends on its own: :attr:`CriticWarmup.frozen_steps`, infinite
            while it runs); the critic's groups follow ``schedule`` from step 0.
    """
    if critic is None and critic_warmup_steps:
        raise ConfigError("A critic warm-up needs a critic: critic_warmup_steps=0 with critic=None "
                          "(the recipe: optim.critic_warmup=0 with a critic-free estimator).")
    groups = parameter_groups(policy, critic, lr=lr, critic_lr=critic_lr, value_head_lr=value_head_lr)
    optimizer = adamw(groups, weight_decay=weight_decay, eps=eps)

    def policy_rate(step: int) -> float:
        frozen = critic_warmup_steps() if callable(critic_warmup_steps) else critic_warmup_steps
        return policy_lr_multiplier(step, total_steps=total_steps, schedule=schedule,
                                    warmup_steps=warmup_steps, frozen_steps=frozen)

    def critic_rate(step: int) -> float:
        return schedule_multiplier(step, total_steps=total_steps, schedule=schedule)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, [policy_rate] + [critic_rate] * (len(groups) - 1))
    return optimizer, scheduler


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the fastest kernel torch has for the parameters' device: fused
    (one kernel per step for all parameters: CPU, CUDA, XPU, MPS ...), else ``foreach`` (a few
    kernels over lists of tensors), else the loop over tensors. They give the same update to
    float rounding (tests/test_optim.py).

    Args:
        params (Iterable): the parameters or parameter groups, as ``torch.optim.AdamW`` takes them.
        **kwargs: ``torch.optim.AdamW``'s other arguments (``lr``, ``eps``, ...).
    """
    try:
        from torch.utils._foreach_utils import (
            _get_foreach_kernels_supported_devices,
            _get_fused_kernels_supported_devices,
        )
        fused, foreach = _get_fused_kernels_supported_devices(), _get_foreach_kernels_supported_devices()
    except ImportError:  # a torch that moved them: the two devices every torch fuses
        fused, foreach = ["cpu", "cuda"], ["cuda"]
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = {p.device.type for p in tensors}
    if devices <= set(fused):
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, foreach=devices <= set(foreach), **kwargs)


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of the parameters this step moves to a global norm of ``max_norm``
    (None: no clipping) and return their norm before clipping.

    Groups at learning rate 0 (the policy during the critic warm-up) are left out of that norm:
    gradients that move nothing must not throttle those that do (the value head). They are
    clipped by their own norm, since AdamW still gathers them into its moments; a non-finite norm
    there is returned instead, so that the caller's guard sees it before any step.

    Args:
        optimizer: the optimiser whose groups' parameters are clipped.
        max_norm: the global norm to clip to (None: no clipping).
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


#: ``CriticWarmup``'s signals: the metric each reads and whether it improves upwards
WARMUP_SIGNALS = {"explained_variance": ("val/explained_variance", True),
                  "value_loss": ("loss/value_avg", False)}


class CriticWarmup:
    """The critic trains alone for the first iterations: a fixed number, or until its fit stops
    improving (value pretraining that ends on its own).

    VC-PPO pretrains the value model on the initial policy's samples before PPO starts, so that
    the first advantages come from a critic that already knows the returns (Yuan et al. 2025,
    "VC-PPO", arXiv 2503.01491, value pretraining; VAPO keeps it; verl ``critic_warmup``, slime
    ``--num-critic-only-steps`` and OpenRLHF ``freezing_actor_steps`` run a fixed number of steps,
    NeMo-RL ``policy_training_start_step``). Here the policy's learning rate is 0 while the warm-up
    runs (:func:`make_optimizer` reads :attr:`frozen_steps`), as for a fixed count.

    ``max_iterations``: the warm-up's iterations (its most, with ``until``). ``until``: None (all
    of them), or a signal of :data:`WARMUP_SIGNALS` read from each warm-up iteration's metrics:

    - ``explained_variance``: ``val/explained_variance``, ``1 - Var(R - V) / Var(R)`` of the
      values the critic gave the iteration's batch, before its update, against the value targets
      (:func:`~rlhf_torchrl.functional.explained_variance`): the fit on responses it has not
      trained on. Improves when it rises by at least ``min_delta``.
    - ``value_loss``: ``loss/value_avg`` of the iteration's update. Improves when it falls by at
      least ``min_delta`` of the best so far.

    The warm-up ends after ``patience`` iterations in a row without an improvement on the best,
    or after ``max_iterations``.

    Args:
        max_iterations: the warm-up's iterations (its most, with ``until``).
        until: None (all of them), or a signal of :data:`WARMUP_SIGNALS`, as above.
        patience: iterations in a row without an improvement that end the warm-up.
        min_delta: the least change that counts as an improvement (absolute for
            ``explained_variance``, relative to the best for ``value_loss``).

    Example:
        >>> warmup = CriticWarmup(10, until="explained_variance", patience=2)
        >>> optimizer, scheduler = make_optimizer(policy, critic, lr=1e-5, total_steps=400,
        ...                                       critic_warmup_steps=warmup.frozen_steps)
        >>> trainer = PPOTrainer(..., optimizer=optimizer, scheduler=scheduler, critic_warmup=warmup)
    """

    def __init__(self, max_iterations: int, *, until: str | None = None, patience: int = 2,
                 min_delta: float = 0.01):
        if until is not None and until not in WARMUP_SIGNALS:
            raise ConfigError(f"critic_warmup_until={until!r}: choose one of "
                              f"{', '.join(WARMUP_SIGNALS)}, or None (a fixed number of iterations).")
        if max_iterations < 0 or patience < 1 or min_delta < 0:
            raise ConfigError(f"CriticWarmup needs max_iterations >= 0, patience >= 1 and min_delta "
                              f">= 0, got {max_iterations}, {patience} and {min_delta}.")
        self.max_iterations, self.until = max_iterations, until
        self.patience, self.min_delta = patience, min_delta
        self.iterations = 0  # warm-up iterations done
        self.ended_at_step: int | None = None if max_iterations else 0  # optimiser steps then
        self.best: float | None = None
        self.stale = 0  # iterations in a row without an improvement

    @property
    def running(self) -> bool:
        """Whether the next iteration trains the critic alone (with ``until``; a fixed warm-up
        ends by the iteration count: :meth:`trains_critic_alone`)."""
        return self.ended_at_step is None

    @property
    def warmup_iterations(self) -> int | None:
        """The number of warm-up iterations: ``max_iterations`` for a fixed warm-up; with
        ``until``, those it ran once it ended (None while it runs)."""
        if self.until is None:
            return self.max_iterations
        return None if self.running else self.iterations

    def trains_critic_alone(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (0 first) is a warm-up iteration.

        Args:
            iteration: the iteration, 0 first.
        """
        done = self.warmup_iterations
        return iteration < done if done is not None else True

    def frozen_steps(self) -> float:
        """The optimiser steps in which the policy's learning rate is 0: infinite while the
        warm-up runs, then the steps taken when it ended. A fixed warm-up (``until`` None) has
        no such schedule to follow: give :func:`make_optimizer` its steps as a number."""
        if self.until is None and self.max_iterations:
            raise ConfigError(
                f"CriticWarmup({self.max_iterations}) runs a fixed number of iterations: pass "
                f"make_optimizer(critic_warmup_steps={self.max_iterations} * optimiser steps per "
                "iteration) rather than its frozen_steps, which only a warm-up with until= moves.")
        return math.inf if self.running else self.ended_at_step

    def observe(self, metrics: Mapping[str, float], steps_done: int) -> bool:
        """Count one warm-up iteration from its ``metrics`` (``steps_done``: optimiser steps taken
        so far); returns True when the warm-up ends with it.

        Args:
            metrics: the warm-up iteration's metrics (:data:`WARMUP_SIGNALS`' entries).
            steps_done: optimiser steps taken so far.
        """
        if not self.running:
            return False
        self.iterations += 1
        if self.until is not None:
            name, upwards = WARMUP_SIGNALS[self.until]
            value = metrics.get(name)
            if value is None or not math.isfinite(value):
                raise ConfigError(f"critic_warmup_until={self.until} reads {name}, which this "
                                  f"iteration's metrics lack (a critic and a value loss are needed).")
            if self.best is None or self._improves(value, upwards):
                self.best, self.stale = value, 0
            else:
                self.stale += 1
        if self.iterations >= self.max_iterations or self.stale >= self.patience:
            self.ended_at_step = steps_done
            return True
        return False

    def after_update(self, batch, stats: Mapping[str, float], iteration: int, scheduler) -> dict:
        """After iteration ``iteration``'s update: its ``critic_warmup`` metric (1 in a warm-up
        iteration; none without a warm-up) and, for a warm-up that ends on its own, one
        :meth:`observe` of its signals (the update's ``stats``, and the explained variance of the
        batch's old values against its value targets,
        :func:`~rlhf_torchrl.functional.explained_variance`). When the warm-up ends, the policy's
        learning rate is set for the next step (:func:`refresh_lr`).

        Args:
            batch (tensordict.TensorDictBase): the iteration's batch, with its old values and value targets.
            stats: the update's statistics.
            iteration: the iteration, 0 first.
            scheduler (torch.optim.lr_scheduler.LambdaLR | None): :func:`make_optimizer`'s
                scheduler (needed with ``until``).
        """
        if not self.max_iterations:
            return {}
        metrics = {"critic_warmup": float(self.trains_critic_alone(iteration))}
        if self.until is None or not self.running:
            return metrics
        signals = dict(stats)
        if K.VALUE_TARGET in batch.keys():
            signals["val/explained_variance"] = float(F.explained_variance(
                batch.get(K.VALUE).squeeze(-1), batch.get(K.VALUE_TARGET).squeeze(-1),
                batch.get(K.RESPONSE_MASK)))
        if self.observe(signals, steps_done=scheduler.last_epoch):
            refresh_lr(scheduler)
            log.info("Critic warm-up ended after %d iterations (%s %.4g at best).",
                     self.iterations, self.until, self.best)
        return metrics

    def _improves(self, value: float, upwards: bool) -> bool:
        if upwards:
            return value >= self.best + self.min_delta
        return value <= self.best - self.min_delta * abs(self.best)

    def state_dict(self) -> dict:
        return {"iterations": self.iterations, "ended_at_step": self.ended_at_step,
                "best": self.best, "stale": self.stale}

    def load_state_dict(self, state: Mapping) -> None:
        self.iterations, self.ended_at_step = state["iterations"], state["ended_at_step"]
        self.best, self.stale = state["best"], state["stale"]


def refresh_lr(scheduler) -> None:
    """Set each group's learning rate for the next step again from ``scheduler``'s schedule (a
    ``LambdaLR``), after something it reads has changed (a warm-up that ended).

    Args:
        scheduler (torch.optim.lr_scheduler.LambdaLR): :func:`make_optimizer`'s scheduler.
    """
    scheduler.last_epoch -= 1
    scheduler.step()  # the same step again: lr = base_lr * lambda(step)
