"""Which checkpoint a run continues from, and what makes a run the same run: its identity,
checked before a resume and before a finished run is left as it is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.config.derived import eval_prompt_count
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)


def resume_path(cfg: DictConfig) -> str | None:
    """The checkpoint this run continues from (None: a fresh run), decided before anything loads.

    ``resume: auto`` takes the newest complete checkpoint in ``output_dir`` (one whose files a bad
    disk tore is named and skipped for the one before); ``never`` starts fresh, deleting an
    earlier run's checkpoints and metrics in ``output_dir``; any other value is the path of a
    checkpoint (``<run>/checkpoints/iter_<N>``).

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.trainers.checkpoint import (
        CHECKPOINTS,
        is_checkpoint,
        latest_checkpoint,
        verify_checkpoint,
    )

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
    from rlhf_torchrl.trainers.checkpoint import list_checkpoints

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
