"""Divergence guards: a NaN or inf is caught where it first appears, by name.

A non-finite reward, log-prob or value spreads through the KL rewards, GAE and the whitening to
every token of the batch, and a non-finite gradient then writes NaN into every weight; by the time a
loss prints ``nan`` the cause is gone. :func:`check_finite` looks at each quantity of a rollout as
soon as it exists (only at valid response tokens: padding is ignored), and
:func:`~rlhf_torchrl.trainers.update.ppo_update` checks the gradient norm before every optimiser step.
Both raise :class:`NonFiniteError`, which names the quantity and how much of it is bad; the recipe
then saves the rollout and skips the iteration or stops (``guards.non_finite``).
"""

from __future__ import annotations

import logging
import os
import shutil

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

#: rollout quantities in the order the pipeline produces them: name -> (key, per token?)
QUANTITIES = {
    "scores": (K.SCORE, False),
    "log-probs": (K.LOG_PROB, True),
    "sampler log-probs": (K.BEHAVIOUR_LOG_PROB, True),
    "reference log-probs": (K.REF_LOG_PROB, True),
    "values": (K.VALUE, True),
    "rewards": (K.REWARD, True),
    "advantages": (K.ADVANTAGE, True),
    "returns": (K.VALUE_TARGET, True),
}


class NonFiniteError(FloatingPointError):
    """A NaN or inf in ``quantity``; ``str()`` says where.

    Args:
        quantity: the rollout entry or metric that holds it (e.g. ``"score"``).
        detail: where in it (rows, a reward's name).
    """

    def __init__(self, quantity: str, detail: str):
        self.quantity = quantity
        super().__init__(f"non-finite {quantity}: {detail}")


class DivergenceError(RuntimeError):
    """The run stopped because a guard fired (a non-finite quantity, the KL ceiling)."""


def check_finite(td: TensorDictBase, names=None) -> None:
    """Raise :class:`NonFiniteError` for the first of ``names`` (default: every quantity of
    :data:`QUANTITIES` present in ``td``) with a NaN or inf at a valid response token (per-token
    quantities) or in any row (scores). A non-finite score is traced to the reward that gave it
    (``("scores", name)`` entries).

    Args:
        td: a rollout.
        names (Sequence[str] | None): the quantities to check (None: every one of :data:`QUANTITIES`
            present).
    """
    keys = td.keys(True)
    mask = td.get(K.RESPONSE_MASK) if K.RESPONSE_MASK in keys else None
    for name in names or QUANTITIES:
        key, per_token = QUANTITIES[name]
        if key not in keys:
            continue
        value = td.get(key)
        if per_token and mask is not None:
            value = value.reshape(mask.shape)
            bad = ~torch.isfinite(value) & mask
            total = int(mask.sum())
        else:
            bad = ~torch.isfinite(value)
            total = bad.numel()
        if bad.any():
            rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
            detail = (f"{int(bad.sum())} of {total} {'tokens' if per_token else 'rows'}, in rows "
                      f"{_few(rows)}")
            if name == "scores":
                detail += _score_sources(td, rows)
            raise NonFiniteError(name, detail)


def _score_sources(td: TensorDictBase, rows: list[int]) -> str:
    if "scores" not in td.keys():
        return ""
    sources = [name for name, value in td.get("scores").items()
               if not torch.isfinite(value[rows]).all()]
    return f" (from {', '.join(repr(s) for s in sources)})" if sources else ""


def _few(items: list, n: int = 8) -> str:
    shown = ", ".join(map(str, items[:n]))
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")


class NonFiniteAction:
    """What the trainer does when :class:`NonFiniteError` fires: the rollout is saved to
    ``<output_dir>/diverged/iter_<k>/`` (by the main process, in TensorDict's own format: memory-
    mapped tensors, JSON for the texts; ``TensorDict.load(path, allow_pickle=False)`` reads it
    back without running any code), then the run stops or the iteration is skipped.

    Args:
        output_dir: the run's directory.
        action: ``"stop"`` (:class:`DivergenceError`) or ``"skip"`` (a warning, no further
            optimiser step).
        is_main: this process saves the rollout (the main process).
    """

    def __init__(self, output_dir: str, action: str = "stop", is_main: bool = True):
        if action not in ("stop", "skip"):
            raise ConfigError(f"action={action!r}: choose stop or skip.")
        self.output_dir, self.action, self.is_main = output_dir, action, is_main

    def __call__(self, error: NonFiniteError, iteration: int, batch: TensorDictBase | None) -> None:
        path = os.path.join(self.output_dir, "diverged", f"iter_{iteration:08d}")
        if self.is_main and batch is not None:
            shutil.rmtree(path, ignore_errors=True)  # (a resumed run meeting it again)
            batch.detach().cpu().save(path)
        message = f"Iteration {iteration}: {error}. The rollout is saved in {path}"
        if self.action == "skip":
            log.warning("%s; the iteration is skipped (guards.non_finite=skip).", message)
            return
        raise DivergenceError(f"{message} (tensordict.TensorDict.load(path, allow_pickle=False) "
                              "reads it). Stopped (guards.non_finite=stop; skip drops such "
                              "iterations instead).")


def check_kl_ceiling(kl: float, iteration: int, *, ceiling: float | None, stop: bool = False) -> None:
    """Warn (or, with ``stop``, raise :class:`DivergenceError`) when the KL to the reference passes
    ``ceiling`` nats per response (None: no ceiling).

    Args:
        kl: the iteration's KL to the reference, in nats per response.
        iteration: the iteration, named in the message.
        ceiling: the KL that triggers it (None: no ceiling).
        stop: raise rather than warn.
    """
    if ceiling is None or kl <= ceiling:
        return
    message = (f"Iteration {iteration}: the KL to the reference, {kl:.3f} nats per response, is "
               f"above guards.kl_ceiling={ceiling}")
    if stop:
        raise DivergenceError(message + ". Stopped (guards.kl_ceiling_stop=true); resume from the "
                              "last checkpoint with a larger ppo.kl_coef or a ppo.kl_target.")
    log.warning("%s: the policy is drifting (raise ppo.kl_coef or set ppo.kl_target).", message)
