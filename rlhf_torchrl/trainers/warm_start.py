"""A critic warm-started from the critic another run saved (``value_model.warm_start``): a
separate critic's value head and trunk, weights only. A shared trunk's head is refused
(:func:`shared_trunk_refusal`)."""

from __future__ import annotations

import logging
import os

from torch import nn

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.safe_loading import UnsafeFileError, load_dcp, read_dcp_metadata
from rlhf_torchrl.trainers.checkpoint import (
    CHECKPOINTS,
    WEIGHTS,
    is_checkpoint,
    latest_checkpoint,
    single_process_quiet,
)

log = logging.getLogger(__name__)


def shared_trunk_refusal(path: str) -> str:
    """Why a shared-trunk critic is not warm-started (one line, for the ConfigError): its value
    head was fitted to the features of that run's trained policy, and this run's trunk is its own
    policy as it starts; the head would read features it was never fitted to. A separate critic
    saves its trunk with its head, so it loads whole.

    Args:
        path: the warm start's checkpoint (or run directory), as the user named it.
    """
    return (f"value_model.warm_start={path} with value_model.init=shared: a shared trunk is the "
            "policy's, so the saved value head was fitted to that run's trained policy while this "
            "run's trunk is model.policy as it starts, and the head would read features it was "
            "never fitted to. Warm-start a separate critic, saved with its own trunk: "
            "value_model.init=policy in both runs (or resume that run).")


def critic_checkpoint(path: str) -> str:
    """The checkpoint ``path`` names for a critic warm start: a checkpoint directory, or a run's
    output directory (its newest checkpoint); :class:`~rlhf_torchrl.errors.ConfigError` otherwise.

    Args:
        path: a checkpoint directory or a run's output directory.
    """
    if not is_checkpoint(path):
        newest = latest_checkpoint(path) if os.path.isdir(path) else None
        if newest is None:
            raise ConfigError(f"value_model.warm_start={path}: neither a checkpoint (<run>/"
                              f"{CHECKPOINTS}/iter_<N>) nor a run's output_dir holding one.")
        path = newest
    return path


def saved_weight_names(path: str) -> set[str]:
    """The names of the weights checkpoint ``path`` holds (``policy.…``, ``value_head.…``,
    ``critic_trunk.…``: :attr:`~rlhf_torchrl.trainers.ppo.PPOTrainer.trained_modules`), read from its
    metadata (no tensor is loaded).

    Args:
        path: the checkpoint directory.
    """
    metadata = read_dcp_metadata(os.path.join(path, WEIGHTS))  # (data only: no code runs)
    return {name.removeprefix("model.") for name in metadata.state_dict_metadata
            if name.startswith("model.")}


def load_critic(path: str, critic) -> str:
    """Warm-start ``critic`` (a :class:`~rlhf_torchrl.modules.TokenCritic`) from the critic a
    checkpoint saved: weights only.

    A saved critic is a checkpoint of this library of a run with a separate critic
    (``value_model.init=policy``, ``reward_model`` or ``model``). Loaded: its value head
    (``value_head``) and its trunk (``critic_trunk``). A shared-trunk critic (``critic`` or the
    checkpoint's) is refused: the saved head was fitted to that run's trained policy, not to this
    run's (:func:`shared_trunk_refusal`). Not the policy, the optimiser's moments or the trainer's
    state: the run starts its own optimiser, as NeMo-RL's critic warm start does. Call it before
    the first update. Returns the checkpoint's path.

    Args:
        path: ``<run>/checkpoints/iter_<N>``, or the run's output directory (its newest,
            :func:`critic_checkpoint`).
        critic (rlhf_torchrl.modules.TokenCritic): the critic, loaded in place.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    path = critic_checkpoint(path)
    saved = saved_weight_names(path)
    own_trunk = any(name.startswith("critic_trunk.") for name in saved)
    if not any(name.startswith("value_head.") for name in saved):
        raise ConfigError(f"value_model.warm_start={path}: the checkpoint holds no critic (a "
                          "critic-free run's): give a checkpoint of a run with advantage.estimator=gae.")
    if critic.shares_trunk:
        raise ConfigError(shared_trunk_refusal(path))
    if not own_trunk:
        raise ConfigError(f"value_model.warm_start={path}: the checkpoint's critic has the "
                          "policy's trunk (value_model.init=shared) and this run's its own: "
                          "warm-start from a run with a separate critic (value_model.init=policy).")
    modules = nn.ModuleDict({"value_head": critic.head, "critic_trunk": critic.backbone})
    trainable = {name for name, p in modules.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    state = {k: v for k, v in get_model_state_dict(
        modules, options=StateDictOptions(ignore_frozen_params=True)).items() if k in trainable}
    missing = sorted(set(state) - saved)
    if missing:
        raise ConfigError(f"value_model.warm_start={path}: the checkpoint's critic lacks "
                          f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: it was "
                          "trained on another model (or LoRA setting) than this run's critic.")
    try:
        with single_process_quiet():
            load_dcp({"model": state}, os.path.join(path, WEIGHTS))
    except UnsafeFileError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - another model's shapes, a torn file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"value_model.warm_start={path}: its critic does not load into this "
                          f"run's ({type(e).__name__}: {first[:200]}).") from e
    set_model_state_dict(modules, state, options=StateDictOptions(strict=False))
    log.info("Critic warm-started from %s (%s)", path, ", ".join(modules.keys()))
    return path
