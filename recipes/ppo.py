"""PPO-RLHF with TorchRL: collect, score, evaluate, shape rewards, advantages, optimise, log.

    python recipes/ppo.py                                  # offline default (SmolLM2 + VADER)
    python recipes/ppo.py model.policy=gpt2 ppo.batch_size=64 reward.model=./my_rm
    torchrun --nproc_per_node=2 recipes/ppo.py distributed.strategy=fsdp2   # data parallel

Every setting lives in ``recipes/config/ppo.yaml``; ``builders.py`` turns config into objects.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import builders  # noqa: E402
import cli  # noqa: E402
import schema  # noqa: E402, F401 - registers the config schema with Hydra
from cli import USER_ERRORS  # noqa: E402, F401 - what the command line prints without a traceback

from rlhf_torchrl import keys as K  # noqa: E402
from rlhf_torchrl.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from rlhf_torchrl.evaluation import format_metrics, rollout_samples  # noqa: E402
from rlhf_torchrl.guards import NonFiniteError, check_finite  # noqa: E402
from rlhf_torchrl.metrics import (  # noqa: E402
    MetricsWriter,
    read_metrics,
    rollout_metrics,
    sampler_metrics,
)
from rlhf_torchrl.modules import evaluate_rollout  # noqa: E402
from rlhf_torchrl.objectives import ppo_update  # noqa: E402
from rlhf_torchrl.report import trend, write_report  # noqa: E402
from rlhf_torchrl.runtime import placed, reuse_freed_memory  # noqa: E402
from rlhf_torchrl.sampling import check_on_policy  # noqa: E402

log = logging.getLogger("ppo")


@contextmanager
def timed(times: dict, name: str):
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = time.perf_counter() - start


def train(cfg: DictConfig) -> dict:
    """Run PPO as configured; returns the report (also written to ``report.json``).

    Under ``torchrun`` every process runs this function on its share of each batch
    (``rlhf_torchrl.distributed``); only rank 0 prints, logs and saves.
    """
    # Everything cheap is checked before any model is loaded.
    sizes = builders.check_config(cfg)
    builders.check_output_dir(cfg)
    builders.check_models(cfg)  # config.json of each model, no weights
    resume_from = builders.resume_path(cfg)  # None: a fresh run
    reward_functions = builders.make_reward_functions(cfg)
    device = builders.make_device(cfg)
    parallel = builders.make_data_parallel(cfg, device)
    if not parallel.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)
    threads = builders.make_thread_tuner(cfg)
    if cfg.reuse_freed_memory:
        reuse_freed_memory()

    tokenizer = builders.make_tokenizer(cfg)
    prompts, held_out = builders.split_eval_prompts(cfg, builders.make_prompts(cfg, tokenizer))
    stop_ids = builders.stop_token_ids(cfg, tokenizer)
    scorer = builders.make_scorer(cfg, reward_functions, device)
    scorer.check(builders.make_reward_probe(cfg, prompts, tokenizer, stop_ids))
    policy, reference, critic = builders.make_models(cfg, tokenizer, device)
    # FSDP2 shards the models before the optimiser sees their parameters (no-op otherwise)
    parallel.shard(policy, reference, *critic.modules_to_shard(),
                   mixed_precision=builders.autocast_dtype(cfg))
    actor, ref_actor = builders.make_actors(cfg, policy, reference, critic)
    shaper = builders.make_shaper(cfg)
    advantage = builders.make_advantage(cfg)
    loss_module = builders.make_loss(cfg, actor, critic)
    parallel.wrap_loss(loss_module)  # DDP (no-op otherwise)
    optimizer, scheduler = builders.make_optimizer(cfg, policy, critic, sizes)
    grad_scaler = builders.make_grad_scaler(cfg, device)
    replay_buffer = builders.make_replay_buffer(cfg, sizes)
    trained = builders.trained_modules(policy, critic)
    # a resumed run continues from the checkpoint's weights, optimiser, RNG states and data position
    state = load_checkpoint(resume_from, modules=trained, optimizer=optimizer) if resume_from else {}
    first_iteration = state.get("iteration", 0)
    if state:
        builders.restore_trainer_state(state, scheduler=scheduler, grad_scaler=grad_scaler,
                                       shaper=shaper, replay_buffer=replay_buffer)
        log.info("Resumed from %s: %d of %d iterations done", resume_from, first_iteration,
                 cfg.ppo.num_iterations)
    pending = state.get("pending", [])  # batches sampled ahead (asynchronous collection)
    # push(version): the trainer's weights to the sampler (a vLLM engine, a generation copy)
    collector, push = builders.make_collector(cfg, prompts, tokenizer, policy, stop_ids, device,
                                              parallel, start_batch=first_iteration, pending=pending)
    overlap = cfg.collection.overlap
    writer = (MetricsWriter(cfg.output_dir, logger=cfg.logging.logger, start=first_iteration)
              if parallel.is_main else None)
    log.info("Output directory: %s (device %s, %d process%s)", cfg.output_dir, device,
             parallel.world_size, "es" if parallel.enabled else "")
    # a shared trunk under FSDP2 is run through the whole (sharded) model, never the bare trunk
    recompute = not builders.log_probs_from_sampling(cfg) or (parallel.fsdp and critic.shares_trunk)

    evaluator = builders.make_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device, parallel)
    eval_before, held_out_before = state.get("eval_before"), state.get("held_out_before")
    held_out_after = None
    if evaluator is not None:
        with reference_policy(policy, reference, device, cfg.model.offload_reference) as ref_model:
            evaluator.set_reference(ref_model)  # the reference's responses, once
        if eval_before is None:
            eval_before, eval_rollout = evaluator(policy)
            held_out_before = rollout_samples(eval_rollout, HELD_OUT_SAMPLES)
            log.info("Evaluation before training: %s", format_metrics(eval_before))
    p = cfg.ppo
    # the earlier iterations of a resumed run (skipped ones have no statistics)
    history = [r for r in read_metrics(cfg.output_dir, before=first_iteration)
               if "objective/scores" in r] if parallel.is_main else []
    first_samples, last_samples = state.get("first_samples"), state.get("last_samples")
    rollouts = iter(collector)
    bar = tqdm(range(first_iteration, p.num_iterations), desc="PPO", initial=first_iteration,
               total=p.num_iterations,
               disable=not (cfg.logging.progress_bar and parallel.is_main))
    for iteration in bar:
        times: dict[str, float] = {}
        start = time.perf_counter()
        n_threads = threads.update()  # the cores other processes left free (or threads=N)
        policy.eval()
        # 1. Collect: sample responses for this process's prompts, truncate after the stop token.
        with timed(times, "generation"):
            rollout = next(rollouts)
        # the ratio of the first minibatch is 1 only if the tokens came from the loss's
        # distribution; a separate sampler is checked again after its first pushed update
        # (a resumed run checks its first batch unless it was sampled before the interruption)
        recheck = iteration == first_iteration + 1 and push is not None and not overlap
        first = iteration == first_iteration and not pending
        if cfg.generation.check_on_policy and (first or recheck):
            agreement = check_on_policy(rollout, actor, num_rows=cfg.generation.on_policy_rows,
                                        atol=builders.on_policy_tolerance(cfg))
            log.info("On-policy check: recorded and recomputed log-probs of %d tokens agree to %.2g nats",
                     agreement["tokens"], agreement["max_abs_diff"])
        # 2. Score: one scalar per response (reward model / functions, missing-EOS penalty).
        with timed(times, "scoring"):
            scorer(rollout)
        # 3. Old quantities, no grad: policy and reference log-probs (fp32, temperature), values.
        if not builders.log_probs_from_sampling(cfg):
            # the sampler's log-probs stay beside the recomputed ones: TIS and the gap metric
            rollout.set(K.BEHAVIOUR_LOG_PROB, rollout.get(K.LOG_PROB).clone())
        with timed(times, "evaluation"), placed(reference, device, cfg.model.offload_reference):
            evaluate_rollout(rollout, actor=actor, reference=ref_actor, critic=critic,
                             chunk_size=p.forward_batch_size,
                             exact_entropy=cfg.logging.exact_entropy,
                             recompute_log_probs=recompute)
        # 4-5. On the global batch (all processes' rows): per-token rewards (-kl_coef * KL, + score
        # at the end), then GAE advantages, whitened over the whole batch. A NaN/inf is caught
        # where it appears (the same decision on every process: all see the global batch).
        stats = None
        try:
            with timed(times, "advantages"):
                batch = parallel.gather_rollout(rollout, tokenizer.pad_token_id)
                check_finite(batch, ("scores", "log-probs", "sampler log-probs",
                                     "reference log-probs", "values"))
                shaper(batch)
                advantage(batch)
                check_finite(batch, ("rewards", "advantages", "returns"))
            # 6. PPO epochs over shuffled minibatches (each process runs its slice of each).
            with timed(times, "update"):
                stats = ppo_update(
                    batch, loss_module, optimizer,
                    num_ppo_epochs=p.num_ppo_epochs, num_mini_batches=p.num_mini_batches,
                    gradient_accumulation_steps=p.gradient_accumulation_steps,
                    micro_batch_tokens=p.micro_batch_tokens,
                    max_grad_norm=cfg.optim.max_grad_norm, scheduler=scheduler,
                    replay_buffer=replay_buffer, grad_scaler=grad_scaler, parallel=parallel,
                )
        except NonFiniteError as error:  # stops the run, or skips the iteration (guards.non_finite)
            builders.on_non_finite(cfg, error, iteration, batch, parallel)
        if push is not None and iteration + 1 < p.num_iterations:
            # the sampler gets the updated weights (version = updates done)
            times["time/weight_sync"] = push(iteration + 1)
        # 7. Log (the global batch's statistics, the same on every process).
        if stats is None:  # a skipped iteration
            metrics = {"guard/skipped": 1.0}
        else:
            metrics = rollout_metrics(batch, kl_coef=shaper.kl_coef)
            metrics.update(sampler_metrics(batch, version=iteration))
            # a batch sampled by the policy of the critic warm-up (updates 0..warm-1 left it as it
            # was) has a KL of 0, which says nothing about the coefficient
            sampled_by = (int(batch.get(K.POLICY_VERSION).min()) if K.POLICY_VERSION in batch.keys()
                          else iteration)  # asynchronous rows record their version
            if sampled_by > cfg.optim.critic_warmup or not cfg.optim.critic_warmup:
                shaper.update_kl_coef(batch)
            metrics.update(stats)
        done = iteration + 1
        if evaluator is not None and (done % cfg.eval.every == 0 or done == p.num_iterations):
            with timed(times, "eval"):
                eval_metrics, eval_rollout = evaluator(policy)  # held-out prompts, after this update
            held_out_after = rollout_samples(eval_rollout, HELD_OUT_SAMPLES)
            metrics.update(eval_metrics)
        times["time/total"] = time.perf_counter() - start
        n_tokens = float(batch.get(K.RESPONSE_MASK).sum())
        times["time/tokens_per_second"] = n_tokens / max(times["time/generation"], 1e-9)
        metrics.update(times)
        metrics["lr"] = optimizer.param_groups[0]["lr"]
        metrics["threads"] = n_threads
        metrics["episode"] = done * p.batch_size
        if writer is not None:
            writer.log(iteration, metrics)
        if stats is not None:
            history.append(metrics)
            last_samples = rollout_samples(rollout, cfg.logging.num_samples)
            if first_samples is None:
                first_samples = last_samples
            bar.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                            kl=f"{metrics['objective/kl']:.3f}")
            builders.check_kl_ceiling(cfg, metrics["objective/kl"], iteration)
        if builders.checkpoint_due(cfg, done):
            with timed(times, "checkpoint"):
                save_checkpoint(
                    cfg.output_dir, done, modules=trained, optimizer=optimizer, keep=cfg.checkpoint.keep,
                    parallel=parallel, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                    trainer_state=builders.trainer_state(
                        done, scheduler=scheduler, grad_scaler=grad_scaler, shaper=shaper,
                        replay_buffer=replay_buffer, samples=(first_samples, last_samples),
                        eval_before=eval_before, held_out_before=held_out_before,
                        # batches sampled ahead by older weights (none after the last iteration)
                        pending=collector.pending() if overlap and done < p.num_iterations else []),
                )
            log.info("Checkpoint %d written in %.2f s", done, times["time/checkpoint"])
    collector.shutdown()
    if cfg.logging.save_model:
        full_state = parallel.full_state_dict(policy)  # gathered from the shards under FSDP2
        if parallel.is_main:
            builders.save_policy(cfg, policy, tokenizer, full_state)
    # (history is rank 0's; it is empty elsewhere in a resumed run)
    report = _report(history, first_samples, last_samples, quiet=not parallel.is_main) if history else {}
    if eval_before is not None and history:
        report["eval_before"] = eval_before
        report["eval_after"] = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
        if held_out_before and held_out_after:
            report["held_out_samples"] = [
                {"prompt": b["prompt"], "question": b.get("question", b["prompt"]),
                 "before": b["response"], "score_before": b["score"],
                 "after": a["response"], "score_after": a["score"]}
                for b, a in zip(held_out_before, held_out_after) if b["prompt"] == a["prompt"]]
        if parallel.is_main:
            print(f"  held-out evaluation before: {format_metrics(eval_before)}\n"
                  f"                       after: {format_metrics(report['eval_after'])}", flush=True)
    if writer is not None:
        writer.close()
        with open(os.path.join(cfg.output_dir, "report.json"), "w") as f:
            json.dump({"config": OmegaConf.to_container(cfg, resolve=True), **report}, f, indent=1)
        log.info("Run report: %s", write_report(cfg.output_dir))
    parallel.barrier()
    parallel.shutdown()
    return report


@contextmanager
def reference_policy(policy, reference, device, offloaded: bool):
    """The reference model (on ``device`` meanwhile if it is offloaded), or (LoRA) the policy
    with its adapters off."""
    if reference is not None:
        with placed(reference, device, offloaded):
            yield reference
    else:
        with policy.disable_adapter():
            yield policy


#: held-out prompts whose responses before and after training the report shows side by side
HELD_OUT_SAMPLES = 8


def _report(history: list[dict], before: list[dict], after: list[dict], quiet: bool = False) -> dict:
    """Print and return initial vs final score and KL (means over the first and the last quarter
    of the iterations: one batch is noisy), with a few responses from each end."""
    first, last, call, k = trend([r["objective/scores"] for r in history])
    kl_first, kl_last, _, _ = trend([r["objective/kl"] for r in history])
    report = {
        "initial_score": first,
        "final_score": last,
        "score_trend": call,
        "initial_kl": kl_first,
        "final_kl": kl_last,
        "seconds_per_iteration": sum(r["time/total"] for r in history) / len(history),
        "iterations": len(history),
        "samples_before": before,
        "samples_after": after,
    }
    lines = [
        "",
        "=" * 72,
        f"PPO report: {len(history)} iterations, {report['seconds_per_iteration']:.1f} s/iteration",
        f"  mean score: {first:+.3f} -> {last:+.3f}, {call}"
        f"   (first/last {k} iteration{'s' if k > 1 else ''})",
        f"  KL to reference: {kl_first:.3f} -> {kl_last:.3f}",
    ]
    for title, samples in (("before", before), ("after", after)):
        lines.append(f"  responses {title} training:")
        for s in samples:
            lines.append(f"    [{s['score']:+.2f}] {s['response'].strip()[:150]!r}")
    lines.append("=" * 72)
    if not quiet:
        print("\n".join(lines), flush=True)
    return report


@hydra.main(config_path="config", config_name="ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.run(train, cfg)


if __name__ == "__main__":
    main()
