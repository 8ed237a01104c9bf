"""The PPO recipe's allowed values and ranges, and the check of a composed config against them
(:func:`validate`): before anything is loaded, each message naming the setting, its value and
what it may be. The allowed values come from the modules that define them. Types and unknown keys:
the schema (:mod:`rlhf_torchrl.config.schema`), checked by Hydra while composing.
"""

import math

from omegaconf import DictConfig

from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.distributed import BALANCE_CHOICES, STRATEGIES
from rlhf_torchrl.envs.sandbox import KINDS as SANDBOXES
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional import (
    KL_ESTIMATORS,
    LM_HEAD_MATMULS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
)
from rlhf_torchrl.modules.packing import PACKING
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS
from rlhf_torchrl.objectives.policy_losses import POLICY_LOSSES
from rlhf_torchrl.record.trackers import LOGGERS
from rlhf_torchrl.registry import Registry, load_plugins
from rlhf_torchrl.rewards.distillation import MAPPINGS as TEACHER_MAPPINGS
from rlhf_torchrl.rewards.judge import JUDGE_BACKENDS
from rlhf_torchrl.rewards.judge import MODES as JUDGE_MODES
from rlhf_torchrl.rewards.judge import SCORINGS as JUDGE_SCORINGS
from rlhf_torchrl.trainers.optim import SCHEDULES, WARMUP_SIGNALS

DTYPES = ("float32", "bfloat16", "float16")
#: setting -> its allowed values (None among them: null is allowed), from the modules that define
#: them where one does
CHOICES = {
    "data.truncate_side": ("left", "right"),
    "data.check_prompts": ("auto", "all", "served"),
    "distributed.strategy": STRATEGIES,
    "distributed.backend": (None, "gloo", "nccl"),
    "distributed.balance": BALANCE_CHOICES,
    "model.dtype": DTYPES,
    "model.autocast": (None, "auto", "bfloat16", "float16"),
    "model.lm_head_matmul": LM_HEAD_MATMULS,
    "model.packing": PACKING,
    "reward.model_dtype": DTYPES,
    "reward.judge.backend": JUDGE_BACKENDS,
    "reward.judge.mode": JUDGE_MODES,
    "reward.judge.scoring": JUDGE_SCORINGS,
    "reward.judge.dtype": DTYPES,
    "reward.teacher_kl_estimator": KL_ESTIMATORS,
    "reward.teacher_mapping": TEACHER_MAPPINGS,
    "reward.teacher_dtype": DTYPES,
    "value_model.init": ("shared", "policy", "reward_model", "model"),
    "generation.backend": GENERATION_BACKENDS,
    "env.python_sandbox": SANDBOXES,
    "vllm.dtype": (None, *DTYPES),
    "ppo.kl_estimator": KL_ESTIMATORS,
    "ppo.loss_aggregation": LOSS_AGGREGATIONS,
    "ppo.off_policy_correction": OFF_POLICY_CORRECTIONS,
    "advantage.estimator": ADVANTAGE_ESTIMATORS,
    "ppo.policy_loss": POLICY_LOSSES,
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
    "reward.overlong_buffer": (1, _INF, True, True),
    "reward.overlong_penalty": (0, _INF, True, True),
    "reward.remote_timeout": (0, _INF, False, True),
    "reward.remote_retries": (0, _INF, True, True),
    "reward.remote_batch_size": (1, _INF, True, True),
    "reward.remote_concurrency": (1, _INF, True, True),
    "reward.judge.max_new_tokens": (1, _INF, True, True),
    "reward.judge.temperature": (0, _INF, True, True),
    "reward.judge.batch_size": (1, _INF, True, True),
    "reward.judge.concurrency": (1, _INF, True, True),
    "reward.judge.timeout": (0, _INF, False, True),
    "reward.judge.retries": (0, _INF, True, True),
    "reward.judge.gpu_memory_utilization": (0, 1, False, True),
    "reward.judge.kv_cache_gb": (0, _INF, False, True),
    "reward.judge.max_model_len": (1, _INF, True, True),
    "reward.judge.max_parse_fail_frac": (0, 1, True, True),
    "reward.teacher_coef": (0, _INF, True, True),
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
    "collection.worker_restarts": (0, _INF, True, True),
    "collection.worker_timeout": (0, _INF, False, True),
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
    "eval.samples_per_prompt": (1, _INF, True, True),
    "eval.max_new_tokens": (1, _INF, True, True),
    "eval.batch_size": (1, _INF, True, True),
    "logging.num_samples": (0, _INF, True, True),
    "logging.log_every": (1, _INF, True, True),
}
#: each ``data.sources`` entry's ranges (a finite weight: ``(0, inf)``)
SOURCE_RANGES = {"weight": (0, _INF, False, False), "limit": (1, _INF, True, True)}


def _describe(low, high, low_in, high_in) -> str:
    if high == _INF:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def validate(cfg: DictConfig, require_set: bool = True) -> None:
    """Raise ``ValueError`` for the first setting outside its choices or range, naming the
    setting, its value and what it may be.

    Args:
        cfg: the composed recipe config.
        require_set: refuse a setting left ``???`` (``data.source`` where no task sets it);
            ``rlhf-torchrl plan`` reads no data and does not.
    """
    from omegaconf import OmegaConf

    missing = OmegaConf.missing_keys(cfg) if require_set else set()
    if OmegaConf.select(cfg, "data.sources"):  # a mixture stands in for data.source
        missing.discard("data.source")
    if missing:
        raise ConfigError(f"{', '.join(sorted(missing))} must be set: the task (task=...) sets it, "
                         "or give it on the command line, e.g. data.source=prompts.jsonl.")
    load_plugins(OmegaConf.select(cfg, "plugins", default=None))  # their entries are choices
    check_choices_and_ranges(cfg, CHOICES, RANGES)
    for i, entry in enumerate(OmegaConf.select(cfg, "data.sources") or []):
        for key, bounds in SOURCE_RANGES.items():
            _check_range(f"data.sources[{i}].{key}", entry[key], bounds)
    check_eval_ks(cfg)


def check_eval_ks(cfg: DictConfig) -> None:
    """``eval.k``: each k of pass@k and maj@k in ``[1, eval.samples_per_prompt]`` (k samples are
    drawn from the n of each prompt), and a verifiable reward to count correct answers with
    (``eval.accuracy_reward``); a ConfigError naming the setting and the fix otherwise.

    Args:
        cfg: the composed recipe config.
    """
    from omegaconf import OmegaConf

    e = cfg.eval
    ks = OmegaConf.select(cfg, "eval.k")
    if ks is None:
        return
    n = e.samples_per_prompt
    shown = "[" + ",".join(str(k) for k in ks) + "]"
    if not ks:
        raise ConfigError(f"eval.k={shown} is empty: give the k of pass@k and maj@k "
                          f"(e.g. eval.k=[1,{n}]), or null for 1, 2, 4, ... up to "
                          "eval.samples_per_prompt.")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ConfigError(f"eval.k={shown}: {bad[0]} is outside [1, eval.samples_per_prompt={n}] "
                          f"(pass@k and maj@k draw k of each prompt's {n} samples): raise "
                          "eval.samples_per_prompt, or lower k.")
    if e.accuracy_reward is None:
        raise ConfigError(f"eval.k={shown} needs eval.accuracy_reward, the verifiable reward "
                          "(1 = correct) whose correct answers pass@k and maj@k count: name one "
                          "of reward.functions, e.g. eval.accuracy_reward=gsm8k_correct.")


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
        if isinstance(allowed, Registry):  # its own line, which names plugins=[...]
            allowed.get(value)
        elif value not in allowed:
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
