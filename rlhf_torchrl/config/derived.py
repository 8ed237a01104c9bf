"""Settings the PPO config implies: each computed from the config in one place, never written
back into it (:func:`rlhf_torchrl.config.builders.resolve_precision` is the one step that writes
``model.autocast=auto``'s resolution and a null ``ppo.tis_cap``'s, so a run's saved config says
what ran).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.distributed import DataParallel
from rlhf_torchrl.modules.models import torch_dtype
from rlhf_torchrl.runtime import native_bf16, resolve_device

#: ``ppo.tis_cap`` when null and the old log-probs are recomputed with other kernels or newer
#: weights than the sampler's (:func:`tis_cap`); verl's default threshold, and the setting the
#: 3-seed comparison of bf16 against fp32 used (docs/experiments.md, "bf16 autocast against fp32")
AUTO_TIS_CAP = 2.0


def precision(cfg: DictConfig) -> tuple[str | None, float | None]:
    """``(model.autocast, ppo.tis_cap)`` as the run uses them: ``model.autocast`` resolved
    (:func:`resolved_autocast`), and ``ppo.tis_cap`` by :func:`tis_cap`'s rule with that autocast.

    Args:
        cfg: the composed PPO config.
    """
    autocast = resolved_autocast(cfg)
    return autocast, tis_cap(cfg, autocast=autocast)


def resolved_autocast(cfg: DictConfig) -> str | None:
    """``model.autocast``, with ``auto`` resolved: ``bfloat16`` where the device computes bf16
    natively (:func:`~rlhf_torchrl.runtime.native_bf16`) and the weights are fp32, else null
    (fp32). An explicit setting is returned as it is.

    Args:
        cfg: the composed PPO config.
    """
    m = cfg.model
    if m.autocast != "auto":
        return m.autocast
    return "bfloat16" if m.dtype == "float32" and native_bf16(resolve_device(cfg.device)) else None


def autocast_dtype(cfg: DictConfig) -> torch.dtype | None:
    """``model.autocast`` as a torch dtype (None: no autocast).

    Args:
        cfg: the composed PPO config.
    """
    return torch_dtype(cfg.model.autocast) if cfg.model.autocast else None


def values_from_sampling(cfg: DictConfig, parallel: DataParallel, *, critic: bool) -> bool:
    """Whether a shared-trunk critic's old values are read off the sampling pass
    (:class:`~rlhf_torchrl.collectors.sampling.ValueRecorder`): when the old log-probs are recorded while
    sampling and the trained model itself samples (the transformers backend, no copy under
    ``collection.overlap`` > 0, no Ray workers, no FSDP2, whose shared trunk runs inside the
    sharded model). Elsewhere the critic computes them.

    Args:
        cfg: the composed PPO config.
        parallel: this process's place in a torchrun job.
        critic: the run has a critic.
    """
    c = cfg.collection
    return (critic and cfg.value_model.init == "shared" and log_probs_from_sampling(cfg)
            and GENERATION_BACKENDS.get(cfg.generation.backend).samples_with_trained_model
            and not parallel.fsdp
            and not c.ray_workers and not c.overlap)


def log_probs_from_sampling(cfg: DictConfig, *, autocast: str | None | bool = False,
                            rule_only: bool = False) -> bool:
    """Old log-probs recorded while sampling, or recomputed (:func:`rlhf_torchrl.collectors.on_policy.log_probs_from_sampling`).

    Args:
        cfg: the composed PPO config.
        autocast: the autocast dtype's name to take in place of ``model.autocast`` (False: the
            config's).
        rule_only: what the rule gives with ``generation.log_probs_from_sampling`` null, whatever
            it is set to: whether the sampler's log-probs equal the training forward's.
    """
    from rlhf_torchrl.collectors.on_policy import log_probs_from_sampling as from_sampling

    return from_sampling(backend=cfg.generation.backend, autocast=cfg.model.autocast if autocast is False else autocast,
                         dtype=cfg.model.dtype, overlap=cfg.collection.overlap,
                         setting=None if rule_only else cfg.generation.log_probs_from_sampling,
                         partial_rollout=cfg.collection.partial_rollout,
                         compiled=cfg.generation.compile)


def tis_cap(cfg: DictConfig, *, autocast: str | None | bool = False) -> float | None:
    """``ppo.tis_cap``; when null, :data:`AUTO_TIS_CAP` wherever the old log-probs are recomputed
    by the training forward while the sampler computed its own another way, else off. One rule,
    decided from what happens, not from how it was asked for: the sampler differs when its
    log-probs would not be the training forward's (:func:`log_probs_from_sampling`'s rule: bf16 or
    fp16 by any spelling, ``model.autocast=auto`` resolved or ``bfloat16``/``float16``, or
    low-precision weights; the vLLM backend; ``collection.overlap`` >= 1 or
    ``collection.partial_rollout``, older weights; a compiled decode step), and the old log-probs
    are recomputed unless ``generation.log_probs_from_sampling=true`` keeps the sampler's (then
    there is nothing to correct). Recomputing where the sampler is the training forward itself
    (fp32, the transformers backend, synchronous) leaves the ratio at 1: no correction.

    Args:
        cfg: the composed PPO config.
        autocast: the autocast dtype's name to take in place of ``model.autocast`` (False: the
            config's, ``auto`` resolved by :func:`resolved_autocast`).
    """
    if cfg.ppo.tis_cap is not None:
        return float(cfg.ppo.tis_cap)
    autocast = resolved_autocast(cfg) if autocast is False else autocast
    recomputed = not log_probs_from_sampling(cfg, autocast=autocast)
    sampler_differs = not log_probs_from_sampling(cfg, autocast=autocast, rule_only=True)
    return AUTO_TIS_CAP if recomputed and sampler_differs else None


def partial_rollout_tokens(cfg: DictConfig) -> int | None:
    """The tokens a response grows per round of partial rollouts: ``collection.partial_rollout_tokens``,
    or a quarter of ``generation.max_new_tokens`` when null (the longest response spans 4 rounds,
    as MindSpeed-RL's ``partial_rollout_max_split``); None without partial rollouts.

    Args:
        cfg: the composed PPO config.
    """
    c = cfg.collection
    if not c.partial_rollout:
        return None
    return c.partial_rollout_tokens or max(1, cfg.generation.max_new_tokens // 4)


def on_policy_tolerance(cfg: DictConfig) -> float:
    """The on-policy check's tolerance (:func:`rlhf_torchrl.collectors.on_policy.on_policy_tolerance`).

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.collectors.on_policy import on_policy_tolerance as tolerance

    engine = GENERATION_BACKENDS.get(cfg.generation.backend).sampler_dtype(cfg)
    return tolerance(autocast=cfg.model.autocast, dtype=cfg.model.dtype,
                     setting=cfg.generation.on_policy_tolerance, sampler_dtype=engine)


def eval_prompt_count(cfg: DictConfig) -> int:
    """The prompts held out of training for evaluation: ``eval.num_prompts``, or 0 when
    ``eval.every=0`` or when the evaluation has a prompt file of its own (``eval.source``).

    Args:
        cfg: the composed PPO config.
    """
    if not cfg.eval.every or OmegaConf.select(cfg, "eval.source"):
        return 0
    return cfg.eval.num_prompts


def response_budget(cfg: DictConfig) -> tuple[int, str, str]:
    """The most tokens a response (an episode's, tool messages included) may take, what bounds
    it, and the setting that lowers it: the evaluation's where it is longer (``eval.max_new_tokens``).

    Args:
        cfg: the composed PPO config.
    """
    e = cfg.env
    turn, turn_setting = cfg.generation.max_new_tokens, "generation.max_new_tokens"
    longer = OmegaConf.select(cfg, "eval.max_new_tokens")
    if longer is not None and longer > turn:
        turn, turn_setting = longer, "eval.max_new_tokens"
    if e.max_turns > 1 and e.max_tokens is not None and e.max_tokens > turn:
        return e.max_tokens, f"env.max_tokens={e.max_tokens}", "env.max_tokens"
    if e.max_turns > 1 and e.max_tokens is None:
        return (e.max_turns * turn, f"env.max_turns={e.max_turns} x {turn_setting}={turn}, the "
                "tool messages on top", "env.max_tokens")
    return turn, f"{turn_setting}={turn}", turn_setting


def overlong_limit(cfg: DictConfig) -> tuple[int, str]:
    """``L_max`` of the overlong penalty (``reward.overlong_buffer``): the most tokens the policy
    itself may write in a response, and what sets it. One response: ``generation.max_new_tokens``;
    a multi-turn episode: ``env.max_turns`` turns of it, at most ``env.max_tokens`` (the tools'
    messages are not the policy's, and do not count).

    Args:
        cfg: the composed PPO config.
    """
    g, e = cfg.generation, cfg.env
    if e.max_turns == 1:
        return g.max_new_tokens, f"generation.max_new_tokens={g.max_new_tokens}"
    turns = e.max_turns * g.max_new_tokens
    if e.max_tokens is not None and e.max_tokens < turns:
        return e.max_tokens, f"env.max_tokens={e.max_tokens}"
    return turns, f"env.max_turns={e.max_turns} x generation.max_new_tokens={g.max_new_tokens}"


def lora_kwargs(cfg: DictConfig) -> dict:
    """The ``lora.*`` settings as :func:`~rlhf_torchrl.modules.lora.add_lora`'s keyword arguments.

    Args:
        cfg: the composed PPO config.
    """
    lora = cfg.lora
    targets = lora.target_modules
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": targets if isinstance(targets, str) else list(targets)}
