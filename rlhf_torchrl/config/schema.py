"""The PPO recipe's config schema: every setting's type (Hydra structured config), allowed values
and range.

``config/ppo.yaml`` holds the defaults and their documentation; this schema sits under it
(``defaults: [ppo_schema, _self_]``), so Hydra rejects a value of the wrong type or an unknown key
while composing (``ppo.batch_size=abc``: "Value 'abc' of type 'str' could not be converted to
Integer, full_key: ppo.batch_size"), and :func:`validate` checks choices and ranges before anything
is loaded, each message naming the setting, its value and what it may be.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from ..advantages import ESTIMATORS
from ..distributed import STRATEGIES
from ..errors import ConfigError
from ..functional import KL_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY_CORRECTIONS
from ..modules.packing import PACKING
from ..optim import SCHEDULES, WARMUP_SIGNALS
from ..sandbox import KINDS as SANDBOXES
from ..trackers import LOGGERS


@dataclass
class Distributed:
    """Types of the ``distributed.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    strategy: str = MISSING
    backend: str | None = MISSING


@dataclass
class Checkpoint:
    """Types of the ``checkpoint.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    every: int = MISSING
    keep: int | None = MISSING


@dataclass
class Model:
    """Types of the ``model.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    policy: str = MISSING
    reference: str | None = MISSING
    dtype: str = MISSING
    autocast: str | None = MISSING
    gradient_checkpointing: bool = MISSING
    attn_implementation: str | None = MISSING
    packing: Any = MISSING  # false, true or "auto"
    compile: bool = MISSING
    offload_reference: bool = MISSING


@dataclass
class DataSource:
    """One source of a mixture (``data.sources``): its weight, and the ``data.*`` loading
    settings it sets for itself (null: ``data.*``'s).

    Each field is described under ``data.sources`` in the
    :doc:`configuration reference </configuration>`.
    """

    source: str = MISSING
    weight: float = 1.0
    config: str | None = None
    split: str | None = None
    column: str | None = None
    template: str | None = None
    limit: int | None = None


@dataclass
class Data:
    """Types of the ``data.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    source: str = MISSING
    sources: list[DataSource] = MISSING
    config: str | None = MISSING
    generator_args: dict[str, Any] = MISSING
    split: str = MISSING
    column: str = MISSING
    template: str | None = MISSING
    limit: int | None = MISSING
    check_prompts: str = MISSING
    max_words: int | None = MISSING
    max_prompt_length: int = MISSING
    truncate_prompts: bool = MISSING
    truncate_side: str = MISSING
    truncate_at: str | None = MISSING
    system_prompt: str | None = MISSING
    chat_template: str | None = MISSING


@dataclass
class Lora:
    """Types of the ``lora.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    r: int = MISSING
    alpha: float = MISSING
    dropout: float = MISSING
    target_modules: Any = MISSING  # all-linear, or a list of module names
    critic: bool = MISSING
    save_merged: bool = MISSING


@dataclass
class Reward:
    """Types of the ``reward.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    model: str | None = MISSING
    model_weight: float = MISSING
    model_batch_size: int = MISSING
    model_dtype: str = MISSING
    offload: bool = MISSING
    remote_url: str | None = MISSING
    remote_token_env: str | None = MISSING
    remote_timeout: float = MISSING
    remote_retries: int = MISSING
    remote_batch_size: int = MISSING
    remote_concurrency: int = MISSING
    remote_label_column: str | None = MISSING
    functions: list[str] | None = MISSING
    function_weights: list[float] | None = MISSING
    missing_eos_penalty: float | None = MISSING
    whiten_scores: bool = MISSING
    score_clip: float | None = MISSING


@dataclass
class ValueModel:
    """Types of the ``value_model.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    init: str = MISSING
    name_or_path: str | None = MISSING
    warm_start: str | None = MISSING


@dataclass
class Generation:
    """Types of the ``generation.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    backend: str = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    samples_per_prompt: int = MISSING
    stop_token: str | None = MISSING
    log_probs_from_sampling: bool | None = MISSING
    check_on_policy: bool = MISSING
    on_policy_rows: int = MISSING
    on_policy_tolerance: float | None = MISSING


@dataclass
class Env:
    """Types of the ``env.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    max_turns: int = MISSING
    tools: list[str] = MISSING
    max_tokens: int | None = MISSING
    tool_timeout: float = MISSING
    describe_tools: bool = MISSING
    python_sandbox: str = MISSING
    sandbox_url: str | None = MISSING
    python_memory_mb: int = MISSING
    python_max_processes: int = MISSING
    python_max_output_bytes: int = MISSING
    python_scratch_mb: int = MISSING


