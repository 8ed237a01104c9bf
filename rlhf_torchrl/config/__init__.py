"""The PPO and reward-model configuration: schema, defaults and task presets, shipped with the package.

``ppo.yaml`` (every setting with a one-line comment, in construction order), ``task/*.yaml`` (the
presets), ``reward_model.yaml`` and ``serve_reward_model.yaml`` sit in this folder; :mod:`.schema` gives every setting its type,
:mod:`.validation` its choices and range. Importing this module registers them in Hydra's ConfigStore (the files are read
from there only): the schema as ``ppo_schema``, the PPO defaults as ``rlhf_ppo``, reward-model
training as ``rlhf_reward_model``, the reward-model server as ``rlhf_serve_reward_model`` and
each preset in the group ``task``. A Hydra app runs them with
``@hydra.main(config_path=None, config_name="rlhf_ppo")``, or composes them into its own config::

    # my_app.yaml
    defaults:
      - rlhf_ppo          # every PPO setting, the default task included
      - _self_
    ppo:
      batch_size: 16

:func:`compose` builds the config in Python (no command line, no Hydra app)::

    >>> from rlhf_torchrl.config import compose
    >>> cfg = compose(["task=arithmetic", "ppo.batch_size=16", "output_dir=runs/a"])
"""

from __future__ import annotations

import os

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.config import reward_model_schema, schema  # noqa: F401 - registers the schemas

#: the folder of ppo.yaml, reward_model.yaml and task/
CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
#: ConfigStore name of each config file
NAMES = {"ppo": "rlhf_ppo", "reward_model": "rlhf_reward_model",
         "serve_reward_model": "rlhf_serve_reward_model"}


def tasks() -> list[str]:
    """The task presets' names (``task=<name>``)."""
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONFIG_DIR, "task")) if f.endswith(".yaml"))


def _register() -> None:
    store = ConfigStore.instance()
    for name in tasks():
        store.store(group="task", name=name, package="_global_",
                    node=OmegaConf.load(os.path.join(CONFIG_DIR, "task", f"{name}.yaml")))
    for file, name in NAMES.items():
        store.store(name=name, node=OmegaConf.load(os.path.join(CONFIG_DIR, f"{file}.yaml")))


_register()


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "ppo") -> DictConfig:
    """The config ``config_name`` (``ppo``, ``reward_model`` or ``serve_reward_model``) with command-line style
    ``overrides``, composed by Hydra outside any app (``output_dir`` must then be given).

    Args:
        overrides: ``key=value`` overrides, as on the command line.
        config_name: ``ppo``, ``reward_model`` or ``serve_reward_model``.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize

    with initialize(config_path=None, version_base=None):
        return hydra_compose(NAMES.get(config_name, config_name), overrides=list(overrides))


def setting_docs(config_name: str = "ppo") -> dict[str, str]:
    """Each setting's one-line comment in ``<config_name>.yaml``, by dotted key
    (``"ppo.batch_size"``): what ``rlhf-torchrl ppo --help`` and the configuration reference show.

    Args:
        config_name: ``ppo``, ``reward_model`` or ``serve_reward_model``.
    """
    docs = yaml_comments(os.path.join(CONFIG_DIR, f"{config_name}.yaml"))
    return {k: v for k, v in docs.items() if not k.startswith("hydra.")}


def yaml_comments(path: str) -> dict[str, str]:
    """The comment after each setting of a config file (``key``, ``section.key`` or, in a group
    within a section, ``section.group.key``), by dotted key; "" for a setting without one.

    Args:
        path: the YAML file.
    """
    docs, section, group = {}, None, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
                continue
            key, rest = stripped.split(":", 1)
            comment = rest.split(" # ", 1)[1].strip() if " # " in rest else ""
            if not line.startswith(" "):  # a top-level key: a setting or a section
                section, group = key, None
                if rest.split("#", 1)[0].strip():
                    docs[key], section = comment, None
            elif section is not None and line.startswith("  ") and not line.startswith("   "):
                docs[f"{section}.{key}"] = comment
                # a group within the section (reward.judge): its settings are one level deeper
                group = None if rest.split("#", 1)[0].strip() else key
            elif section is not None and group is not None and line.startswith("    ") \
                    and not line.startswith("     "):
                docs[f"{section}.{group}.{key}"] = comment
    return docs
