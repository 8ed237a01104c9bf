"""The PPO config's settings checked against each other, and the inputs they name (output
directory, rewards on a probe), before any weights load. The models' configs and the prompts'
lengths against their positions: :mod:`.model_checks`.

Types were checked by Hydra and choices and ranges by :func:`.validation.validate`; :func:`check_config`
runs it and returns the batch sizes the settings derive (:class:`Sizes`). Nothing here writes into
the config.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl import functional as F
from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.collectors.sampling import check_full_distribution
from rlhf_torchrl.config import validation
from rlhf_torchrl.config.components import critic_free, make_reward_probe, step_split
from rlhf_torchrl.config.derived import log_probs_from_sampling, partial_rollout_tokens, tis_cap
from rlhf_torchrl.config.distillation import check_teacher_settings, has_score
from rlhf_torchrl.config.length_shaping import check_length_shaping
from rlhf_torchrl.data.prompt_sets import PromptMixture
from rlhf_torchrl.envs.prompt_env import check_group_sizes
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS
from rlhf_torchrl.objectives.policy_losses import make_policy_loss
from rlhf_torchrl.record.trackers import check_logger
from rlhf_torchrl.rewards.kinds import reward_kind

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

    Types were checked by Hydra (``schema.py``), choices and ranges by :func:`.validation.validate`;
    here the settings are checked against each other.

    Args:
        cfg: the composed PPO config.
    """
    validation.validate(cfg)
    p = cfg.ppo
    make_policy_loss(p.policy_loss, p.policy_loss_args).check(loss_aggregation=p.loss_aggregation,
                                                            dual_clip=p.dual_clip)
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's process count
    # FSDP2 shards the models under torchrun, one process included (init_data_parallel)
    fsdp = cfg.distributed.strategy == "fsdp2" and (world > 1 or "RANK" in os.environ)
    mini = exact_div(p.batch_size, p.num_mini_batches,
                     "ppo.batch_size must split into ppo.num_mini_batches equal minibatches")
    local = exact_div(mini, world, f"the minibatch size ({mini} = batch_size / num_mini_batches) "
                      f"must split over the {world} processes")
    if p.micro_batch_tokens is not None and p.gradient_accumulation_steps != 1:
        raise ConfigError(f"ppo.micro_batch_tokens={p.micro_batch_tokens} splits each minibatch by "
                          f"tokens, and ppo.gradient_accumulation_steps="
                          f"{p.gradient_accumulation_steps} by rows: only one split is used. Set "
                          "ppo.gradient_accumulation_steps=1 (or ppo.micro_batch_tokens=null).")
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
    if e.max_turns > 1 and fsdp:
        raise ConfigError("env.max_turns > 1 with FSDP2: each process's rows take their own number "
                         "of turns, and FSDP2's generation needs every process to run the same "
                         "forwards. Use distributed.strategy=ddp.")
    estimator = ADVANTAGE_ESTIMATORS.get(a.estimator)
    if estimator.compares_groups and g.samples_per_prompt < 2:
        raise ConfigError(f"advantage.estimator={a.estimator} compares responses to the same prompt: "
                         "set generation.samples_per_prompt >= 2 (4 is common).")
    if a.filter_groups and g.samples_per_prompt < 2:
        raise ConfigError("advantage.filter_groups drops groups of responses with equal scores: set "
                         "generation.samples_per_prompt >= 2.")
    if a.filter_groups and not estimator.compares_groups:
        group = [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.compares_groups]
        raise ConfigError(f"advantage.filter_groups drops the groups whose scores are all equal, "
                          f"which carry no signal only under a group baseline (gae's critic and "
                          f"reinforce_pp's batch baseline still learn from them): set "
                          f"advantage.estimator={' or '.join(group)} (now "
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
    if lora.r and fsdp:
        raise ConfigError("lora.r > 0 with distributed.strategy=fsdp2 is not supported yet: use "
                         "distributed.strategy=ddp (adapters are small; the frozen base is shared).")
    if lora.dropout:
        raise ConfigError(f"lora.dropout={lora.dropout}: dropout is on in the update's forwards and "
                          "off while sampling and computing the old log-probs, so PPO's first "
                          "ratio is not 1 and its clip acts on dropout noise (every model here "
                          "loads with dropout off, Ziegler et al. 2019): set lora.dropout=0.")
    if (lora.critic or lora.save_merged) and not lora.r:
        raise ConfigError("lora.critic / lora.save_merged need LoRA on the policy: set lora.r > 0.")
    if lora.critic and critic_free(cfg):
        raise ConfigError(f"lora.critic: advantage.estimator={a.estimator} builds no critic.")
    if lora.critic and cfg.value_model.init == "shared":
        raise ConfigError("lora.critic is for a separate critic: a shared-trunk critic already "
                         "trains through the policy's adapters (value_model.init=shared).")
    if m.offload_reference and fsdp:
        raise ConfigError("model.offload_reference with distributed.strategy=fsdp2: the reference is "
                         "already sharded over the processes; drop the offload (or use ddp).")
    if m.autocast and m.dtype != "float32":
        raise ConfigError(f"model.autocast={m.autocast} keeps fp32 master weights: set model.dtype="
                         f"float32 (now {m.dtype}), or drop autocast to train in {m.dtype}.")
    F.check_kl_estimator(p.kl_estimator)
    if p.kl_loss_coef and p.kl_coef:
        # both together is a choice some make (the PPO-RLHF reward KL and GRPO's loss KL), so not
        # refused; but a preset's reward KL left on under kl_loss_coef is rarely what was meant
        log.warning("ppo.kl_loss_coef=%g puts the KL in the loss, and ppo.kl_coef=%g (the task "
                    "preset's, unless set) keeps the KL penalty in the reward too: both apply. For "
                    "GRPO's loss-only KL set ppo.kl_coef=0.", p.kl_loss_coef, p.kl_coef)
    if cfg.optim.critic_warmup and critic_free(cfg):
        log.warning("optim.critic_warmup=%d is ignored: advantage.estimator=%s has no critic.",
                    cfg.optim.critic_warmup, a.estimator)
    elif cfg.optim.critic_warmup >= p.num_iterations:
        raise ConfigError(f"optim.critic_warmup={cfg.optim.critic_warmup} iterations leave the policy "
                         f"none of ppo.num_iterations={p.num_iterations} to learn in: use fewer.")
    check_critic_settings(cfg)
    if cfg.value_model.init == "reward_model" and not cfg.reward.model and not critic_free(cfg):
        raise ConfigError("value_model.init=reward_model needs reward.model to be set.")
    backend = GENERATION_BACKENDS.get(g.backend)
    if backend.missing():
        raise ConfigError(backend.missing())
    overlap = cfg.collection.overlap
    if overlap and backend.overlap_needs_policy_copy and fsdp:
        others = [n for n, b in GENERATION_BACKENDS.items() if not b.overlap_needs_policy_copy]
        raise ConfigError(f"collection.overlap > 0 with generation.backend={g.backend} samples with "
                          "a copy of the policy, which FSDP2 shards cannot give: use ddp, or "
                          f"generation.backend={' or '.join(others)}.")
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
    check_compiled_generation(cfg)
    check_logger(cfg.logging.logger)  # its package installed
    if not has_score(cfg) and not cfg.reward.teacher:
        raise ConfigError(
            "No reward: set reward.model (a sequence classifier) or reward.remote_url (one "
            "served), and/or reward.functions (dotted paths or URLs), and/or reward.teacher (a "
            "model to distil)."
        )
    check_teacher_settings(cfg)
    check_remote_rewards(cfg)
    check_length_shaping(cfg)  # reward.overlong_buffer below the length limit
    for spec in cfg.reward.functions or []:  # each kind's own settings (a judge's), nothing loaded
        reward_kind(spec).check(spec, cfg)
    step_split(cfg)  # a process reward's step delimiter or marker (an empty one, a bad regex)
    weights = cfg.reward.function_weights
    if weights is not None and len(weights) != len(cfg.reward.functions or []):
        raise ConfigError(
            f"reward.function_weights has {len(weights)} entries for "
            f"{len(cfg.reward.functions or [])} reward.functions: give one weight per function."
        )
    steps = p.num_iterations * p.num_ppo_epochs * p.num_mini_batches
    return Sizes(p.batch_size, mini, micro, steps)


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
    """``value_model.warm_start`` with a separate critic, naming a checkpoint whose run had one
    too (its config, read before any weights; :func:`rlhf_torchrl.trainers.warm_start.load_critic`
    loads it). A shared trunk is refused: the saved head was fitted to that run's trained policy,
    not to this run's (:func:`~rlhf_torchrl.trainers.warm_start.shared_trunk_refusal`).

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.trainers.warm_start import critic_checkpoint, shared_trunk_refusal

    if cfg.value_model.init == "shared":
        raise ConfigError(shared_trunk_refusal(cfg.value_model.warm_start))
    path = critic_checkpoint(cfg.value_model.warm_start)
    then = OmegaConf.load(os.path.join(path, "config.yaml"))
    estimator = OmegaConf.select(then, "advantage.estimator", default="gae")
    if estimator not in ADVANTAGE_ESTIMATORS or not ADVANTAGE_ESTIMATORS.get(estimator).needs_critic:
        raise ConfigError(f"value_model.warm_start={path}: that run (advantage.estimator="
                          f"{estimator}) has no critic; give a checkpoint of a run with a critic.")
    init_then = OmegaConf.select(then, "value_model.init", default="shared")
    if init_then == "shared":
        raise ConfigError(
            f"value_model.warm_start={path}: that run's critic (value_model.init=shared) has no "
            f"trunk of its own, and this one's (value_model.init={cfg.value_model.init}) does: a "
            "shared trunk's head reads the policy's features. Warm-start from a run with a "
            "separate critic (value_model.init=policy).")


def check_compiled_generation(cfg: DictConfig) -> None:
    """``generation.compile`` (a static KV cache sized for ``data.max_prompt_length`` plus the
    response budget) where that cache holds every episode: the transformers backend, one turn.

    Args:
        cfg: the composed PPO config.
    """
    g = cfg.generation
    if not g.compile:
        return
    if not GENERATION_BACKENDS.get(g.backend).compiles_decode:
        raise ConfigError(f"generation.compile=true compiles transformers' decode step; "
                          f"generation.backend={g.backend} samples with its own engine (vLLM: "
                          "vllm.enforce_eager=false captures CUDA graphs): drop generation.compile.")
    if cfg.env.max_turns > 1:
        raise ConfigError(f"generation.compile=true with env.max_turns={cfg.env.max_turns}: the "
                          "static cache is sized for one prompt and one response; tool turns "
                          "grow an episode past it. Use generation.compile=false for tools.")


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


def check_remote_rewards(cfg: DictConfig) -> None:
    """``reward.remote_url`` in place of ``reward.model``, not beside it, as a URL; the token's
    environment variable set.

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.rewards.remote import bearer_token, is_url

    r = cfg.reward
    if r.remote_url and r.model:
        raise ConfigError(f"reward.model={r.model} and reward.remote_url={r.remote_url}: the reward "
                          "model is scored here or by the server, not both; drop one.")
    if r.remote_url and not is_url(r.remote_url):
        raise ConfigError(f"reward.remote_url={r.remote_url} is not an http:// or https:// URL: "
                          "give the served model's endpoint, e.g. http://HOST:8000/score.")
    if r.remote_url or any(is_url(f) for f in r.functions or []):
        bearer_token(r.remote_token_env)


def check_rewards(cfg: DictConfig, scorer, prompts, tokenizer, stop_ids,
                  with_values: bool = False) -> None:
    """Every reward once on a probe of real prompts (:func:`make_reward_probe`); each source of a
    mixture gets its own, since its rows may carry other columns.

    Args:
        cfg: the composed PPO config.
        scorer (rlhf_torchrl.rewards.scoring.Scorer): the rewards to call.
        prompts (Sequence | PromptSet | PromptMixture): the training prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        stop_ids (list[int]): the ids that end a response.
        with_values: the probe holds recorded values too.
    """
    if not isinstance(prompts, PromptMixture):
        return scorer.check(make_reward_probe(cfg, prompts, tokenizer, stop_ids, with_values))
    for name, part, source in zip(prompts.names, prompts.sets, prompts.ids):
        alone = PromptMixture([part], [1.0], [name], [source])  # its rows name their source
        try:
            scorer.check(make_reward_probe(cfg, alone, tokenizer, stop_ids, with_values))
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None


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