@dataclass
class Collection:
    """Types of the ``collection.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    overlap: int | None = MISSING
    ray_workers: int = MISSING
    ray_address: str | None = MISSING
    ray_cpus_per_worker: float = MISSING
    ray_gpus_per_worker: float = MISSING
    partial_rollout: bool = MISSING
    partial_rollout_tokens: int | None = MISSING


@dataclass
class VLLM:
    """Types of the ``vllm.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    dtype: str | None = MISSING
    max_model_len: int | None = MISSING
    gpu_memory_utilization: float = MISSING
    kv_cache_gb: float = MISSING
    enforce_eager: bool = MISSING
    sleep: bool | None = MISSING
    tensor_parallel_size: int = MISSING


@dataclass
class PPO:
    """Types of the ``ppo.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    num_iterations: int = MISSING
    batch_size: int = MISSING
    num_mini_batches: int = MISSING
    gradient_accumulation_steps: int = MISSING
    micro_batch_tokens: int | None = MISSING
    num_ppo_epochs: int = MISSING
    critic_epochs: int | None = MISSING
    forward_batch_size: int = MISSING
    kl_coef: float = MISSING
    kl_estimator: str = MISSING
    kl_target: float | None = MISSING
    kl_horizon: int = MISSING
    gamma: float = MISSING
    lmbda: float = MISSING
    lmbda_critic: float | None = MISSING
    lmbda_length_alpha: float | None = MISSING
    whiten_advantages: bool = MISSING
    clip_epsilon: float = MISSING
    clip_epsilon_low: float | None = MISSING
    clip_epsilon_high: float | None = MISSING
    dual_clip: float | None = MISSING
    loss_aggregation: str = MISSING
    loss_aggregation_constant: float | None = MISSING
    clip_value: float | None = MISSING
    vf_coef: float = MISSING
    entropy_coef: float = MISSING
    tis_cap: float | None = MISSING
    off_policy_correction: str = MISSING
    off_policy_low: float | None = MISSING
    kl_loss_coef: float = MISSING
    positive_nll_coef: float = MISSING
    positive_nll_threshold: float = MISSING


@dataclass
class Advantage:
    """Types of the ``advantage.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    estimator: str = MISSING
    scale_by_std: bool = MISSING
    filter_groups: bool = MISSING


@dataclass
class Optim:
    """Types of the ``optim.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    lr: float = MISSING
    critic_lr: float | None = MISSING
    value_head_lr: float | None = MISSING
    weight_decay: float = MISSING
    eps: float = MISSING
    max_grad_norm: float | None = MISSING
    lr_schedule: str = MISSING
    warmup_steps: int = MISSING
    critic_warmup: int = MISSING
    critic_warmup_until: str | None = MISSING
    critic_warmup_patience: int = MISSING
    critic_warmup_min_delta: float = MISSING


@dataclass
class Eval:
    """Types of the ``eval.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    every: int = MISSING
    num_prompts: int = MISSING
    temperature: float = MISSING
    judge: str | None = MISSING
    accuracy_reward: str | None = MISSING


@dataclass
class Guards:
    """Types of the ``guards.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    non_finite: str = MISSING
    kl_ceiling: float | None = MISSING
    kl_ceiling_stop: bool = MISSING


@dataclass
class Logging:
    """Types of the ``logging.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    logger: str | None = MISSING
    project: str = MISSING
    run_name: str | None = MISSING
    tags: list[str] = MISSING
    num_samples: int = MISSING
    progress_bar: bool = MISSING
    log_every: int | None = MISSING
    exact_entropy: bool = MISSING
    save_model: bool = MISSING


@dataclass
class PPOConfig:
    """Types of the whole PPO config: the top-level settings, and one field per group.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`validate` checks the choices and ranges.
    """

    seed: int = MISSING
    device: str = MISSING
    threads: int | None = MISSING
    reuse_freed_memory: bool = MISSING
    output_dir: str = MISSING
    resume: str = MISSING
    distributed: Distributed = field(default_factory=Distributed)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    lora: Lora = field(default_factory=Lora)
    reward: Reward = field(default_factory=Reward)
    value_model: ValueModel = field(default_factory=ValueModel)
    generation: Generation = field(default_factory=Generation)
    env: Env = field(default_factory=Env)
    collection: Collection = field(default_factory=Collection)
    vllm: VLLM = field(default_factory=VLLM)
    ppo: PPO = field(default_factory=PPO)
    advantage: Advantage = field(default_factory=Advantage)
    optim: Optim = field(default_factory=Optim)
    eval: Eval = field(default_factory=Eval)
    guards: Guards = field(default_factory=Guards)
    logging: Logging = field(default_factory=Logging)


