"""Per-iteration metrics: rollout statistics, a JSON-lines file and a TorchRL logger."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K


def number(value: float, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``, never as a negative zero: a KL of -0.0002 prints as
    ``0.000`` (``+0.000`` with ``+.3f``), not ``-0.000``.

    Args:
        value: the number.
        spec: a format spec for a float (``.3f``, ``+.2f``, ...).

    Example:
        >>> number(-0.0002), number(-0.0002, "+.3f"), number(-0.0016)
        ('0.000', '+0.000', '-0.002')
    """
    text = format(value, spec)
    return format(0.0, spec) if float(text) == 0 else text


def rollout_metrics(td: TensorDictBase, kl_coef: float) -> dict[str, float]:
    """Statistics of one shaped rollout (TRL/open-instruct names).

    Args:
        td: a shaped rollout.
        kl_coef: the KL coefficient it was shaped with (``objective/kl_coef``).

    ``objective/kl`` is the KL summed over each response, averaged over responses;
    ``objective/non_score_reward`` the summed KL reward; ``objective/rlhf_reward`` = scores +
    non-score reward; ``objective/entropy`` the summed exact entropy; ``objective/step_reward``
    a process reward's step values summed over each response (weighted), averaged;
    ``objective/teacher_kl`` (on-policy distillation) the estimate of the reverse KL to the
    teacher, summed over each response, averaged.
    """
    mask = td.get(K.RESPONSE_MASK)
    kl = td.get(K.KL).sum(-1)
    non_score = td.get(K.NON_SCORE_REWARD).squeeze(-1).sum(-1)
    score = td.get(K.SCORE)
    out = {
        "objective/kl": float(kl.mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((score + non_score).mean()),
        "objective/scores": float(score.mean()),
        "objective/kl_coef": kl_coef,
        "val/num_eos_tokens": float(td.get(K.HAS_STOP).sum()),
        "val/sequence_lengths": float(mask.sum(-1).float().mean()),
    }
    keys = td.keys(True)
    if K.VALUE in keys:  # (a critic-free run has none)
        out["val/value_mean"] = float(F.masked_mean(td.get(K.VALUE).squeeze(-1), mask))
    if K.VALUE in keys and K.VALUE_TARGET in keys:  # the old values against the targets
        out["val/explained_variance"] = float(F.explained_variance(
            td.get(K.VALUE).squeeze(-1), td.get(K.VALUE_TARGET).squeeze(-1), mask))
    if K.RAW_SCORE in keys:  # a Scorer's score before the missing-EOS penalty
        out["objective/raw_scores"] = float(td.get(K.RAW_SCORE).mean())
    if K.TEACHER_KL in keys:  # on-policy distillation: the reverse KL to the teacher, per response
        out["objective/teacher_kl"] = float(td.get(K.TEACHER_KL).sum(-1).mean())
    if K.STEP_REWARD in keys:  # process rewards, beside the score: summed over each response
        out["objective/step_reward"] = float(td.get(K.STEP_REWARD).sum(-1).mean())
    if K.ENTROPY in keys:
        out["objective/entropy"] = float((td.get(K.ENTROPY) * mask).sum(-1).mean())
    if "scores" in td.keys():
        for name, value in td.get("scores").items():
            out[f"objective/scores/{name}"] = float(value.mean())
    if K.REWARD_STATS in td.keys():  # what rewards report per row, e.g. a judge's unread answers
        for name, value in td.get(K.REWARD_STATS).items():
            out[f"reward/{name}"] = float(value.float().mean())
    out.update(episode_metrics(td))
    return out


def episode_metrics(td: TensorDictBase) -> dict[str, float]:
    """Multi-turn episodes (:class:`~rlhf_torchrl.collectors.MultiTurnCollector`): turns, tool
    calls and failed calls per episode, the tokens the tools wrote, each end reason's share and
    the tools' rewards; nothing for single-response rollouts.

    Args:
        td: a rollout.
    """
    from rlhf_torchrl.data.rollout import END_REASONS

    keys = td.keys(True)
    if K.TURNS not in keys:
        return {}
    end = td.get(K.EPISODE_END)
    out = {
        "env/turns_per_episode": float(td.get(K.TURNS).double().mean()),
        "env/tool_calls_per_episode": float(td.get(K.TOOL_CALLS).double().mean()),
        "env/tool_errors_per_episode": float(td.get(K.TOOL_ERRORS).double().mean()),
        "env/observation_tokens": float(td.get(K.OBSERVATION_MASK).sum(-1).double().mean()),
        "env/turn_reward": float(td.get(K.TURN_REWARD).sum(-1).double().mean()),
    }
    for i, reason in enumerate(END_REASONS):
        out[f"env/end_{reason}"] = float((end == i).double().mean())
    return out


def sampler_metrics(td: TensorDictBase, version: int) -> dict[str, float]:
    """How far the sampler was from the trainer (``version``: updates done): the staleness of
    asynchronous rows (``async/staleness``, mean and max, in updates) and, where the old log-probs
    were recomputed, ``policy/behaviour_approxkl``: ``0.5 * mean((log pi_old - log
    pi_sampler)^2)`` over response tokens (other weights, or other kernels, e.g. vLLM's). Partial
    rollouts add each token's staleness (``partial/token_staleness``, mean and max over response
    tokens), the share of responses sampled by more than one version (``partial/mixed_version_frac``)
    and the rounds per response (``partial/segments``).

    Args:
        td: a rollout, with the sampler's records.
        version: the trainer's updates done.
    """
    out = {}
    keys = td.keys(True)
    if K.POLICY_VERSION in keys:
        lag = (version - td.get(K.POLICY_VERSION)).double()
        out["async/staleness"] = float(lag.mean())
        out["async/max_staleness"] = float(lag.max())
    if K.TOKEN_VERSION in keys:
        mask, versions = td.get(K.RESPONSE_MASK), td.get(K.TOKEN_VERSION)
        lag = (version - versions).double()
        out["partial/token_staleness"] = float(F.masked_mean(lag, mask))
        out["partial/max_token_staleness"] = float(lag.masked_fill(~mask, 0).max())
        oldest = versions.masked_fill(~mask, version).amin(-1)
        out["partial/mixed_version_frac"] = float((oldest != versions.masked_fill(~mask, -1).amax(-1))
                                                  .double().mean())
        out["partial/segments"] = float(td.get(K.SEGMENTS).double().mean())
    if K.BEHAVIOUR_LOG_PROB in keys:
        gap = td.get(K.LOG_PROB) - td.get(K.BEHAVIOUR_LOG_PROB)
        out["policy/behaviour_approxkl"] = float(F.masked_mean(0.5 * gap**2, td.get(K.RESPONSE_MASK)))
    return out


class MetricsWriter:
    """Writes each iteration's metrics as one JSON object per line, and to a TorchRL logger.

    The logger is opened by :func:`~rlhf_torchrl.record.trackers.open_logger`; where each writes:
    :mod:`rlhf_torchrl.record.trackers`. Lines of iterations ``>= start`` that an earlier run left in
    ``metrics.jsonl`` and in the CSV logs (written after its last checkpoint) are dropped, so that
    a resumed run's logs hold every iteration once. Loggers that keep their data elsewhere
    (TensorBoard, W&B, MLflow) get the repeated iterations again.

    Args:
        output_dir: the run's directory (``metrics.jsonl``, the logger's files).
        logger: ``"csv"`` (TorchRL ``CSVLogger``), ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or
            None for the JSON file only.
        exp_name: the CSV logger's experiment name (its folder).
        start: the first iteration this writer logs.
        project: the tracker's project.
        run_name: the tracker's run name (None: the output directory's last two folders).
        tags: the tracker's tags.

    Example:
        >>> import tempfile
        >>> writer = MetricsWriter(tempfile.mkdtemp(), logger=None)
        >>> writer.log(0, {"objective/scores": 0.5})
        >>> writer.close()
    """

    def __init__(self, output_dir: str, *, logger: str | None = "csv", exp_name: str = "ppo",
                 start: int = 0, project: str = "rlhf_torchrl", run_name: str | None = None,
                 tags: Sequence[str] = ()):
        from rlhf_torchrl.record import trackers

        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        _keep_lines(self.path, lambda line: json.loads(line)["iteration"] < start)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.project, self.tags = project, list(tags)
        self.run_name = run_name or trackers.default_run_name(output_dir)
        self.logger, self.kind = None, logger
        if logger:
            self.logger = trackers.open_logger(logger, output_dir, project=project,
                                               run_name=self.run_name, tags=self.tags,
                                               csv_name=exp_name)
            scalars = os.path.join(getattr(self.logger.experiment, "log_dir", ""), "scalars")
            if logger == "csv":  # scalars/<name>.csv, "objective/kl" in a folder of its own
                for folder, _, files in os.walk(scalars):
                    for name in files:
                        _keep_lines(os.path.join(folder, name),
                                    lambda line: int(line.split(",", 1)[0]) < start)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float, torch.Tensor)) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"iteration": step, **clean}) + "\n")
        self._file.flush()
        if self.logger is not None:
            from rlhf_torchrl.record.trackers import metric_name

            for name, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self.logger.log_scalar(metric_name(self.kind, name), value, step=step)

    def log_config(self, config: dict) -> None:
        """The resolved config (a nested dict) as the run's hyperparameters.

        Args:
            config: the resolved config.
        """
        if self.logger is not None:
            from rlhf_torchrl.record.trackers import log_config

            log_config(self.logger, config, project=self.project, run_name=self.run_name,
                       tags=self.tags)

    def log_samples(self, name: str, step: int, samples: list[dict]) -> None:
        """Sample responses (:func:`~rlhf_torchrl.trainers.evaluation.rollout_samples`) as text.

        Args:
            name: the text's name (e.g. ``eval/samples``).
            step: the iteration.
            samples: ``{"prompt", "question", "response", "score"}`` dicts.
        """
        if self.logger is not None and samples:
            from rlhf_torchrl.record.trackers import log_samples

            log_samples(self.logger, name, step, samples)

    def close(self) -> None:
        self._file.close()
        if self.logger is not None:
            from rlhf_torchrl.record.trackers import close_logger

            close_logger(self.logger)
            self.logger = None


def read_metrics(output_dir: str, before: int | None = None) -> list[dict]:
    """The rows of ``<output_dir>/metrics.jsonl`` (of iterations ``< before`` when given).

    Args:
        output_dir: the run's directory.
        before: keep iterations below this one (None: all).
    """
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if before is None or r["iteration"] < before]


def _keep_lines(path: str, keep) -> None:
    """Rewrite ``path`` (if it exists) with only the lines ``keep`` accepts (atomically); a last line
    cut short by a crash is dropped."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if line.endswith("\n") and keep(line):
                kept.append(line)
        except (ValueError, KeyError):  # a torn line
            continue
    if len(kept) == len(lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
