"""The PPO command: the config to a :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer` with its hooks
(:func:`build_trainer`), and the run (:func:`train`).

Everything cheap is checked first (:mod:`.checks`), then the components are made
(:mod:`.components`, :mod:`.inputs`) and the run resumed where :mod:`.resume` says.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.collectors.factory import make_collector
from rlhf_torchrl.config import validation
from rlhf_torchrl.config.checks import (
    check_config,
    check_output_dir,
    check_rewards,
)
from rlhf_torchrl.config.components import (
    collector_spec,
    make_actors,
    make_advantage,
    make_critic_warmup,
    make_data_parallel,
    make_device,
    make_grad_scaler,
    make_loss,
    make_models,
    make_optimizer,
    make_replay_buffer,
    make_reward_functions,
    make_scorer,
    make_shaper,
    make_thread_tuner,
    make_tokenizer,
    make_tools,
    stop_token_ids,
)
from rlhf_torchrl.config.derived import (
    autocast_dtype,
    log_probs_from_sampling,
    on_policy_tolerance,
    precision,
    values_from_sampling,
)
from rlhf_torchrl.config.distillation import make_teacher, teacher_tokenizer
from rlhf_torchrl.config.inputs import make_evaluator, make_prompts, split_eval_prompts
from rlhf_torchrl.config.model_checks import check_models, check_sequence_length
from rlhf_torchrl.config.resume import finished_run, resume_path
from rlhf_torchrl.plan import check_fits
from rlhf_torchrl.trainers.guards import NonFiniteAction
from rlhf_torchrl.trainers.interrupt import RunInterrupted
from rlhf_torchrl.trainers.update import UpdateSettings

log = logging.getLogger(__name__)


def resolve_precision(cfg: DictConfig) -> None:
    """Write :func:`~rlhf_torchrl.config.derived.precision` into ``cfg`` (``model.autocast=auto``
    resolved, and a null ``ppo.tis_cap`` by :func:`~rlhf_torchrl.config.derived.tis_cap`'s rule),
    so the run's config and report say what ran; the one step that writes into the config, before
    its checks. An explicit ``model.autocast`` and ``ppo.tis_cap`` are left as they are.

    Args:
        cfg: the composed PPO config.
    """
    cfg.model.autocast, cfg.ppo.tis_cap = precision(cfg)


def build_trainer(cfg: DictConfig, *, advantage=None, reward_transform=None):
    """The :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer` of ``cfg`` with its hooks, resumed from the
    checkpoint ``resume`` names; everything cheap is checked before any model is loaded.
    ``examples/`` shows both keyword arguments in use.

    Args:
        cfg: the composed PPO config.
        advantage (torch.nn.Module | None): an advantage module of your own in place of
            ``advantage.estimator``'s (a critic is built if it reads ``"state_value"``,
            :func:`~rlhf_torchrl.objectives.advantages.needs_critic`); None: the estimator's.
        reward_transform (Callable | None): a TorchRL ``Transform`` (or TensorDict callable)
            applied to each scored rollout (:class:`~rlhf_torchrl.trainers.ppo.PPOTrainer`), after
            ``reward.normalize_per_source`` and ``reward.overlong_buffer``'s; None: none.
    """
    from rlhf_torchrl.config.length_shaping import make_score_transform
    from rlhf_torchrl.objectives.advantages import needs_critic
    from rlhf_torchrl.record.run_log import RunLog
    from rlhf_torchrl.rewards.length import ScoreTransforms
    from rlhf_torchrl.runtime import reuse_freed_memory
    from rlhf_torchrl.trainers.disk import check_disk, plan_disk
    from rlhf_torchrl.trainers.hooks import (
        Checkpointer,
        Evaluation,
        KLCeiling,
        OnPolicyCheck,
        SavePolicy,
        ThreadTuning,
    )
    from rlhf_torchrl.trainers.ppo import PPOTrainer
    from rlhf_torchrl.trainers.warm_start import load_critic

    validation.validate(cfg)  # (the resolution below reads model.* and device)
    resolve_precision(cfg)
    sizes = check_config(cfg)
    check_output_dir(cfg)
    check_models(cfg)  # config.json of each model, no weights
    resume_from = resume_path(cfg)  # None: a fresh run
    reward_functions = make_reward_functions(cfg)
    tools = make_tools(cfg)  # loaded once: an unknown tool fails here, before any model loads
    device = make_device(cfg)
    parallel = make_data_parallel(cfg, device)
    if not parallel.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)
    threads = make_thread_tuner(cfg)
    if cfg.reuse_freed_memory:
        reuse_freed_memory()

    tokenizer = make_tokenizer(cfg)
    # on-policy distillation: a teacher of another vocabulary stops here, before any weights load
    teachers_tokenizer = teacher_tokenizer(cfg, tokenizer)
    prompts = make_prompts(cfg, tokenizer, tools)
    check_sequence_length(cfg, prompts, tokenizer)
    # the memory plan of every phase, from the configs and the longest prompt: a run that cannot
    # fit stops here, before any weight loads
    check_fits(cfg, prompt_tokens=getattr(prompts, "longest", None))
    prompts, held_out = split_eval_prompts(cfg, prompts, tokenizer, tools)
    stop_ids = stop_token_ids(cfg, tokenizer)
    advantage = advantage if advantage is not None else make_advantage(cfg)
    values_sampled = values_from_sampling(cfg, parallel, critic=needs_critic(advantage))
    scorer = make_scorer(cfg, reward_functions, device, stop_text=tokenizer.decode(stop_ids[:1]),
                         tokenizer=tokenizer)
    check_rewards(cfg, scorer, prompts, tokenizer, stop_ids, with_values=values_sampled)
    policy, reference, critic = make_models(cfg, tokenizer, device, critic=needs_critic(advantage))
    # FSDP2 shards the models before the optimiser sees their parameters (no-op otherwise)
    parallel.shard(policy, reference, *(critic.modules_to_shard() if critic is not None else ()),
                   mixed_precision=autocast_dtype(cfg))
    if critic is not None and cfg.value_model.warm_start and not resume_from:
        load_critic(cfg.value_model.warm_start, critic)  # weights only (a resumed run: its own)
    actor, ref_actor = make_actors(cfg, policy, reference, critic)
    teacher = make_teacher(cfg, tokenizer, teachers_tokenizer, device)  # None: no teacher
    loss_module = make_loss(cfg, actor, critic)
    parallel.wrap_loss(loss_module)  # DDP (no-op otherwise)
    warmup = make_critic_warmup(cfg, critic)
    optimizer, scheduler = make_optimizer(cfg, policy, critic, sizes, warmup)
    p, g, c = cfg.ppo, cfg.generation, cfg.collection
    sampled = log_probs_from_sampling(cfg)  # the old log-probs recorded while sampling
    trainer = PPOTrainer(
        # built when the run starts, at the batch the checkpoint stopped at
        collector=functools.partial(_collector_factory, collector_spec(cfg, stop_ids), prompts,
                                    tokenizer, policy, device, parallel,
                                    critic.head if values_sampled else None),
        scorer=scorer, actor=actor, reference=ref_actor, critic=critic, shaper=make_shaper(cfg),
        advantage=advantage, teacher=teacher,
        # reward.normalize_per_source and reward.overlong_buffer, then the caller's transform
        reward_transform=make_score_transform(cfg, parallel, reward_transform),
        loss_module=loss_module, optimizer=optimizer,
        scheduler=scheduler, grad_scaler=make_grad_scaler(cfg, device),
        replay_buffer=make_replay_buffer(cfg, sizes), parallel=parallel,
        pad_token_id=tokenizer.pad_token_id, num_iterations=p.num_iterations,
        update=UpdateSettings(
            num_ppo_epochs=p.num_ppo_epochs, num_mini_batches=p.num_mini_batches,
            gradient_accumulation_steps=p.gradient_accumulation_steps,
            micro_batch_tokens=p.micro_batch_tokens, max_grad_norm=cfg.optim.max_grad_norm,
            critic_epochs=p.critic_epochs if critic is not None else None),
        forward_batch_size=p.forward_batch_size, exact_entropy=cfg.logging.exact_entropy,
        # a shared trunk under FSDP2 is run through the whole (sharded) model, never the bare trunk
        recompute_log_probs=not sampled or (parallel.fsdp and critic is not None and critic.shares_trunk),
        keep_sampler_log_probs=not sampled,
        offload_reference=cfg.model.offload_reference,
        critic_warmup=warmup,
        filter_groups=cfg.advantage.filter_groups,
        on_non_finite=NonFiniteAction(cfg.output_dir, cfg.guards.non_finite, is_main=parallel.is_main),
    )
    trainer.register_hook("threads", ThreadTuning(threads))
    if isinstance(trainer.reward_transform, ScoreTransforms):  # each source's running statistics
        trainer.register_op("post_steps_log", trainer.reward_transform.metrics)
    if g.check_on_policy:
        pushed = GENERATION_BACKENDS.get(g.backend).recheck_after_push
        separate = bool(c.ray_workers) or pushed or c.overlap is not None
        trainer.register_hook("on_policy_check", OnPolicyCheck(
            num_rows=g.on_policy_rows, atol=on_policy_tolerance(cfg),
            recheck_after_push=separate and not c.overlap))
    evaluator = make_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device, parallel, tools)
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
            config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
            weights_only=cfg.checkpoint.weights_only))
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
    # the disk the run fills (checkpoints, the policy): one that cannot fit stops here
    disk = plan_disk(trainer.trained_modules, policy, num_iterations=p.num_iterations,
                     every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                     weights_only=cfg.checkpoint.weights_only, save_model=cfg.logging.save_model,
                     save_merged=bool(cfg.lora.r and cfg.lora.save_merged), start=trainer.iteration)
    if parallel.is_main:
        check_disk(disk, cfg.output_dir, keep=cfg.checkpoint.keep if cfg.checkpoint.every else None)
    log.info("Output directory: %s (device %s, %d process%s); it will hold %s", cfg.output_dir,
             device, parallel.world_size, "es" if parallel.enabled else "", disk.line())
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
    except RunInterrupted as stop:  # the command that goes on, where a checkpoint holds the run
        from rlhf_torchrl.trainers.checkpoint import list_checkpoints

        if stop.checkpoint is not None or list_checkpoints(cfg.output_dir):
            stop.message += f" Resume with: {resume_command(cfg)}"
        raise
    finally:
        trainer.parallel.shutdown()


def resume_command(cfg: DictConfig) -> str:
    """The command that continues the run of ``cfg`` from its newest checkpoint: the same
    overrides (this command line's, under Hydra), in the same ``output_dir``, ``resume`` left at
    ``auto``; under torchrun, the same number of processes.

    Args:
        cfg: the composed PPO config.
    """
    import shlex

    from hydra.core.hydra_config import HydraConfig

    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    kept = [o for o in given if not o.lstrip("+~").startswith(("resume=", "output_dir=", "hydra."))]
    args = [*kept, f"output_dir={os.path.abspath(cfg.output_dir)}"]
    world = int(os.environ.get("WORLD_SIZE", 1))
    head = (f"torchrun --nproc_per_node={world} -m rlhf_torchrl.cli ppo" if world > 1
            else f"{shlex.quote(_this_command())} ppo")
    return " ".join([head, *(shlex.quote(a) for a in args)])


def _this_command(name: str = "rlhf-torchrl") -> str:
    """``rlhf-torchrl``, or the path this process was started as where the command of that name
    on ``PATH`` is another (a virtual environment not activated): the resume line runs the same
    install."""
    import shutil
    import sys

    started = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(started) != name:
        return name
    found = shutil.which(name)
    return name if found and os.path.realpath(found) == started else started
