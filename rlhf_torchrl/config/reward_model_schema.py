"""The schemas of the reward-model commands' configs, as :mod:`.schema` is the PPO config's:
every setting's type (Hydra structured configs under ``reward_model.yaml`` and
``serve_reward_model.yaml``: ``defaults: [<name>_schema, _self_]``), allowed values and range
(:func:`validate_reward_model`, :func:`validate_serve_reward_model`), each message naming the
setting, its value and what it may be.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from rlhf_torchrl.config.validation import _INF, DTYPES, check_choices_and_ranges
from rlhf_torchrl.errors import ConfigError


@dataclass
class RewardModelModel:
    """Types of ``reward_model.yaml``'s ``model.*`` settings (described there)."""

    name: str = MISSING
    dtype: str = MISSING
    max_length: int = MISSING


@dataclass
class RewardModelData:
    """Types of ``reward_model.yaml``'s ``data.*`` settings (described there)."""

    source: str = MISSING
    split: str = MISSING
    prompt_column: str = MISSING
    chosen_column: str = MISSING
    rejected_column: str = MISSING
    eval_fraction: float = MISSING
    limit: int | None = MISSING


@dataclass
class RewardModelTrain:
    """Types of ``reward_model.yaml``'s ``train.*`` settings (described there)."""

    epochs: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    max_grad_norm: float | None = MISSING
    normalize: bool = MISSING


@dataclass
class RewardModelConfig:
    """Types of the whole ``reward_model.yaml`` (``rlhf-torchrl reward-model``)."""

    seed: int = MISSING
    output_dir: str = MISSING
    model: RewardModelModel = field(default_factory=RewardModelModel)
    data: RewardModelData = field(default_factory=RewardModelData)
    train: RewardModelTrain = field(default_factory=RewardModelTrain)


@dataclass
class ServeRewardModelConfig:
    """Types of ``serve_reward_model.yaml`` (``rlhf-torchrl serve-reward-model``)."""

    model: str = MISSING
    dtype: str = MISSING
    device: str = MISSING
    threads: int | None = MISSING
    batch_size: int = MISSING
    max_length: int | None = MISSING
    host: str = MISSING
    port: int = MISSING
    token_env: str | None = MISSING
    max_request_mb: float = MISSING
    max_request_responses: int = MISSING
    max_text_tokens: int = MISSING
    body_timeout_s: float = MISSING
    max_batch: int = MISSING
    max_wait_ms: float = MISSING


ConfigStore.instance().store(name="reward_model_schema", node=RewardModelConfig)
ConfigStore.instance().store(name="serve_reward_model_schema", node=ServeRewardModelConfig)

#: ``reward_model.yaml``: setting -> its allowed values
REWARD_MODEL_CHOICES = {"model.dtype": DTYPES}
#: ``reward_model.yaml``: setting -> (low, high, low inclusive, high inclusive)
REWARD_MODEL_RANGES = {
    "model.max_length": (1, _INF, True, True),
    "data.eval_fraction": (0, 1, False, False),
    "data.limit": (1, _INF, True, True),
    "train.epochs": (1, _INF, True, True),
    "train.batch_size": (1, _INF, True, True),
    "train.lr": (0, _INF, False, True),
    "train.weight_decay": (0, _INF, True, True),
    "train.max_grad_norm": (0, _INF, False, True),
}
#: ``serve_reward_model.yaml``: setting -> its allowed values
SERVE_CHOICES = {"dtype": DTYPES}
#: ``serve_reward_model.yaml``: setting -> (low, high, low inclusive, high inclusive)
SERVE_RANGES = {
    "threads": (1, _INF, True, True),
    "batch_size": (1, _INF, True, True),
    "max_length": (1, _INF, True, True),
    "port": (0, 65535, True, True),
    "max_request_mb": (0, _INF, False, True),
    "max_request_responses": (1, _INF, True, True),
    "max_text_tokens": (1, _INF, True, True),
    "body_timeout_s": (0, _INF, False, True),
    "max_batch": (1, _INF, True, True),
    "max_wait_ms": (0, _INF, True, True),
}


def validate_reward_model(cfg: DictConfig) -> None:
    """A :class:`~rlhf_torchrl.errors.ConfigError` for the first setting of ``reward_model.yaml``
    outside its choices or range.

    Args:
        cfg: the composed reward-model config.
    """
    check_choices_and_ranges(cfg, REWARD_MODEL_CHOICES, REWARD_MODEL_RANGES)


def validate_serve_reward_model(cfg: DictConfig) -> None:
    """A :class:`~rlhf_torchrl.errors.ConfigError` for ``model`` left unset or the first setting of
    ``serve_reward_model.yaml`` outside its choices or range.

    Args:
        cfg: the composed server config.
    """
    if OmegaConf.is_missing(cfg, "model"):
        raise ConfigError("model must be set: rlhf-torchrl serve-reward-model model=<a reward "
                          "model's directory or hub id> (port=8000).")
    check_choices_and_ranges(cfg, SERVE_CHOICES, SERVE_RANGES)
