"""Config to components: each ``make_*`` turns one config group into library objects with
explicit keyword arguments (tokenizer, models, rewards, tools, collector spec, loss, optimiser).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.collectors.factory import CollectorSpec
from rlhf_torchrl.config.derived import (
    autocast_dtype,
    log_probs_from_sampling,
    lora_kwargs,
    partial_rollout_tokens,
    tis_cap,
)
from rlhf_torchrl.data.rollout import probe_rollout
from rlhf_torchrl.distributed import DataParallel, init_data_parallel
from rlhf_torchrl.envs.sandbox import SandboxSpec
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import load_tokenizer
from rlhf_torchrl.objectives.advantages import make_advantage as advantage_module
from rlhf_torchrl.objectives.advantages import needs_critic
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.rewards.scoring import Scorer
from rlhf_torchrl.runtime import ThreadTuner, resolve_device
from rlhf_torchrl.trainers.update import make_minibatch_buffer

if TYPE_CHECKING:
    from rlhf_torchrl.config.checks import Sizes


def critic_free(cfg: DictConfig) -> bool:
    """Whether ``advantage.estimator``'s estimator reads no values
    (:func:`~rlhf_torchrl.objectives.advantages.needs_critic`): no value model is built.

    Args:
        cfg: the composed PPO config.
    """
    return not needs_critic(make_advantage(cfg))


def make_device(cfg: DictConfig) -> torch.device:
    device = resolve_device(cfg.device)
    GENERATION_BACKENDS.get(cfg.generation.backend).check(cfg, device)
    return device


def make_data_parallel(cfg: DictConfig, device: torch.device) -> DataParallel:
    """This process's place in a torchrun job (the single process without one)."""
    return init_data_parallel(cfg.distributed.strategy, device=device, backend=cfg.distributed.backend,
                              balance=cfg.distributed.balance)


