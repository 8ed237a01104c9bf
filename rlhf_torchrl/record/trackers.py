"""The experiment trackers behind ``logging.logger``: TorchRL's loggers, opened with the run's
project, name and tags, and given the resolved config and the evaluations' sample responses.

Where each writes (``output_dir`` is the run's directory; nothing goes to the working directory):

======================  ==========================================================================
``csv``                 ``<output_dir>/ppo/scalars/<metric>.csv``; text (config, samples) in
                        ``<output_dir>/ppo/texts/``
``tensorboard``         ``<output_dir>/tensorboard/<run_name>/events.out.tfevents.*``:
                        ``tensorboard --logdir <output_dir>/tensorboard`` (or a parent folder of
                        several runs: ``tensorboard --logdir outputs/ppo``)
``wandb``               W&B project ``project``, run ``run_name`` with ``tags``; local files in
                        ``<output_dir>/wandb/`` (``WANDB_MODE=offline``: only there, for
                        ``wandb sync`` later)
``mlflow``              experiment ``project``, run ``run_name`` with ``tags``, in
                        ``$MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<output_dir>/mlflow.db``
                        with artifacts in ``<output_dir>/mlflow-artifacts/``
======================  ==========================================================================

The config goes to each as hyperparameters: W&B's run config (nested), TensorBoard's HPARAMS tab
and MLflow's parameters (flattened to dotted keys: ``ppo.batch_size``), the CSV logger's
``texts/hparams*.txt``. Sample responses: a W&B table, TensorBoard text, an MLflow JSON artifact,
a CSV text file.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

from rlhf_torchrl.errors import ConfigError, MissingDependencyError

#: logging.logger's choices; None logs to metrics.jsonl alone
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
#: the package each logger imports, and the extra that installs it
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_logger(kind: str | None) -> None:
    """A :class:`~rlhf_torchrl.errors.ConfigError` for an unknown logger, a
    :class:`~rlhf_torchrl.errors.MissingDependencyError` naming the install for a missing package;
    before any work."""
    if kind is None:
        return
    if kind not in LOGGERS:
        raise ConfigError(f"logging.logger={kind} is not a logger: choose one of "
                          f"{', '.join(LOGGERS)}, or null (metrics.jsonl alone).")
    package = PACKAGES.get(kind)
    extra = "logging" if kind != "mlflow" else "mlflow"
    if package and importlib.util.find_spec(package) is None:
        raise MissingDependencyError(f"logging.logger={kind} needs the {package} package: "
                                     f"`pip install 'rlhf_torchrl[{extra}]'`, or choose "
                                     "logging.logger=csv.")
    if (kind == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI")
            and importlib.util.find_spec("sqlalchemy") is None):
        raise MissingDependencyError("logging.logger=mlflow keeps its runs in <output_dir>/mlflow.db "
                                     "when MLFLOW_TRACKING_URI is unset, which needs SQLAlchemy: "
                                     "`pip install 'rlhf_torchrl[mlflow]'`, or set "
                                     "MLFLOW_TRACKING_URI to your MLflow server.")


def default_run_name(output_dir: str) -> str:
    """The run's name when none is given: its output directory's name (``outputs/ppo/sentiment/
    2026-11-24_10-00-00`` -> ``sentiment/2026-11-24_10-00-00``, its last two folders)."""
    parts = Path(os.path.abspath(output_dir)).parts
    return "/".join(parts[-2:]) if len(parts) >= 2 else parts[-1]


def open_logger(kind: str, output_dir: str, *, project: str, run_name: str,
                tags: Sequence[str] = (), csv_name: str = "ppo"):
    """TorchRL's logger of ``kind`` (:data:`LOGGERS`) for a run in ``output_dir``, named
    ``run_name`` in ``project`` with ``tags`` (where the tracker has those: W&B and MLflow; for
    TensorBoard the run's folder, with the three written as text by :func:`log_config`)."""
    check_logger(kind)
    output_dir = os.path.abspath(output_dir)
    tags = [str(t) for t in tags]
    if kind == "csv":
        from torchrl.record.loggers import CSVLogger

        return CSVLogger(exp_name=csv_name, log_dir=output_dir)
    if kind == "tensorboard":
        from torchrl.record.loggers import TensorboardLogger

        return TensorboardLogger(exp_name=run_name.replace(os.sep, "_"),
                                 log_dir=os.path.join(output_dir, "tensorboard"))
    if kind == "wandb":
        from torchrl.record.loggers import WandbLogger

        return WandbLogger(exp_name=run_name, project=project, tags=tags or None,
                           save_dir=output_dir)
    import mlflow
    from torchrl.record.loggers import MLFlowLogger

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    artifacts = None
    if not uri:  # a database in the run's directory (MLflow >= 3.10 has no file store)
        uri = f"sqlite:///{os.path.join(output_dir, 'mlflow.db')}"
        artifacts = Path(output_dir, "mlflow-artifacts").as_uri()
    logger = MLFlowLogger(exp_name=project, tracking_uri=uri, artifact_location=artifacts)
    logger.experiment  # noqa: B018 - opens the run, so that its name and tags are set on it
    mlflow.set_tags({"mlflow.runName": run_name, **{tag: "true" for tag in tags}})
    return logger


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """``{"ppo": {"batch_size": 8}}`` -> ``{"ppo.batch_size": 8}``: numbers, strings and booleans
    as they are, None as ``"null"``, lists and other values as their JSON text."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        elif value is None:
            flat[name] = "null"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def log_config(logger, config: dict, *, project: str, run_name: str,
               tags: Sequence[str] = ()) -> None:
    """The resolved ``config`` (a nested dict) as the run's hyperparameters (see the module's
    docstring for where each tracker shows them)."""
    kind = _kind(logger)
    flat = flatten(config)
    if kind == "wandb":
        logger.experiment.config.update(config, allow_val_change=True)
    elif kind == "tensorboard":
        from torch.utils.tensorboard.summary import hparams

        writer = logger.experiment
        # in the run's own event file (SummaryWriter.add_hparams would open a run of its own)
        for summary in hparams(flat, {"objective/scores": 0.0, "objective/kl": 0.0}):
            writer.file_writer.add_summary(summary)
        writer.add_text("run", f"project: {project}  \nrun name: {run_name}  \ntags: "
                        f"{', '.join(map(str, tags)) or '(none)'}", global_step=0)
        writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flat.items()),
                        global_step=0)
        writer.flush()
    elif kind == "mlflow":
        import mlflow

        items = [(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow takes up to 100 parameters a request
            mlflow.log_params(dict(items[i:i + 100]))
    elif kind == "csv":
        logger.log_hparams(flat)


def log_samples(logger, name: str, step: int, samples: list[dict]) -> None:
    """One evaluation's sample responses (``{"question", "response", "score", ...}`` rows,
    :func:`~rlhf_torchrl.trainers.evaluation.rollout_samples`) as text under ``name`` at ``step``."""
    kind = _kind(logger)
    if kind == "wandb":
        import wandb

        columns = ["iteration", "prompt", "response", "score"]
        table = wandb.Table(columns=columns, data=[
            [step, s.get("question", s["prompt"]), s["response"], float(s["score"])]
            for s in samples])
        step_key = f"{name.rpartition('/')[0]}/step" if "/" in name else "step"
        logger.experiment.log({name: table, step_key: step})
    elif kind == "tensorboard":
        logger.experiment.add_text(name, markdown(samples), global_step=step)
        logger.experiment.flush()
    elif kind == "mlflow":
        import mlflow

        mlflow.log_dict({"iteration": step, "samples": samples},
                        f"{name.replace('/', '_')}/iteration_{step:06d}.json")
    elif kind == "csv":
        logger.experiment.add_text(f"{name.replace('/', '_')}_", json.dumps(samples, indent=1),
                                   global_step=step)


def markdown(samples: list[dict]) -> str:
    """Sample responses as Markdown (TensorBoard's text tab renders it): each prompt and response
    as an indented block, so that their newlines and symbols show as written."""

    def block(text: str) -> str:
        return "\n".join(f"    {line}" for line in str(text).splitlines() or [""])

    parts = []
    for i, s in enumerate(samples, 1):
        parts.append(f"**{i}. score {float(s['score']):.3f}**\n\nprompt:\n\n"
                     f"{block(s.get('question', s['prompt']))}\n\nresponse:\n\n{block(s['response'])}")
    return "\n\n".join(parts)


def close_logger(logger) -> None:
    """Flush and close the tracker's run (W&B's ``finish``, MLflow's ``end_run``)."""
    kind = _kind(logger)
    if kind == "wandb":
        logger.experiment.finish()
    elif kind == "tensorboard":
        logger.experiment.close()
    elif kind == "mlflow":
        import mlflow

        mlflow.end_run()


def metric_name(kind: str | None, name: str) -> str:
    """``name`` as the tracker ``kind`` takes it: MLflow accepts letters, digits, ``_ - . /`` and
    spaces only, so ``eval/pass@4`` goes there as ``eval/pass_at_4``; the others take any name.

    Args:
        kind: the tracker (``logging.logger``).
        name: the metric's name.
    """
    return name.replace("@", "_at_") if kind == "mlflow" else name


def _kind(logger) -> str | None:
    name = type(logger).__name__
    return {"CSVLogger": "csv", "TensorboardLogger": "tensorboard", "WandbLogger": "wandb",
            "MLFlowLogger": "mlflow"}.get(name)
