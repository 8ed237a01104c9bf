"""The private parts of TorchRL this library builds on, each checked against the installed TorchRL.

Reusing TorchRL sometimes means reaching past its public API: ``ClipPPOLoss._log_weight`` (the
log-ratio the off-policy weight and the policy losses extend), ``ClipPPOLoss._clip_bounds`` (the
clip range in log space), ``PPOLoss._AcceptedKeys`` (its default key names),
``DataLoadingPrimer._load_from_dataloader`` (the rows a reset would serve, read without a reset)
and ``ReplayBuffer._rng`` (the minibatch shuffle's generator, saved for an exact resume). A TorchRL
that renames one, or changes its signature, would otherwise fail deep inside the first iteration,
or, worse, run and give other numbers. :func:`check_private_api` compares each with what this
library was written against and refuses a mismatch in one line naming it and the tested version
(:data:`TESTED_TORCHRL`, the version ``pyproject.toml`` pins). It runs when
:mod:`rlhf_torchrl.objectives.ppo` is imported.
"""

from __future__ import annotations

import importlib
import inspect

from rlhf_torchrl.errors import MissingDependencyError

#: the torchrl release the private parts below are checked against (pyproject.toml pins it)
TESTED_TORCHRL = "0.14.1"

#: (module, class, attribute, what it must be): a method's parameter names (self included), or
#: ``"property"``, ``"class"``, ``"instance attribute"``
PRIVATE_API: tuple[tuple[str, str, str, tuple[str, ...] | str], ...] = (
    ("torchrl.objectives", "ClipPPOLoss", "_log_weight", ("self", "tensordict", "adv_shape")),
    ("torchrl.objectives", "ClipPPOLoss", "_clip_bounds", "property"),
    ("torchrl.objectives", "PPOLoss", "_AcceptedKeys", "class"),
    ("torchrl.envs.llm.transforms", "DataLoadingPrimer", "_load_from_dataloader", ("self", "reset")),
    ("torchrl.data", "ReplayBuffer", "_rng", "instance attribute"),
)


def _mismatch(module: str, cls_name: str, attr: str, expected) -> str | None:
    """What differs from ``expected`` in the installed ``module.cls_name.attr`` (None: nothing)."""
    cls = getattr(importlib.import_module(module), cls_name)
    if expected == "instance attribute":
        instance = cls()
        return None if hasattr(instance, attr) else "is gone"
    try:
        static = inspect.getattr_static(cls, attr)
    except AttributeError:
        return "is gone"
    if expected == "property":
        return None if isinstance(static, property) else f"is a {type(static).__name__}, not a property"
    if expected == "class":
        return None if isinstance(static, type) else f"is a {type(static).__name__}, not a class"
    if not callable(static):
        return f"is a {type(static).__name__}, not a method"
    params = tuple(inspect.signature(static).parameters)
    return None if params == tuple(expected) else (
        f"takes ({', '.join(params)}), not ({', '.join(expected)})")


def check_private_api(table=PRIVATE_API) -> None:
    """Refuse an installed TorchRL whose private parts this library uses differ from the tested
    release's: one line naming the first that differs, the installed version and the tested one.

    Args:
        table: ``(module, class, attribute, what it must be)`` rows (:data:`PRIVATE_API`).
    """
    import torchrl

    for module, cls_name, attr, expected in table:
        problem = _mismatch(module, cls_name, attr, expected)
        if problem is not None:
            raise MissingDependencyError(
                f"rlhf_torchrl needs torchrl {TESTED_TORCHRL} (pip install "
                f"'torchrl=={TESTED_TORCHRL}'): it uses {cls_name}.{attr}, which in the installed "
                f"torchrl {torchrl.__version__} {problem}.")