ConfigStore.instance().store(name="ppo_schema", node=PPOConfig)

DTYPES = ("float32", "bfloat16", "float16")
#: setting -> its allowed values (None among them: null is allowed), from the modules that define
#: them where one does
CHOICES = {
    "data.truncate_side": ("left", "right"),
    "data.check_prompts": ("auto", "all", "served"),
    "distributed.strategy": STRATEGIES,
    "distributed.backend": (None, "gloo", "nccl"),
    "model.dtype": DTYPES,
    "model.autocast": (None, "auto", "bfloat16", "float16"),
    "model.packing": PACKING,
    "reward.model_dtype": DTYPES,
    "value_model.init": ("shared", "policy", "reward_model", "model"),
    "generation.backend": ("transformers", "vllm"),
    "env.python_sandbox": SANDBOXES,
    "vllm.dtype": (None, *DTYPES),
    "ppo.kl_estimator": KL_ESTIMATORS,
    "ppo.loss_aggregation": LOSS_AGGREGATIONS,
    "ppo.off_policy_correction": OFF_POLICY_CORRECTIONS,
    "advantage.estimator": ESTIMATORS,
    "optim.lr_schedule": SCHEDULES,
    "optim.critic_warmup_until": (None, *WARMUP_SIGNALS),
    "guards.non_finite": ("stop", "skip"),
    "logging.logger": (None, *LOGGERS),
}

_INF = math.inf
#: setting -> (low, high, low inclusive, high inclusive); null passes where the type allows it
RANGES = {
    "optim.warmup_steps": (0, _INF, True, True),
    "optim.critic_warmup": (0, _INF, True, True),
    "optim.critic_warmup_patience": (1, _INF, True, True),
    "optim.critic_warmup_min_delta": (0, _INF, True, True),
    "threads": (1, _INF, True, True),
    "checkpoint.every": (0, _INF, True, True),
    "checkpoint.keep": (1, _INF, True, True),
    "data.limit": (1, _INF, True, True),
    "data.max_words": (1, _INF, True, True),
    "data.max_prompt_length": (1, _INF, True, True),
    "lora.r": (0, _INF, True, True),
    "lora.alpha": (0, _INF, False, True),
    "lora.dropout": (0, 1, True, False),
    "reward.model_batch_size": (1, _INF, True, True),
    "reward.missing_eos_penalty": (0, _INF, True, True),
    "reward.score_clip": (0, _INF, False, True),
    "reward.remote_timeout": (0, _INF, False, True),
    "reward.remote_retries": (0, _INF, True, True),
    "reward.remote_batch_size": (1, _INF, True, True),
    "reward.remote_concurrency": (1, _INF, True, True),
    "generation.max_new_tokens": (1, _INF, True, True),
    "generation.temperature": (0, _INF, False, True),
    "generation.top_k": (0, _INF, True, True),
    "generation.top_p": (0, 1, False, True),
    "generation.samples_per_prompt": (1, _INF, True, True),
    "generation.on_policy_rows": (1, _INF, True, True),
    "generation.on_policy_tolerance": (0, _INF, True, True),
    "env.max_turns": (1, _INF, True, True),
    "env.max_tokens": (1, _INF, True, True),
    "env.tool_timeout": (0, _INF, False, True),
    "env.python_memory_mb": (32, _INF, True, True),
    "env.python_max_processes": (2, _INF, True, True),
    "env.python_max_output_bytes": (1, _INF, True, True),
    "env.python_scratch_mb": (1, _INF, True, True),
    "collection.overlap": (0, _INF, True, True),
    "collection.ray_workers": (0, _INF, True, True),
    "collection.ray_cpus_per_worker": (0, _INF, True, True),
    "collection.ray_gpus_per_worker": (0, _INF, True, True),
    "collection.partial_rollout_tokens": (1, _INF, True, True),
    "vllm.max_model_len": (1, _INF, True, True),
    "vllm.gpu_memory_utilization": (0, 1, False, True),
    "vllm.kv_cache_gb": (0, _INF, False, True),
    "vllm.tensor_parallel_size": (1, _INF, True, True),
    "ppo.num_iterations": (1, _INF, True, True),
    "ppo.batch_size": (1, _INF, True, True),
    "ppo.num_mini_batches": (1, _INF, True, True),
    "ppo.gradient_accumulation_steps": (1, _INF, True, True),
    "ppo.micro_batch_tokens": (1, _INF, True, True),
    "ppo.num_ppo_epochs": (1, _INF, True, True),
    "ppo.critic_epochs": (1, _INF, True, True),
    "ppo.forward_batch_size": (1, _INF, True, True),
    "ppo.kl_coef": (0, _INF, True, True),
    "ppo.kl_target": (0, _INF, False, True),
    "ppo.kl_horizon": (1, _INF, True, True),
    "ppo.gamma": (0, 1, True, True),
    "ppo.lmbda": (0, 1, True, True),
    "ppo.lmbda_critic": (0, 1, True, True),
    "ppo.lmbda_length_alpha": (0, _INF, False, True),
    "ppo.clip_epsilon": (0, _INF, False, True),
    "ppo.clip_epsilon_low": (0, 1, False, False),  # 1 - eps_low > 0
    "ppo.clip_epsilon_high": (0, _INF, False, True),
    "ppo.dual_clip": (1, _INF, False, True),
    "ppo.loss_aggregation_constant": (0, _INF, False, True),
    "ppo.clip_value": (0, _INF, False, True),
    "ppo.vf_coef": (0, _INF, True, True),
    "ppo.entropy_coef": (0, _INF, True, True),
    "ppo.tis_cap": (0, _INF, False, True),
    "ppo.off_policy_low": (0, _INF, False, True),
    "ppo.kl_loss_coef": (0, _INF, True, True),
    "ppo.positive_nll_coef": (0, _INF, True, True),
    "optim.lr": (0, _INF, False, True),
    "optim.critic_lr": (0, _INF, False, True),
    "optim.value_head_lr": (0, _INF, False, True),
    "optim.weight_decay": (0, _INF, True, True),
    "optim.eps": (0, _INF, False, True),
    "optim.max_grad_norm": (0, _INF, False, True),
    "guards.kl_ceiling": (0, _INF, False, True),
    "eval.every": (0, _INF, True, True),
    "eval.num_prompts": (1, _INF, True, True),
    "eval.temperature": (0, _INF, False, True),
    "logging.num_samples": (0, _INF, True, True),
    "logging.log_every": (1, _INF, True, True),
}
#: each ``data.sources`` entry's ranges (a finite weight: ``(0, inf)``)
SOURCE_RANGES = {"weight": (0, _INF, False, False), "limit": (1, _INF, True, True)}