def make_thread_tuner(cfg: DictConfig) -> ThreadTuner:
    """``threads: null``: follow the cores other processes leave free; ``threads: N``: N, fixed."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        return ThreadTuner(max_threads=cfg.threads, adapt=False)
    return ThreadTuner()


def make_reward_functions(cfg: DictConfig) -> dict:
    """The reward functions of ``reward.functions``, each read by its kind
    (:func:`~rlhf_torchrl.rewards.kinds.reward_kind`: a Python function, a URL, a plugin's kind),
    made before any model is loaded; name -> (function, weight)."""
    from rlhf_torchrl.rewards.kinds import reward_kind

    specs = list(cfg.reward.functions or [])
    weights = cfg.reward.function_weights or [1.0] * len(specs)
    if len(set(specs)) != len(specs):
        raise ConfigError(f"reward.functions lists a function twice: {specs}. Use its weight instead.")
    kinds = [reward_kind(s) for s in specs]
    # metrics are named after the function; the full name only where two share one
    short = [k.short_name(s) for k, s in zip(kinds, specs)]
    names = [n if short.count(n) == 1 else k.full_name(s) for n, k, s in zip(short, kinds, specs)]
    return {name: (kind.build(spec, name, cfg), float(w))
            for name, kind, spec, w in zip(names, kinds, specs, weights)}


def remote_reward(cfg: DictConfig, url: str, name: str):
    """The :class:`~rlhf_torchrl.rewards.remote.RemoteReward` at ``url``, with the
    ``reward.remote_*`` settings.

    Args:
        cfg: the composed PPO config.
        url: the scoring endpoint.
        name: the reward's name.
    """
    from rlhf_torchrl.rewards.kinds import RemoteRewardKind

    return RemoteRewardKind.build(url, name, cfg)


def make_tools(cfg: DictConfig) -> dict:
    """The tools of ``env.tools`` (:func:`rlhf_torchrl.envs.tools.load_tools`), loaded before any model
    (the ``python`` tool checks its sandbox runs here)."""
    from rlhf_torchrl.envs.tools import load_tools

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
    from rlhf_torchrl.modules.assembly import make_models as assemble

    m, v = cfg.model, cfg.value_model
    return assemble(
        m.policy, tokenizer, reference=m.reference, dtype=m.dtype,
        attn_implementation=m.attn_implementation, lora=lora_kwargs(cfg) if cfg.lora.r else None,
        lora_critic=cfg.lora.critic, value_model=v.init if critic else None,
        value_model_path=v.name_or_path or (cfg.reward.model if v.init == "reward_model" else None),
        autocast_dtype=autocast_dtype(cfg), gradient_checkpointing=m.gradient_checkpointing,
        device=device, offload_reference=m.offload_reference, packing=m.packing,
        compile=m.compile)


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
    g, c = cfg.generation, cfg.collection
    return CollectorSpec(
        batch_size=cfg.ppo.batch_size, max_new_tokens=g.max_new_tokens,
        stop_token_ids=tuple(stop_ids), temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
        seed=cfg.seed, backend=g.backend, overlap=c.overlap,
        record_entropy=log_probs_from_sampling(cfg) and cfg.logging.exact_entropy,
        autocast_dtype=cfg.model.autocast, policy=cfg.model.policy, dtype=cfg.model.dtype,
        lm_head_matmul=OmegaConf.select(cfg, "model.lm_head_matmul", default="fp32"),
        chat_template=cfg.data.chat_template, attn_implementation=cfg.model.attn_implementation, ray_workers=c.ray_workers,
        ray_address=c.ray_address, ray_cpus_per_worker=c.ray_cpus_per_worker,
        ray_gpus_per_worker=c.ray_gpus_per_worker, worker_restarts=c.worker_restarts,
        worker_timeout=c.worker_timeout, samples_per_prompt=g.samples_per_prompt,
        max_turns=cfg.env.max_turns, tools=tuple(cfg.env.tools), max_tokens=cfg.env.max_tokens,
        tool_timeout=cfg.env.tool_timeout, python_sandbox=python_sandbox(cfg),
        partial_rollout_tokens=partial_rollout_tokens(cfg),
        static_cache_len=(cfg.data.max_prompt_length + g.max_new_tokens) if g.compile else None,
        vllm=GENERATION_BACKENDS.get(g.backend).engine_spec(cfg),
    )


def make_reward_probe(cfg: DictConfig, prompts, tokenizer, stop_ids, with_values: bool = False):
    """Two rollout rows on real prompts (one response that stopped, one cut short), no model needed:
    every reward is called on it before any model is loaded. ``with_values``: the rollouts will
    carry values read off the sampling pass (:func:`~rlhf_torchrl.config.derived.values_from_sampling`)."""
    return probe_rollout(prompts[:2], tokenizer, ["", "I really liked it."], stop_token_ids=stop_ids,
                         with_log_probs=True, with_values=with_values,
                         multi_turn=bool(cfg.env.tools))


def step_split(cfg: DictConfig):
    """How process rewards cut a response into steps (``reward.step_delimiter``,
    ``reward.step_marker``): a :class:`~rlhf_torchrl.rewards.steps.StepSplit`, checked."""
    from rlhf_torchrl.rewards.steps import StepSplit, unescape

    return StepSplit(unescape(cfg.reward.step_delimiter), cfg.reward.step_marker)


def make_scorer(cfg: DictConfig, reward_functions: dict, device: torch.device,
                stop_text: str = "", tokenizer=None) -> Scorer:
    """The :class:`~rlhf_torchrl.rewards.scoring.Scorer` of ``reward_functions`` and the reward model
    (``reward.model``, or the one served at ``reward.remote_url``); ``stop_text``: the policy's
    stop token, which remote rewards append to OpenRLHF's ``query`` where a response stopped;
    ``tokenizer``: the policy's, which places a process reward's step values on tokens
    (:class:`~rlhf_torchrl.rewards.steps.StepRewards`; None: no step rewards)."""
    from rlhf_torchrl.rewards.remote import RemoteReward
    from rlhf_torchrl.rewards.steps import StepRewards

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
    steps = StepRewards(tokenizer, step_split(cfg)) if tokenizer is not None else None
    # on-policy distillation may teach by the teacher alone: no score (0)
    return Scorer(rewards, missing_eos_penalty=cfg.reward.missing_eos_penalty, allow_non_finite=True,
                  steps=steps, allow_no_rewards=bool(r.teacher))


def make_shaper(cfg: DictConfig) -> KLRewardShaper:
    p, r = cfg.ppo, cfg.reward
    controller = make_kl_controller(p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)
    return KLRewardShaper(controller, kl_estimator=p.kl_estimator, whiten_scores=r.whiten_scores,
                          score_clip=r.score_clip, teacher_coef=r.teacher_coef,
                          teacher_kl_estimator=r.teacher_kl_estimator)


def make_actors(cfg: DictConfig, policy, reference, critic):
    from rlhf_torchrl.functional.matmul import has_fp32_out_mm
    from rlhf_torchrl.modules.assembly import make_actors as actors
    from rlhf_torchrl.modules.models import lm_head_in_fp32

    # (a config saved before the setting existed: fp32)
    matmul = OmegaConf.select(cfg, "model.lm_head_matmul", default="fp32")
    if matmul != "fp32" and autocast_dtype(cfg) is None:
        logging.getLogger(__name__).warning(
            "model.lm_head_matmul=%s applies under model.autocast (the LM head's fp32 product "
            "beside a bf16 trunk); this run has none: its head computes as the model's dtype "
            "says.", matmul)
    if autocast_dtype(cfg) is not None:  # the fp32 logits' product (model.lm_head_matmul)
        device = next(policy.parameters()).device
        if matmul == "bf16x3" and not has_fp32_out_mm(device):
            logging.getLogger(__name__).warning(
                "model.lm_head_matmul=bf16x3: this torch has no bf16 x bf16 -> fp32 matmul on %s "
                "(CUDA's torch.mm(..., out_dtype=torch.float32)): the LM head computes in fp32.",
                device)
        for model in (policy, reference):
            if model is not None:
                lm_head_in_fp32(model, matmul)
    return actors(policy, reference, critic, temperature=cfg.generation.temperature,
                  autocast_dtype=autocast_dtype(cfg), packing=cfg.model.packing)


def make_advantage(cfg: DictConfig):
    """The advantage estimator of ``advantage.estimator`` (:mod:`rlhf_torchrl.objectives.advantages`)."""
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
                         off_policy_low=p.off_policy_low, policy_loss=p.policy_loss,
                         policy_loss_args=dict(p.policy_loss_args or {}))


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
    (:func:`rlhf_torchrl.trainers.optim.make_optimizer`); with ``warmup`` (:func:`make_critic_warmup`) that
    ends on its own, the schedule holds the policy until it has ended."""
    from rlhf_torchrl.trainers.optim import make_optimizer as optimizer_and_schedule

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
    """The critic warm-up of ``optim.critic_warmup*`` (:class:`~rlhf_torchrl.trainers.optim.CriticWarmup`;
    none without a critic)."""
    from rlhf_torchrl.trainers.optim import CriticWarmup

    o = cfg.optim
    if critic is None:
        return CriticWarmup(0)
    return CriticWarmup(o.critic_warmup, until=o.critic_warmup_until,
                        patience=o.critic_warmup_patience, min_delta=o.critic_warmup_min_delta)
