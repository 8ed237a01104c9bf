"""What the PPO trainer does besides the algorithm, as TorchRL trainer hooks.

Each hook is a :class:`torchrl.trainers.TrainerHookBase`: ``register(trainer, name)`` puts its ops
at the trainer's stages (:data:`rlhf_torchrl.trainer.STAGES`), and ``state_dict()`` is saved in
every checkpoint, so that a resumed run continues each hook where it was. Register your own the same
way, or pass a plain function to ``trainer.register_op(stage, fn)``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

from torchrl.trainers import TrainerHookBase

from . import keys as K
from .evaluation import format_metrics, rollout_samples
from .metrics import MetricsWriter, read_metrics
from .report import trend, write_report
from .runtime import placed

log = logging.getLogger(__name__)

#: held-out prompts whose responses before and after training the report shows side by side
HELD_OUT_SAMPLES = 8


class _Stateless(TrainerHookBase):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class ThreadTuning(_Stateless):
    """Before each iteration, torch's intra-op threads follow the cores other processes leave
    free (:class:`~rlhf_torchrl.runtime.ThreadTuner`); logged as ``threads``.

    Args:
        tuner (rlhf_torchrl.runtime.ThreadTuner): picks the thread count.
    """

    def __init__(self, tuner):
        self.tuner = tuner

    def register(self, trainer, name: str = "threads") -> None:
        trainer.register_op("pre_collect", lambda: {"threads": self.tuner.update()})


class OnPolicyCheck(_Stateless):
    """The first batch's recorded log-probs (and values, where the sampling pass recorded them)
    against a training forward's (:func:`~rlhf_torchrl.sampling.check_on_policy`): PPO's first
    ratio is 1 only if the tokens came from the loss's distribution. A sampler that gets pushed weights (vLLM, a Ray worker, a
    copy) is checked again on the batch after its first push; a resumed run checks its first
    batch unless it was sampled before the interruption. With partial rollouts only the tokens the
    current weights sampled are compared (a paused response's earlier tokens came from older ones).

    Args:
        num_rows: rows of the batch compared.
        atol: the largest absolute difference allowed, in nats (values: the same number).
        recheck_after_push: check again on the batch after the sampler's first weight push.
    """

    def __init__(self, *, num_rows: int = 4, atol: float = 1e-3, recheck_after_push: bool = False):
        self.num_rows, self.atol, self.recheck_after_push = num_rows, atol, recheck_after_push

    def register(self, trainer, name: str = "on_policy_check") -> None:
        self.trainer = trainer
        trainer.register_op("batch_process", self)

    def __call__(self, rollout):
        from .sampling import check_on_policy

        t = self.trainer
        first = t.iteration == t.first_iteration and not t.pending
        recheck = self.recheck_after_push and t.iteration == t.first_iteration + 1
        if first or recheck:
            rows, tokens = rollout, None
            if K.TOKEN_VERSION in rollout.keys(True):  # partial rollouts: several versions a row
                from .collectors.partial import current_tokens

                rows, tokens = current_tokens(rollout, t.iteration)
                if not rows.shape[0]:
                    return rollout  # no token of this batch was sampled by the current weights
            agreement = check_on_policy(rows, t.actor, num_rows=self.num_rows, atol=self.atol,
                                        critic=t.critic, tokens=tokens)
            log.info("On-policy check: recorded and recomputed log-probs of %d tokens agree to %.2g "
                     "nats%s", agreement["tokens"], agreement["max_abs_diff"],
                     f", values to {agreement['value_max_abs_diff']:.2g}"
                     if "value_max_abs_diff" in agreement else "")
        return rollout


class WeightPush(_Stateless):
    """After each update (but the last), a sampler with weights of its own gets the trainer's:
    the collector's ``update_weights(version)`` (``AsyncCollector``, ``SyncedCollector``) returns
    the seconds it took, logged as ``time/weight_sync`` (TorchRL's ``UpdateWeights``). A collector
    that samples with the trained model itself has nothing to push."""

    def register(self, trainer, name: str = "weight_push") -> None:
        self.trainer = trainer
        trainer.register_op("post_steps", self)

    def __call__(self):
        t = self.trainer
        push = getattr(t.collector, "update_weights", None)
        if push is not None and t.iteration < t.num_iterations:
            return {"time/weight_sync": push(t.iteration)}  # version = updates done
        return None


class Evaluation(TrainerHookBase):
    """Held-out evaluation (:class:`~rlhf_torchrl.evaluation.Evaluator`): the reference's
    responses once, the untrained policy's at setup, then every ``every`` iterations and after the
    last (``eval/...`` metrics, timed as ``time/eval``). Keeps the before/after responses of the
    first :data:`HELD_OUT_SAMPLES` prompts for the report, and each evaluation's for the tracker
    (``unlogged_samples``, which :class:`RunLog` sends: ``eval/samples_before``, ``eval/samples``).

    Args:
        evaluator (rlhf_torchrl.evaluation.Evaluator): samples and scores the held-out prompts.
        every: evaluate every this many iterations (and after the last).
        policy (torch.nn.Module): the trained policy model.
        reference (torch.nn.Module | None): the reference model (None with LoRA: the policy with
            its adapters off).
        device (torch.device | None): where the reference runs while it answers.
        offload_reference: the reference visits ``device`` only while it answers.
    """

    def __init__(self, evaluator, *, every: int, policy, reference=None, device=None,
                 offload_reference: bool = False):
        self.evaluator, self.every, self.policy = evaluator, every, policy
        self.reference, self.device, self.offload_reference = reference, device, offload_reference
        self.before = self.held_out_before = self.held_out_after = None
        #: (name, step, samples) of the evaluations not yet sent to the tracker (RunLog takes them)
        self.unlogged_samples: list[tuple[str, int, list[dict]]] = []

    def register(self, trainer, name: str = "evaluation") -> None:
        self.trainer = trainer
        trainer.register_op("setup", self.setup)
        trainer.register_op("post_steps_log", self.maybe_evaluate)

    @contextmanager
    def _reference_model(self):
        if self.reference is not None:
            with placed(self.reference, self.device, self.offload_reference):
                yield self.reference
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def setup(self) -> None:
        with self._reference_model() as model:
            self.evaluator.set_reference(model)  # the reference's responses, once
        if self.before is None:
            self.before, rollout = self.evaluator(self.policy)
            self.held_out_before = rollout_samples(rollout, HELD_OUT_SAMPLES)
            self.unlogged_samples.append(("eval/samples_before", 0, self.held_out_before))
            log.info("Evaluation before training: %s", format_metrics(self.before))

    def maybe_evaluate(self, batch) -> dict | None:
        done, last = self.trainer.iteration, self.trainer.num_iterations
        if done % self.every and done != last:
            return None
        start = time.perf_counter()
        # a background sampler may use this very model (overlap=0): it waits meanwhile
        with getattr(self.trainer.collector, "paused", nullcontext)():
            metrics, rollout = self.evaluator(self.policy)  # held-out prompts, after this update
        self.held_out_after = rollout_samples(rollout, HELD_OUT_SAMPLES)
        # at the step of this iteration's row (its eval/ metrics)
        self.unlogged_samples.append(("eval/samples", done - 1, self.held_out_after))
        return {**metrics, "time/eval": time.perf_counter() - start}

    def report(self, history: list[dict]) -> dict:
        """The report's evaluation entries: before, after, and the held-out responses paired.

        Args:
            history: the run's metrics rows.
        """
        if self.before is None or not history:
            return {}
        out = {"eval_before": self.before,
               "eval_after": {k: v for k, v in history[-1].items() if k.startswith("eval/")}}
        if self.held_out_before and self.held_out_after:
            out["held_out_samples"] = [
                {"prompt": b["prompt"], "question": b.get("question", b["prompt"]),
                 "before": b["response"], "score_before": b["score"],
                 "after": a["response"], "score_after": a["score"]}
                for b, a in zip(self.held_out_before, self.held_out_after)
                if b["prompt"] == a["prompt"]]
        return out

    def state_dict(self) -> dict:
        return {"eval_before": self.before, "held_out_before": self.held_out_before}

    def load_state_dict(self, state_dict: dict) -> None:
        self.before = state_dict["eval_before"]
        self.held_out_before = state_dict["held_out_before"]


class KLCeiling(_Stateless):
    """Warn (or, with ``stop``, stop the run with :class:`~rlhf_torchrl.guards.DivergenceError`
    once this iteration's metrics are written, without its checkpoint) when the KL to the
    reference passes ``ceiling`` nats per response.

    Args:
        ceiling: the KL to the reference, in nats per response, that triggers it.
        stop: stop the run rather than warn.
    """

    def __init__(self, ceiling: float, stop: bool = False):
        self.ceiling, self.stop = ceiling, stop

    def register(self, trainer, name: str = "kl_ceiling") -> None:
        self.trainer = trainer
        trainer.register_op("post_steps_log", self)

    def __call__(self, batch) -> None:
        from .guards import DivergenceError, check_kl_ceiling

        kl = self.trainer.metrics.get("objective/kl")
        if kl is None:
            return
        try:
            check_kl_ceiling(kl, self.trainer.iteration - 1, ceiling=self.ceiling, stop=self.stop)
        except DivergenceError as error:
            self.trainer.request_stop(error)


class Checkpointer(TrainerHookBase):
    """A checkpoint (:func:`~rlhf_torchrl.checkpoint.save_checkpoint`) every ``every`` iterations
    and after the last: the trained weights, the optimiser, the trainer's :meth:`state_dict`, each
    process's RNG states and ``config_yaml``; the newest ``keep`` of this run's lineage are kept
    (a resumed run's abandoned future is moved aside). Timed as ``time/checkpoint`` (in
    ``time/total``).

    Args:
        output_dir: the run's directory; checkpoints go to ``<output_dir>/checkpoints``.
        every: a checkpoint every this many iterations and after the last (0: none).
        keep: how many of the newest checkpoints to keep (None: all).
        config_yaml: the run's config, saved with each checkpoint.
    """

    def __init__(self, output_dir: str, *, every: int, keep: int | None = None,
                 config_yaml: str = ""):
        self.output_dir, self.every, self.keep, self.config_yaml = output_dir, every, keep, config_yaml
        # [run, resumed_at] of the runs whose checkpoints this one continues, then this run's
        self.lineage: list[list] = []
        self.run_id = uuid.uuid4().hex[:12]

    def register(self, trainer, name: str = "checkpoint") -> None:
        self.trainer = trainer
        trainer.register_op("checkpoint", self)

    def due(self, done: int) -> bool:
        return bool(self.every) and (done % self.every == 0 or done == self.trainer.num_iterations)

    def __call__(self) -> dict | None:
        from .checkpoint import rng_state, save_checkpoint

        t = self.trainer
        if not self.due(t.iteration) or t.stop_error is not None:
            return None
        start = time.perf_counter()
        if not self.lineage or self.lineage[-1][0] != self.run_id:  # (before the state is taken)
            self.lineage.append([self.run_id, t.first_iteration])
        save_checkpoint(self.output_dir, t.iteration, modules=t.trained_modules,
                        optimizer=t.optimizer, keep=self.keep, parallel=t.parallel,
                        config_yaml=self.config_yaml, trainer_state=t.state_dict(),
                        rollouts=t.pending_rollouts(), rng=rng_state(), lineage=self.lineage)
        seconds = time.perf_counter() - start
        log.info("Checkpoint %d written in %.2f s", t.iteration, seconds)
        return {"time/checkpoint": seconds}

    def state_dict(self) -> dict:
        return {"lineage": [list(segment) for segment in self.lineage]}

    def load_state_dict(self, state_dict: dict) -> None:
        # (a checkpoint of an earlier version records none: its lineage starts at this run)
        self.lineage = [list(segment) for segment in state_dict.get("lineage", [])]


class RunLog(TrainerHookBase):
    """Metrics and the run report (main process only): each iteration's row to ``metrics.jsonl``
    and the TorchRL ``logger``, progress on the terminal, and at the end ``report.json`` and
    ``report.html`` (:func:`~rlhf_torchrl.report.write_report`) with the score and KL trend, a few
    responses from the first and last iterations (``num_samples``) and the evaluation's entries.

    The tracker gets the run's config as its hyperparameters and each evaluation's sample
    responses as text. Progress: a tqdm bar on a terminal (iteration, score, KL, time left) under
    which log lines are printed whole; otherwise (a pipe, a log file, CI) log lines, never a
    carriage return.

    Args:
        output_dir: the run's directory (``metrics.jsonl``, the reports, the logger's files).
        logger: the tracker: ``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or None for
            ``metrics.jsonl`` only (:mod:`rlhf_torchrl.trackers`).
        progress_bar: a tqdm bar when stderr is a terminal.
        num_samples: responses of the first and last iterations kept for the report.
        config: the run's settings, the tracker's hyperparameters (None: none).
        evaluation: the :class:`Evaluation` hook whose entries go into the report (None: none).
        log_every: without the bar, a log line every this many iterations and at the last one
            (None: about 20 in a run).
        project: the tracker's project.
        run_name: the tracker's run name (None: the output directory's last two folders).
        tags: the tracker's tags.
    """

    def __init__(self, output_dir: str, *, logger: str | None = "csv", progress_bar: bool = True,
                 num_samples: int = 3, config: dict | None = None, evaluation: Evaluation | None = None,
                 log_every: int | None = None, project: str = "rlhf_torchrl",
                 run_name: str | None = None, tags: Sequence[str] = ()):
        self.output_dir, self.logger, self.progress_bar = output_dir, logger, progress_bar
        self.project, self.run_name, self.tags = project, run_name, list(tags)
        self.log_every = log_every
        self.bar = None
        self.num_samples, self.config, self.evaluation = num_samples, config or {}, evaluation
        self.first_samples = self.last_samples = None
        self.history: list[dict] = []
        self.report: dict = {}
        self._checkpointed_row = None  # the row of the iteration a loaded checkpoint closed

    def register(self, trainer, name: str = "run_log") -> None:
        self.trainer = trainer
        trainer.register_op("setup", self.setup)
        trainer.register_op("batch_process", self.keep_rollout)
        trainer.register_op("post_steps_log", self.keep_samples)  # before the checkpoint
        trainer.register_op("log", self.log)
        trainer.register_op("shutdown", self.close)

    def setup(self) -> None:
        from tqdm.auto import tqdm

        t = self.trainer
        self.writer = MetricsWriter(self.output_dir, logger=self.logger, start=t.first_iteration,
                                    project=self.project, run_name=self.run_name, tags=self.tags)
        self.writer.log_config(self.config)
        self._log_samples()
        earlier = read_metrics(self.output_dir, before=t.first_iteration)
        row, last = self._checkpointed_row, t.first_iteration - 1
        # killed after the checkpoint, before its row was written: the checkpoint's copy (in this
        # run's own directory: a run resumed elsewhere from a checkpoint path starts its log there)
        if row is not None and (earlier or last == 0) and all(r["iteration"] != last for r in earlier):
            self.writer.log(last, row)
            earlier.append({"iteration": last, **row})
        # the earlier iterations of a resumed run (skipped ones have no statistics)
        self.history = [r for r in earlier if "objective/scores" in r]
        self.bar = None
        if self.progress_bar and _is_terminal(sys.stderr):
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=t.num_iterations, initial=t.first_iteration, desc="PPO",
                            dynamic_ncols=True)
            # log lines go through tqdm.write while the bar is up: printed above it, not through it
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        self.every = self.log_every or max(1, round(t.num_iterations / 20))
        self._start = time.perf_counter()

    def keep_rollout(self, rollout):
        self._rollout = rollout  # this process's rows, with their texts
        return rollout

    def keep_samples(self, batch) -> None:
        if "objective/scores" in self.trainer.metrics:  # (not a skipped iteration)
            self.last_samples = rollout_samples(self._rollout, self.num_samples)
            if self.first_samples is None:
                self.first_samples = self.last_samples

    def _log_samples(self) -> None:
        """The evaluations' sample responses not yet sent to the tracker."""
        if self.evaluation is not None:
            for name, step, samples in self.evaluation.unlogged_samples:
                self.writer.log_samples(name, step, samples)
            self.evaluation.unlogged_samples.clear()

    def log(self, metrics: dict) -> None:
        t = self.trainer
        self.writer.log(t.iteration - 1, metrics)
        self._log_samples()
        scored = "objective/scores" in metrics  # (not a skipped iteration)
        if scored:
            self.history.append(metrics)
        if self.bar is not None:
            self.bar.update(1)
            if scored:
                self.bar.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                                     kl=f"{metrics['objective/kl']:.3f}")
        elif scored and (t.iteration % self.every == 0 or t.iteration == t.num_iterations):
            done = t.iteration - t.first_iteration
            elapsed = time.perf_counter() - self._start
            left = elapsed / done * (t.num_iterations - t.iteration) if done else 0.0
            log.info("Iteration %d/%d: score %.3f, KL %.3f, %.1f s/iteration, %s left",
                     t.iteration, t.num_iterations, metrics["objective/scores"],
                     metrics["objective/kl"], elapsed / max(done, 1), _duration(left))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
        self.writer.close()
        self.report = summary(self.history, self.first_samples, self.last_samples) if self.history else {}
        if self.evaluation is not None:
            self.report.update(self.evaluation.report(self.history))
            if "eval_after" in self.report:
                print(f"  held-out evaluation before: {format_metrics(self.report['eval_before'])}\n"
                      f"                       after: {format_metrics(self.report['eval_after'])}",
                      flush=True)
        self.trainer.report = self.report
        with open(os.path.join(self.output_dir, "report.json"), "w") as f:
            json.dump({"config": self.config, **self.report}, f, indent=1)
        log.info("Run report: %s", write_report(self.output_dir))

    def state_dict(self) -> dict:
        # the row of the iteration being checkpointed (all but time/checkpoint and time/total):
        # written by a resumed run if the process died before it wrote the row itself
        row = {k: v for k, v in self.trainer.metrics.items() if isinstance(v, (int, float))}
        return {"first_samples": self.first_samples, "last_samples": self.last_samples, "row": row}

    def load_state_dict(self, state_dict: dict) -> None:
        self.first_samples = state_dict["first_samples"]
        self.last_samples = state_dict["last_samples"]
        self._checkpointed_row = state_dict.get("row")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def summary(history: list[dict], before: list[dict], after: list[dict], quiet: bool = False) -> dict:
    """Print and return initial vs final score and KL (means over the first and the last quarter
    of the iterations: one batch is noisy), with a few responses from each end.

    Args:
        history: the run's metrics rows (``objective/scores``, ``objective/kl``, ``time/total``).
        before: sample responses from the first iterations (``rollout_samples``' dicts).
        after: sample responses from the last iterations.
        quiet: return the summary without printing it.
    """
    first, last, call, k = trend([r["objective/scores"] for r in history])
    kl_first, kl_last, _, _ = trend([r["objective/kl"] for r in history])
    report = {
        "initial_score": first,
        "final_score": last,
        "score_trend": call,
        "initial_kl": kl_first,
        "final_kl": kl_last,
        # (a row restored from a checkpoint has no time/total)
        "seconds_per_iteration": statistics.fmean(
            [r["time/total"] for r in history if "time/total" in r] or [0.0]),
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


class SavePolicy(_Stateless):
    """At the end, the trained policy as a Hugging Face checkpoint in ``<output_dir>/policy``
    (gathered from the shards under FSDP2; LoRA: the adapters, and with ``save_merged`` the merged
    weights in ``policy_merged``), with the tokenizer.

    Args:
        output_dir: the run's directory.
        tokenizer (transformers.PreTrainedTokenizerBase): saved beside the policy.
        save_merged: with LoRA, also the merged weights in ``policy_merged``.
    """

    def __init__(self, output_dir: str, tokenizer, *, save_merged: bool = False):
        self.output_dir, self.tokenizer, self.save_merged = output_dir, tokenizer, save_merged

    def register(self, trainer, name: str = "save_policy") -> None:
        self.trainer = trainer
        trainer.register_op("shutdown", self)

    def __call__(self) -> None:
        import copy

        t = self.trainer
        policy = t.actor.model
        state = t.parallel.full_state_dict(policy)  # every process takes part under FSDP2
        if not t.parallel.is_main:
            return
        path = os.path.join(self.output_dir, "policy")
        policy.save_pretrained(path, state_dict=state)
        self.tokenizer.save_pretrained(path)
        if self.save_merged:
            merged_path = os.path.join(self.output_dir, "policy_merged")
            merged = copy.deepcopy(policy).merge_and_unload()  # the live policy keeps its adapters
            merged.save_pretrained(merged_path)
            self.tokenizer.save_pretrained(merged_path)