def _describe(low, high, low_in, high_in) -> str:
    if high == _INF:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def validate(cfg: DictConfig) -> None:
    """Raise ``ValueError`` for the first setting outside its choices or range, naming the
    setting, its value and what it may be.

    Args:
        cfg: the composed recipe config.
    """
    from omegaconf import OmegaConf

    missing = OmegaConf.missing_keys(cfg)
    if OmegaConf.select(cfg, "data.sources"):  # a mixture stands in for data.source
        missing.discard("data.source")
    if missing:
        raise ConfigError(f"{', '.join(sorted(missing))} must be set: the task (task=...) sets it, "
                         "or give it on the command line, e.g. data.source=prompts.jsonl.")
    check_choices_and_ranges(cfg, CHOICES, RANGES)
    for i, entry in enumerate(OmegaConf.select(cfg, "data.sources") or []):
        for key, bounds in SOURCE_RANGES.items():
            _check_range(f"data.sources[{i}].{key}", entry[key], bounds)


def check_choices_and_ranges(cfg: DictConfig, choices: dict, ranges: dict) -> None:
    """A ConfigError for the first setting of ``cfg`` outside its ``choices`` (setting -> allowed
    values) or ``ranges`` (setting -> (low, high, low inclusive, high inclusive)), naming both.

    Args:
        cfg: a composed config.
        choices: as :data:`CHOICES`.
        ranges: as :data:`RANGES`.
    """
    from omegaconf import OmegaConf

    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a).lower() if isinstance(a, bool)
                              else a for a in allowed)
            raise ConfigError(f"{key}={value!r} is not one of the allowed values: {shown}.")
    for key, bounds in ranges.items():
        _check_range(key, OmegaConf.select(cfg, key), bounds)


def _check_range(key: str, value, bounds) -> None:
    """``key=value`` inside ``bounds`` (null passes), or a ConfigError naming both."""
    if value is None:
        return
    low, high, low_in, high_in = bounds
    inside = (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
    if not inside or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{key}={value} is out of range: it must be {_describe(*bounds)}.")
