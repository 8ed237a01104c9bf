"""Where hooks attach to a training loop: named stages, TorchRL ``Trainer`` style.

:class:`StagedLoop` is the part of :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer` that is not the
algorithm: the stages (:data:`STAGES`), the ops and hooks registered at them, the iteration's
metrics row they add to, its timers, and a stop a hook may request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import torch
from tensordict import TensorDictBase

#: the stages hooks register at, in the order an iteration reaches them (TorchRL's names where the
#: moment is the same; ``pre_collect``, ``checkpoint`` and ``log`` are this trainer's own)
STAGES = {
    "setup": "once, before the first iteration (after the collector is built): op()",
    "pre_collect": "before sampling: op() -> metrics or None",
    "batch_process": "the rollout, just sampled: op(rollout) -> rollout or None",
    "post_steps": "after the update (a skipped one too): op() -> metrics or None",
    "post_steps_log": "the iteration's global batch, updated on: op(batch) -> metrics or None",
    "checkpoint": "after the update's metrics and the log hooks, before the row is written: "
                  "op() -> metrics or None",
    "log": "the iteration's finished metrics row: op(metrics) -> None",
    "shutdown": "once, after the last iteration: op() -> None",
}


class StagedLoop:
    """Named stages (:data:`STAGES`) that ops and hooks register at; what they return adds to
    the iteration's metrics row (``metrics``)."""

    def __init__(self):
        self.metrics: dict = {}  # the current iteration's row
        self.stop_error: Exception | None = None  # request_stop(): raised once the row is logged
        self.hooks: dict[str, object] = {}  # named hooks (their state goes into state_dict)
        self._ops: dict[str, list[Callable]] = {stage: [] for stage in STAGES}

    def register_op(self, dest: str, op: Callable) -> None:
        """Call ``op`` at stage ``dest`` (:data:`STAGES`) of every iteration, after the ops
        registered there before it. Ops that return a dict add it to the iteration's metrics.

        Args:
            dest: the stage, one of :data:`STAGES`.
            op: called with the stage's arguments (a ``batch_process`` op may return a new rollout).
        """
        if dest not in self._ops:
            raise ValueError(f"Unknown stage {dest!r}: choose one of {', '.join(STAGES)}.")
        self._ops[dest].append(op)

    def register_hook(self, name: str, hook) -> None:
        """Register ``hook`` (a :class:`torchrl.trainers.TrainerHookBase`) under ``name``: it
        picks its stages (``hook.register(trainer, name)``) and its ``state_dict()`` is saved with
        the trainer's.

        Args:
            name: the hook's name, its key in the trainer's ``state_dict()``.
            hook (torchrl.trainers.TrainerHookBase): the hook.
        """
        if name in self.hooks:
            raise ValueError(f"A hook named {name!r} is registered already.")
        self.hooks[name] = hook
        hook.register(self, name)

    def run_stage(self, stage: str, *args):
        """Run ``stage``'s ops; returns the rollout a ``batch_process`` op gave (else the first
        argument)."""
        for op in self._ops[stage]:
            out = op(*args)
            if stage == "batch_process" and isinstance(out, TensorDictBase):
                args = (out,)
            elif isinstance(out, Mapping):
                self.metrics.update(out)
        return args[0] if args else None

    def request_stop(self, error: Exception) -> None:
        """Stop the run with ``error`` once this iteration's metrics are logged (no checkpoint of
        this iteration is written): how a guard stops it.

        Args:
            error: raised after the iteration's metrics are logged.
        """
        self.stop_error = error

    @contextmanager
    def timed(self, name: str):
        """Time the block as ``time/<name>`` in this iteration's metrics; on CUDA, its peak GPU
        memory too, as ``memory/<name>_gpu_gb`` (the most its tensors held, in GiB).

        Args:
            name: the metric's name after ``time/``.
        """
        cuda = torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        self.metrics[f"time/{name}"] = time.perf_counter() - start
        if cuda:
            self.metrics[f"memory/{name}_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
