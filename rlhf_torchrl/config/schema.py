"""The PPO recipe's config schema: every setting's type (Hydra structured config).

``config/ppo.yaml`` holds the defaults and their documentation; this schema sits under it
(``defaults: [ppo_schema, _self_]``), so Hydra rejects a value of the wrong type or an unknown key
while composing (``ppo.batch_size=abc``: "Value 'abc' of type 'str' could not be converted to
Integer, full_key: ppo.batch_size"). The allowed values and ranges, checked before anything is
loaded: :mod:`rlhf_torchrl.config.validation`.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class Distributed:
    """Types of the ``distributed.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    strategy: str = MISSING
    backend: str | None = MISSING
    balance: Any = MISSING  # false, true or "auto"


@dataclass
class Checkpoint:
    """Types of the ``checkpoint.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    every: int = MISSING
    keep: int | None = MISSING
    weights_only: bool = MISSING


@dataclass
class Model:
    """Types of the ``model.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    policy: str = MISSING
    reference: str | None = MISSING
    dtype: str = MISSING
    autocast: str | None = MISSING
    lm_head_matmul: str = MISSING
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    r: int = MISSING
    alpha: float = MISSING
    dropout: float = MISSING
    target_modules: Any = MISSING  # all-linear, or a list of module names
    critic: bool = MISSING
    save_merged: bool = MISSING


@dataclass
class Judge:
    """Types of the ``reward.judge.*`` settings (the ``judge`` entry of ``reward.functions``).

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    backend: str = MISSING
    model: str | None = MISSING
    url: str | None = MISSING
    token_env: str | None = MISSING
    mode: str = MISSING
    scoring: str = MISSING
    rubric: str | None = MISSING
    system_prompt: str | None = MISSING
    parse_regex: str | None = MISSING
    score_min: float = MISSING
    score_max: float = MISSING
    options: list[str] = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    reference: str | None = MISSING
    both_orders: bool = MISSING
    batch_size: int = MISSING
    concurrency: int = MISSING
    timeout: float = MISSING
    retries: int = MISSING
    dtype: str = MISSING
    chat_template: str | None = MISSING
    gpu_memory_utilization: float = MISSING
    kv_cache_gb: float = MISSING
    max_model_len: int | None = MISSING
    max_parse_fail_frac: float = MISSING


@dataclass
class Reward:
    """Types of the ``reward.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    overlong_buffer: int | None = MISSING
    overlong_penalty: float = MISSING
    normalize_per_source: bool = MISSING
    step_delimiter: str = MISSING
    step_marker: str | None = MISSING
    prm_step_tag: str = MISSING
    prm_good_token: str = MISSING
    prm_bad_token: str = MISSING
    prm_step_separator: str = MISSING
    prm_prompt_column: str | None = MISSING
    teacher: str | None = MISSING
    teacher_coef: float = MISSING
    teacher_kl_estimator: str = MISSING
    teacher_mapping: str = MISSING
    teacher_dtype: str = MISSING
    teacher_offload: bool = MISSING
    judge: Judge = field(default_factory=Judge)


@dataclass
class ValueModel:
    """Types of the ``value_model.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    init: str = MISSING
    name_or_path: str | None = MISSING
    warm_start: str | None = MISSING


@dataclass
class Generation:
    """Types of the ``generation.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    backend: str = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    samples_per_prompt: int = MISSING
    compile: bool = MISSING
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    overlap: int | None = MISSING
    ray_workers: int = MISSING
    ray_address: str | None = MISSING
    ray_cpus_per_worker: float = MISSING
    ray_gpus_per_worker: float = MISSING
    worker_restarts: int = MISSING
    worker_timeout: float = MISSING
    partial_rollout: bool = MISSING
    partial_rollout_tokens: int | None = MISSING


@dataclass
class VLLM:
    """Types of the ``vllm.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    policy_loss: str = MISSING
    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    kl_loss_coef: float = MISSING
    positive_nll_coef: float = MISSING
    positive_nll_threshold: float = MISSING


@dataclass
class Advantage:
    """Types of the ``advantage.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    estimator: str = MISSING
    scale_by_std: bool = MISSING
    filter_groups: bool = MISSING


@dataclass
class Optim:
    """Types of the ``optim.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    every: int = MISSING
    num_prompts: int = MISSING
    temperature: float = MISSING
    judge: str | None = MISSING
    accuracy_reward: str | None = MISSING
    samples_per_prompt: int = MISSING
    k: list[int] | None = MISSING
    max_new_tokens: int | None = MISSING
    batch_size: int = MISSING
    source: str | None = MISSING


@dataclass
class Guards:
    """Types of the ``guards.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    non_finite: str = MISSING
    kl_ceiling: float | None = MISSING
    kl_ceiling_stop: bool = MISSING


@dataclass
class Logging:
    """Types of the ``logging.*`` settings.

    Each field is the setting of that name, described with its default and allowed values in the
    :doc:`configuration reference </configuration>` (from ``ppo.yaml``'s comments, which
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
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
    ``rlhf-torchrl ppo --help`` shows too); :func:`~rlhf_torchrl.config.validation.validate` checks the choices and ranges.
    """

    seed: int = MISSING
    device: str = MISSING
    threads: int | None = MISSING
    reuse_freed_memory: bool = MISSING
    output_dir: str = MISSING
    resume: str = MISSING
    plugins: list[str] = field(default_factory=list)
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
