"""The module names of the flat layout (before 2026-11-28), kept working for one release.

``import rlhf_torchrl.trainer`` (or a saved config naming ``rlhf_torchrl.reward_functions:fn``)
still imports, with a :class:`DeprecationWarning` naming the new module: the old name is an alias
of the new module, the same object, so ``isinstance`` checks and patches agree. The names that
moved out of what are now packages (``rlhf_torchrl.objectives.make_ppo_loss``,
``rlhf_torchrl.data.check_prompts``) are forwarded by those packages the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module -> its new home (a package's submodules follow it)
MOVED = {
    "rlhf_torchrl.readers": "rlhf_torchrl.data.readers",
    "rlhf_torchrl.prompt_sets": "rlhf_torchrl.data.prompt_sets",
    "rlhf_torchrl.rollout": "rlhf_torchrl.data.rollout",
    "rlhf_torchrl.trajectory": "rlhf_torchrl.data.trajectory",
    "rlhf_torchrl.collectors.env": "rlhf_torchrl.envs.prompt_env",
    "rlhf_torchrl.tools": "rlhf_torchrl.envs.tools",
    "rlhf_torchrl.sandbox": "rlhf_torchrl.envs.sandbox",
    "rlhf_torchrl.sampling": "rlhf_torchrl.collectors.sampling",
    "rlhf_torchrl.on_policy": "rlhf_torchrl.collectors.on_policy",
    "rlhf_torchrl.collectors.generation": "rlhf_torchrl.collectors.backends.transformers",
    "rlhf_torchrl.collectors.vllm": "rlhf_torchrl.collectors.backends.vllm",
    "rlhf_torchrl.model_shapes": "rlhf_torchrl.modules.shapes",
    "rlhf_torchrl.advantages": "rlhf_torchrl.objectives.advantages",
    "rlhf_torchrl.kl_shaping": "rlhf_torchrl.objectives.kl_shaping",
    "rlhf_torchrl.loss_inputs": "rlhf_torchrl.objectives.loss_inputs",
    "rlhf_torchrl.scoring": "rlhf_torchrl.rewards.scoring",
    "rlhf_torchrl.reward_model": "rlhf_torchrl.rewards.reward_model",
    "rlhf_torchrl.reward_functions": "rlhf_torchrl.rewards.functions",
    "rlhf_torchrl.remote_rewards": "rlhf_torchrl.rewards.remote",
    "rlhf_torchrl.reward_server": "rlhf_torchrl.rewards.server",
    "rlhf_torchrl.reward_training": "rlhf_torchrl.rewards.training",
    "rlhf_torchrl.trainer": "rlhf_torchrl.trainers.ppo",
    "rlhf_torchrl.stages": "rlhf_torchrl.trainers.stages",
    "rlhf_torchrl.hooks": "rlhf_torchrl.trainers.hooks",
    "rlhf_torchrl.update": "rlhf_torchrl.trainers.update",
    "rlhf_torchrl.micro_batches": "rlhf_torchrl.trainers.micro_batches",
    "rlhf_torchrl.optim": "rlhf_torchrl.trainers.optim",
    "rlhf_torchrl.guards": "rlhf_torchrl.trainers.guards",
    "rlhf_torchrl.checkpoint": "rlhf_torchrl.trainers.checkpoint",
    "rlhf_torchrl.evaluation": "rlhf_torchrl.trainers.evaluation",
    "rlhf_torchrl.critic_warm_start": "rlhf_torchrl.trainers.warm_start",
    "rlhf_torchrl.metrics": "rlhf_torchrl.record.metrics",
    "rlhf_torchrl.trackers": "rlhf_torchrl.record.trackers",
    "rlhf_torchrl.run_log": "rlhf_torchrl.record.run_log",
    "rlhf_torchrl.report": "rlhf_torchrl.record.report",
}


def new_name(old: str) -> str | None:
    """Where module ``old`` lives now (None: it did not move)."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release.",
                  DeprecationWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the new module itself, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec):
        target = new_name(spec.name)
        warn_moved(spec.name, target, stacklevel=8)
        return importlib.import_module(target)

    def exec_module(self, module):
        pass  # the new module ran already


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder: an old package name
        # (rlhf_torchrl.sandbox) must not load its submodules a second time from the new folder


def forward(package: str, moved_from: str, new_module: str, name: str):
    """A name a package's old module had, from its new module, with a warning (for the package's
    ``__getattr__``); AttributeError where the new module has none either."""
    module = importlib.import_module(new_module)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warn_moved(f"{moved_from}.{name}", f"{new_module}.{name}")
    return getattr(module, name)
