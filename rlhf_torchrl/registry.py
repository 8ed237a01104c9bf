"""Registries: the name a config gives to the object that implements it.

Each extension point keeps one :class:`Registry`: advantage estimators
(:data:`~rlhf_torchrl.objectives.advantages.ADVANTAGE_ESTIMATORS`), policy losses
(:data:`~rlhf_torchrl.objectives.policy_losses.POLICY_LOSSES`), generation backends
(:data:`~rlhf_torchrl.collectors.backends.GENERATION_BACKENDS`) and reward kinds
(:data:`~rlhf_torchrl.rewards.kinds.REWARD_KINDS`). An entry registers itself with a decorator
where it is defined, so a new estimator, loss, backend or reward kind is one file::

    from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS, RLOOAdvantage

    @ADVANTAGE_ESTIMATORS.register("my_rloo")
    class MyRLOO(RLOOAdvantage):
        ...

A package of your own is imported before the config is checked when the config names it
(``plugins: [my_pkg.rl_ext]``), and its entries are then settings like the built-in ones
(``advantage.estimator=my_rloo``). What an entry can do (needs a critic, records log-probs while
sampling, takes pushed weights...) is a property of the registered object, never a comparison of
its name.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from rlhf_torchrl.errors import ConfigError

T = TypeVar("T")

#: every registry, by the setting that names its entries (``rlhf-torchrl ppo --help`` lists them)
REGISTRIES: dict[str, Registry] = {}


class Registry(Generic[T]):
    """Names to objects for one config setting; iterating gives the names in registration order.

    Args:
        setting: the config setting whose values are this registry's names
            (``"advantage.estimator"``), named in errors.
        what: what an entry is, in words (``"advantage estimator"``).
    """

    def __init__(self, setting: str, what: str):
        self.setting, self.what = setting, what
        self._entries: dict[str, T] = {}
        REGISTRIES[setting] = self

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """A decorator that registers its object under ``name``; a second object under a taken
        name is refused unless ``replace=True`` (a plugin's deliberate override).

        Args:
            name: the config value that selects the object.
            replace: replace an entry registered under ``name``.
        """
        def add(obj: T) -> T:
            if name in self._entries and not replace and self._entries[name] is not obj:
                raise ValueError(f"{self.what} {name!r} is registered already "
                                 f"({_describe(self._entries[name])}): pass replace=True to override it.")
            self._entries[name] = obj
            if isinstance(obj, type) and "name" not in vars(obj):
                obj.name = name  # the class knows the name it is selected by
            return obj
        return add

    def get(self, name: str) -> T:
        """The object registered as ``name``; one line naming the choices otherwise.

        Args:
            name: a config value.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"{self.setting}={name!r} is not a registered {self.what}: choose one of "
                f"{', '.join(self._entries)}, or register your own and name its module in "
                f"plugins=[...].") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def describe(self) -> list[tuple[str, str]]:
        """``(name, the first line of its docstring)`` per entry, for ``--help``."""
        return [(name, _describe(obj)) for name, obj in self._entries.items()]

    def __repr__(self) -> str:
        return f"Registry({self.setting!r}: {', '.join(self._entries)})"


def _describe(obj) -> str:
    """The first sentence of ``obj``'s docstring, on one line, without reST markup."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if not doc:
        return getattr(obj, "__qualname__", repr(obj))
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    return re.split(r"(?<!\bal)(?<!\bDr)\.\s", text)[0].rstrip(".")


def load_plugins(modules) -> list[str]:
    """Import each module named in ``plugins`` so that its entries register; one line naming the
    module otherwise. Returns the names imported.

    Args:
        modules: dotted module names (``["my_pkg.rl_ext"]``), importable where the run runs.
    """
    loaded = []
    for name in modules or ():
        try:
            importlib.import_module(str(name))
        except ModuleNotFoundError as e:
            if e.name and str(name).startswith(e.name):  # the plugin itself, not its own import
                raise ConfigError(f"plugins: module {name!r} cannot be imported (no module "
                                  f"{e.name!r}): install it or put its folder on PYTHONPATH.") from None
            raise
        loaded.append(str(name))
    return loaded

