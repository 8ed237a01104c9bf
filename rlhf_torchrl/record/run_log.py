"""The run's log: each iteration's metrics row (``metrics.jsonl`` and the TorchRL logger),
progress on the terminal, and at the end the console summary and the run report, as one trainer
hook (:class:`RunLog`, main process only).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchrl.trainers import TrainerHookBase

from rlhf_torchrl.record.metrics import MetricsWriter, number, read_metrics
from rlhf_torchrl.record.report import write_report
from rlhf_torchrl.record.verdict import assess, trend
from rlhf_torchrl.trainers.evaluation import format_metrics, rollout_samples

if TYPE_CHECKING:
    from rlhf_torchrl.trainers.hooks import Evaluation

log = logging.getLogger(__name__)


class RunLog(TrainerHookBase):
    """Metrics and the run report (main process only): each iteration's row to ``metrics.jsonl``
    and the TorchRL ``logger``, progress on the terminal, and at the end ``report.json`` and
    ``report.html`` (:func:`~rlhf_torchrl.record.report.write_report`) with the score and KL trend, a few
    responses from the first and last iterations (``num_samples``) and the evaluation's entries.

    The tracker gets the run's config as its hyperparameters and each evaluation's sample
    responses as text. Progress: a tqdm bar on a terminal (iteration, score, KL, time left) under
    which log lines are printed whole; otherwise (a pipe, a log file, CI) log lines, never a
    carriage return.

    Args:
        output_dir: the run's directory (``metrics.jsonl``, the reports, the logger's files).
        logger: the tracker: ``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or None for
            ``metrics.jsonl`` only (:mod:`rlhf_torchrl.record.trackers`).
        progress_bar: a tqdm bar when stderr is a terminal.
        num_samples: responses of the first and last iterations kept for the report.
        config: the run's settings, the tracker's hyperparameters (None: none).
        evaluation: the :class:`~rlhf_torchrl.trainers.hooks.Evaluation` hook whose entries go into the report (None: none).
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
        self.writer.log(t.iteration, metrics)
        self._log_samples()
        scored = "objective/scores" in metrics  # (not a skipped iteration)
        if scored:
            self.history.append(metrics)
        if self.bar is not None:
            self.bar.update(1)
            if scored:
                self.bar.set_postfix(score=number(metrics["objective/scores"]),
                                     kl=number(metrics["objective/kl"]))
        elif scored and (t.iterations_done % self.every == 0 or t.iterations_done == t.num_iterations):
            done = t.iterations_done - t.first_iteration
            elapsed = time.perf_counter() - self._start
            left = elapsed / done * (t.num_iterations - t.iterations_done) if done else 0.0
            log.info("Iteration %d/%d: score %s, KL %s, %.1f s/iteration, %s left",
                     t.iterations_done, t.num_iterations, number(metrics["objective/scores"]),
                     number(metrics["objective/kl"]), elapsed / max(done, 1), _duration(left))

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
        if self.history:  # the verdict's call and flags (a flat held-out score, ...): report.json
            found = assess(self.history, self.report)
            self.report.update(verdict=found.call, flags=[f.name for f in found.flags])
            for flag in found.flags:
                print(f"  flag {flag.name}: {flag.message}", flush=True)
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
        f"  mean score: {number(first, '+.3f')} -> {number(last, '+.3f')}, {call}"
        f"   (first/last {k} iteration{'s' if k > 1 else ''})",
        f"  KL to reference: {number(kl_first)} -> {number(kl_last)}",
    ]
    for title, samples in (("before", before), ("after", after)):
        lines.append(f"  responses {title} training:")
        for s in samples:
            lines.append(f"    [{s['score']:+.2f}] {s['response'].strip()[:150]!r}")
    lines.append("=" * 72)
    if not quiet:
        print("\n".join(lines), flush=True)
    return report
