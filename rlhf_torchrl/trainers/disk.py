"""The disk a run fills, counted once its models and optimiser are built, before the first
iteration: each checkpoint, how many exist at once, the saved policy; a run that would not fit
on its output directory's disk stops there, in one line.

A checkpoint (:func:`~rlhf_torchrl.trainers.checkpoint.save_checkpoint`) holds the trainable
weights in their dtype and AdamW's two moments of each (in the same dtype: two thirds of the
checkpoint), plus the trainer's state, the random states and any rollouts sampled ahead
(kilobytes to megabytes: not counted). ``checkpoint.weights_only=true`` leaves the moments out:
a third of the size, and a resumed run's AdamW starts afresh. The newest checkpoint is written
whole before the oldest beyond ``checkpoint.keep`` is deleted, so ``keep + 1`` exist for a while.
``<output_dir>/policy`` holds the policy's weights (LoRA: the adapters; with
``lora.save_merged``, the merged model in ``policy_merged`` too).

A weight tied to another (an embedding shared with the LM head) is written once per name by the
checkpoint (``torch.distributed.checkpoint``'s state dict keeps both), and counted so.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from rlhf_torchrl.errors import ConfigError

GiB = 2**30


@dataclass
class DiskPlan:
    """What a run writes to its output directory, in bytes.

    Attributes:
        weights: one checkpoint's trainable weights.
        moments: one checkpoint's AdamW moments (0 with ``weights_only``).
        checkpoints: how many checkpoints exist at once, at the most.
        policy: the saved policy (``policy/``, and ``policy_merged/``).
    """

    weights: int
    moments: int
    checkpoints: int
    policy: int

    @property
    def checkpoint(self) -> int:
        """One checkpoint's bytes."""
        return self.weights + self.moments

    @property
    def total(self) -> int:
        """The most the run holds on the disk at once."""
        return self.checkpoints * self.checkpoint + self.policy

    def line(self) -> str:
        """``about 4.9 GiB: 3 checkpoints at once, 1.5 GiB each (1.0 GiB of it AdamW's moments),
        the policy 0.5 GiB``."""
        parts = []
        if self.checkpoints:
            size = f"{self.checkpoint / GiB:.1f} GiB"
            what = (f"1 checkpoint of {size}" if self.checkpoints == 1
                    else f"{self.checkpoints} checkpoints at once, {size} each")
            inside = (f"{self.moments / GiB:.1f} GiB of it AdamW's moments" if self.moments
                      else "weights only")
            parts.append(f"{what} ({inside})")
        if self.policy:
            parts.append(f"the policy {self.policy / GiB:.1f} GiB")
        return f"about {self.total / GiB:.1f} GiB: {', '.join(parts) or 'no checkpoint, no policy'}"


def _bytes(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()  # (a DTensor: its whole shape)
    return total


def checkpoints_held(num_iterations: int, start: int, every: int, keep: int | None) -> int:
    """How many checkpoints exist at once, at the most: one every ``every`` iterations and one
    after the last, from iteration ``start`` on, the newest ``keep`` kept (one more while it is
    written).

    Args:
        num_iterations: the run's iterations.
        start: the iterations done before this run (a resumed run's).
        every: ``checkpoint.every`` (0: none).
        keep: ``checkpoint.keep`` (None: all).
    """
    if not every:
        return 0
    written = len({i for i in range(start + 1, num_iterations + 1)
                   if i % every == 0 or i == num_iterations})
    return written if keep is None else min(written, keep + 1)


def plan_disk(modules: Mapping[str, nn.Module], policy: nn.Module, *, num_iterations: int,
              every: int, keep: int | None, weights_only: bool = False, save_model: bool = True,
              save_merged: bool = False, start: int = 0) -> DiskPlan:
    """The disk a run fills, from its trained modules (the trainer's ``trained_modules``).

    Args:
        modules: the modules whose trainable parameters a checkpoint holds.
        policy: the policy model (the saved policy is its weights; LoRA: its adapters).
        num_iterations: the run's iterations.
        every: ``checkpoint.every``.
        keep: ``checkpoint.keep``.
        weights_only: ``checkpoint.weights_only``: no AdamW moments.
        save_model: ``logging.save_model``: the policy is saved at the end.
        save_merged: ``lora.save_merged``: a LoRA policy is also saved merged.
        start: the iterations a resumed run has done.
    """
    trainable = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    # a checkpoint writes each name of a tied weight (an embedding shared with the LM head) apart
    written = sum(p.numel() * p.element_size() for m in modules.values()
                  for _, p in m.named_parameters(remove_duplicate=False) if p.requires_grad)
    lora = any(p.requires_grad for p in policy.parameters()) and not all(
        p.requires_grad for p in policy.parameters())
    saved = 0
    if save_model:
        adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
        if lora and adapters:
            saved = _bytes(adapters)
            if save_merged:
                saved += _bytes(p for n, p in policy.named_parameters() if "lora_" not in n)
        else:
            saved = _bytes(policy.parameters())
    return DiskPlan(weights=written, moments=0 if weights_only else 2 * _bytes(trainable),
                    checkpoints=checkpoints_held(num_iterations, start, every, keep),
                    policy=saved)


def free_bytes(path: str) -> int:
    """Free bytes on the disk that holds ``path`` (or would: its nearest existing folder)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def reclaimable_bytes(output_dir: str, keep: int | None) -> int:
    """The bytes of the checkpoints already in ``output_dir`` (a resumed run's) that pruning to
    ``keep`` frees as the run writes its own (0 with ``keep=None``: none is deleted). The plan
    counts every checkpoint it holds at once, so these are room it will have.

    Args:
        output_dir: the run's directory.
        keep: ``checkpoint.keep``.
    """
    root = os.path.join(output_dir, "checkpoints")
    if keep is None or not os.path.isdir(root):
        return 0
    total = 0
    for name in os.listdir(root):
        if name.startswith("iter_"):
            for folder, _, files in os.walk(os.path.join(root, name)):
                total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def check_disk(plan: DiskPlan, output_dir: str, keep: int | None = None) -> None:
    """Refuse, in one :class:`ConfigError` line with the settings that write less, a run whose
    output would not fit on the disk of ``output_dir``.

    Args:
        plan: :func:`plan_disk`'s.
        output_dir: the run's directory.
        keep: ``checkpoint.keep``: a resumed run's own checkpoints are pruned to it, and their
            room counts as free.
    """
    free = free_bytes(output_dir) + reclaimable_bytes(output_dir, keep)
    if plan.total <= free:
        return
    fixes = []
    if plan.checkpoints > 1:
        fixes.append("checkpoint.keep=1")
    if plan.moments:
        fixes.append(f"checkpoint.weights_only=true ({plan.weights / GiB:.1f} GiB a checkpoint)")
    if plan.checkpoints:
        fixes.append("checkpoint.every=0 (no checkpoints)")
    fixes.append("an output_dir on a larger disk")
    raise ConfigError(f"This run would write {plan.line()} to {output_dir}, and its disk has "
                      f"{free / GiB:.2f} GiB free: free some space, or set "
                      f"{', '.join(fixes[:-1])} or {fixes[-1]}.")
