"""A checkpoint's policy as a Hugging Face model directory, the one transformers, vLLM and PEFT load.

``rlhf-torchrl export <checkpoint or run> <out_dir>`` (:func:`main`, :func:`export_checkpoint`)
writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the run's tokenizer
(its pad token and chat template as trained) from any checkpoint this library writes:

- one process or DDP: ``weights/`` holds the whole policy, written once;
- FSDP2: each process wrote its own shards; ``torch.distributed.checkpoint`` reads them into whole
  tensors here, in one process, with no ``torchrun`` and no process group;
- LoRA: ``weights/`` holds the adapters only, the base weights are ``model.policy``'s.
  ``lora="merge"`` (the default) adds ``B A alpha / r`` to the adapted matrices and writes a plain
  model directory; ``lora="adapters"`` writes a PEFT adapter directory
  (``adapter_config.json``, ``adapter_model.safetensors``) that
  ``peft.PeftModel.from_pretrained(base, out_dir)`` loads on the base model.

The base model (the architecture, the weights a LoRA run froze, the tokenizer) is the run's
``model.policy``, read from the checkpoint's ``config.yaml`` with ``model.dtype``,
``data.chat_template`` and ``lora.*``; ``base`` gives another place for it (the run's machine had
it elsewhere). Not exported: the value head, a separate critic's trunk, the optimiser and the
trainer's state (they serve training, not generation).

Reading is data only: the checkpoint goes through :func:`~rlhf_torchrl.trainers.checkpoint.verify_checkpoint`
and :func:`~rlhf_torchrl.safe_loading.load_dcp` (no pickle in it runs), the base model through
:func:`~rlhf_torchrl.modules.models.load_causal_lm`. The directory is written beside ``out_dir``
and renamed into place, so an export cut short leaves no half-written model.

Example:
    >>> exported = export_checkpoint("runs/a", "runs/a-hf")  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(exported.path)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field

from torch import nn

from rlhf_torchrl.errors import ConfigError, MissingFileError
from rlhf_torchrl.safe_loading import UnsafeFileError, load_dcp, read_dcp_metadata
from rlhf_torchrl.trainers.checkpoint import (
    CHECKPOINTS,
    WEIGHTS,
    CheckpointError,
    is_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    single_process_quiet,
    verify_checkpoint,
)
from rlhf_torchrl.trainers.warm_start import saved_weight_names

log = logging.getLogger(__name__)

#: what ``lora=`` takes: the adapters merged into the base weights, or a PEFT adapter directory
LORA_MODES = ("merge", "adapters")


@dataclass
class Exported:
    """What :func:`export_checkpoint` wrote, and from what.

    Args:
        path: the model directory written.
        checkpoint: the checkpoint read.
        iteration: its iterations done.
        source: how it was written, in words (``"FSDP2, the shards of 2 processes"``).
        lora: ``"merge"`` or ``"adapters"`` for a LoRA run, None for full fine-tuning.
        base: the base model the policy was built on (``model.policy`` or ``base``).
        left_out: the checkpoint's parts not exported, in words.
    """

    path: str
    checkpoint: str
    iteration: int | None
    source: str
    lora: str | None
    base: str
    left_out: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """The files of :attr:`path`, sorted."""
        return sorted(os.listdir(self.path))


def find_checkpoint(source: str) -> str:
    """The checkpoint ``source`` names: a checkpoint directory itself, or a run's ``output_dir``
    (its newest complete checkpoint; a torn one is named in a warning and skipped).

    Args:
        source: ``<run>/checkpoints/iter_<N>`` or ``<run>``.
    """
    if not os.path.exists(source):
        raise MissingFileError(f"{source} does not exist: give a checkpoint "
                               f"(<run>/{CHECKPOINTS}/iter_<N>) or a run's output_dir.")
    if is_checkpoint(source):
        return source
    newest = latest_checkpoint(source, verify=True) if os.path.isdir(source) else None
    if newest is not None:
        return newest
    final = os.path.join(source, "policy")
    hint = (f"; its {final} is the final policy, a Hugging Face model directory already"
            if os.path.isfile(os.path.join(final, "config.json")) else "")
    raise MissingFileError(f"{source} is neither a checkpoint (<run>/{CHECKPOINTS}/iter_<N>, "
                           f"holding trainer.pt and {WEIGHTS}/) nor a run's output_dir holding one"
                           f"{hint}.")


def check_out_dir(out_dir: str) -> None:
    """Refuse an ``out_dir`` that is a file or a folder with files in it: an export never mixes
    its files with others' nor overwrites them.

    Args:
        out_dir: where the model directory goes.
    """
    if os.path.isfile(out_dir):
        raise ConfigError(f"Output {out_dir} is a file: give a new or empty folder.")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"Output folder {out_dir} is not empty: give a new or empty folder "
                          "(an export overwrites nothing).")


def _check_lora_mode(lora: str) -> None:
    if lora not in LORA_MODES:
        raise ConfigError(f"lora={lora!r} is not an export mode: choose one of {', '.join(LORA_MODES)} "
                          "(merge: a plain model directory; adapters: a PEFT adapter directory).")


def policy_weight_names(checkpoint: str) -> set[str]:
    """The names of the policy's weights checkpoint ``checkpoint`` holds, as the policy's own
    ``state_dict`` names them (a PEFT model's for a LoRA run), read from its metadata.

    Args:
        checkpoint: the checkpoint directory.
    """
    return {name.removeprefix("policy.") for name in saved_weight_names(checkpoint)
            if name.startswith("policy.")}


def load_policy_weights(checkpoint: str, policy: nn.Module, base: str = "the base model") -> None:
    """Load the policy's weights of ``checkpoint`` into ``policy``, in place, in one process: an
    FSDP2 checkpoint's shards are read into whole tensors. ``policy`` is built as the run built
    it (the base model, with LoRA adapters for a LoRA run); every weight it trains must be in the
    checkpoint (a tied copy counts once), and the checkpoint must hold none it lacks.

    Args:
        checkpoint: the checkpoint directory.
        policy: the policy, its frozen weights already the base model's.
        base: what the error calls the base model.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    saved = policy_weight_names(checkpoint)
    if not saved:
        raise CheckpointError(f"Checkpoint {checkpoint} holds no policy weights: it was not "
                              "written by PPOTrainer's Checkpointer.")
    state = policy.state_dict()  # (tensors that share the parameters' storage: loaded in place)
    names: dict[int, list[str]] = {}
    for name, param in policy.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names.setdefault(id(param), []).append(name)
    missing = [group[0] for group in names.values() if not saved.intersection(group)]
    unknown = sorted(saved - set(state))
    if missing or unknown:
        what = (f"lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                if missing else f"holds {unknown[0]}, which the model lacks")
        raise ConfigError(f"Checkpoint {checkpoint} does not fit the policy built from {base}: it "
                          f"{what}. It was trained on another model (or LoRA setting): give the run's "
                          "base model with --base.")
    target = {"model": {f"policy.{name}": state[name] for name in saved}}
    try:
        with single_process_quiet():
            load_dcp(target, os.path.join(checkpoint, WEIGHTS))
    except UnsafeFileError:
        raise
    # (DCP gathers each error in a CheckpointException, a BaseException)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - other shapes, a torn file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"Checkpoint {checkpoint}: its policy weights do not load into the "
                              f"model built from {base} ({type(e).__name__}: {first[:200]}); give "
                              "the run's base model with --base.") from e


def export_policy(checkpoint: str, out_dir: str, *, policy: nn.Module, tokenizer,
                  lora: str = "merge") -> str:
    """Write the policy of ``checkpoint`` to ``out_dir`` as a Hugging Face model directory:
    loaded into ``policy`` (:func:`load_policy_weights`), then saved with ``tokenizer``. For a
    checkpoint of your own :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer` loop, whose
    ``config.yaml`` names no model: build ``policy`` as your script does. Returns ``out_dir``.

    Args:
        checkpoint: the checkpoint directory.
        out_dir: a new or empty folder.
        policy: the policy as the run built it (a PEFT model for a LoRA run), base weights loaded.
        tokenizer (transformers.PreTrainedTokenizerBase): the run's tokenizer, saved beside it.
        lora: a PEFT ``policy``: ``merge`` (a plain model) or ``adapters`` (PEFT's directory).
    """
    from rlhf_torchrl.modules.lora import is_peft
    from rlhf_torchrl.modules.models import save_tokenizer

    _check_lora_mode(lora)
    check_out_dir(out_dir)
    load_policy_weights(checkpoint, policy, getattr(policy, "name_or_path", "the base model"))
    model = policy.merge_and_unload() if is_peft(policy) and lora == "merge" else policy
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        os.replace(tmp, out_dir)  # atomic; an empty out_dir is replaced
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _settings(checkpoint: str) -> dict:
    """The checkpoint's ``config.yaml`` as plain containers (empty: none, or a checkpoint of a
    PPOTrainer of your own whose Checkpointer was given no config)."""
    from omegaconf import OmegaConf

    file = os.path.join(checkpoint, "config.yaml")
    if not os.path.isfile(file):
        return {}
    loaded = OmegaConf.to_container(OmegaConf.load(file))
    return loaded if isinstance(loaded, dict) else {}


def _written_by(settings: dict, trainer_state: dict) -> str:
    """How the checkpoint was written, in words."""
    processes = int(trainer_state.get("world_size") or 1)
    strategy = (settings.get("distributed") or {}).get("strategy")
    if strategy == "fsdp2":
        return f"FSDP2, the shards of {processes} process{'es' if processes > 1 else ''}"
    if processes > 1:
        return f"DDP, {processes} processes"
    return "one process"


def _left_out(checkpoint: str) -> list[str]:
    """The parts of ``checkpoint`` an export leaves out, in words."""
    names = read_dcp_metadata(os.path.join(checkpoint, WEIGHTS)).state_dict_metadata
    parts = []
    if any(name.startswith("model.value_head.") for name in names):
        parts.append("the value head")
    if any(name.startswith("model.critic_trunk.") for name in names):
        parts.append("the critic's own trunk")
    if any(name.startswith("optim.") for name in names):
        parts.append("the optimiser state")
    return [*parts, "the trainer's state"]


def _check_base(base: str) -> None:
    """The base model's ``config.json`` can be read: one line naming it before any weights load."""
    from transformers import AutoConfig

    from rlhf_torchrl.modules.models import resolve_model_path

    path = resolve_model_path(base)
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise MissingFileError(f"The base model {base} is not a directory here: give it with "
                               "--base (a local model directory or a hub id).")
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"The base model {base} cannot be loaded ({first}): give it with "
                          "--base (a local model directory or a hub id).") from None


def export_checkpoint(source: str, out_dir: str, *, lora: str = "merge",
                      base: str | None = None) -> Exported:
    """Write the policy of a checkpoint (or of a run's newest) to ``out_dir`` as a Hugging Face
    model directory, the model built as the checkpoint's ``config.yaml`` says. Everything is
    checked (the output folder, the checkpoint's files, the base model's config) before any
    weights load.

    Args:
        source: ``<run>/checkpoints/iter_<N>``, or a run's ``output_dir`` (its newest checkpoint).
        out_dir: a new or empty folder.
        lora: for a LoRA run, ``merge`` (the adapters merged into the base weights: a plain model
            directory) or ``adapters`` (a PEFT adapter directory for the base model).
        base: the base model (a directory or hub id) in place of the run's ``model.policy``.
    """
    from rlhf_torchrl.modules.lora import add_lora
    from rlhf_torchrl.modules.models import load_causal_lm, load_tokenizer

    _check_lora_mode(lora)
    check_out_dir(out_dir)
    checkpoint = find_checkpoint(source)
    verify_checkpoint(checkpoint)  # torn or planted files: one line, before anything loads
    settings = _settings(checkpoint)
    model = settings.get("model") or {}
    base = base or model.get("policy")
    if not base:
        raise ConfigError(f"Checkpoint {checkpoint} names no base model (its config.yaml has no "
                          "model.policy: a PPOTrainer of your own): give it with --base, or build "
                          "the policy in Python and call rlhf_torchrl.trainers.export.export_policy.")
    adapters = any("lora_" in name for name in policy_weight_names(checkpoint))
    lora_settings = settings.get("lora") or {}
    if adapters and not lora_settings.get("r"):
        raise ConfigError(f"Checkpoint {checkpoint} holds LoRA adapters but its config.yaml records "
                          "no lora.* settings: build the PEFT policy in Python and call "
                          "rlhf_torchrl.trainers.export.export_policy.")
    if lora == "adapters" and not adapters:
        raise ConfigError(f"Checkpoint {checkpoint} was trained without LoRA: it has no adapters to "
                          "write; leave --lora out (the whole model is written).")
    _check_base(base)
    trainer_state = load_trainer_state(checkpoint)
    try:
        tokenizer = load_tokenizer(base, chat_template=(settings.get("data") or {}).get("chat_template"))
    except OSError as e:
        raise ConfigError(f"The base model {base}: its tokenizer cannot be loaded "
                          f"({str(e).strip().splitlines()[0]}).") from None
    policy = load_causal_lm(base, tokenizer, dtype=model.get("dtype") or "float32")
    if adapters:
        targets = lora_settings.get("target_modules", "all-linear")
        policy = add_lora(policy, r=lora_settings["r"], alpha=lora_settings.get("alpha", 16.0),
                          dropout=lora_settings.get("dropout", 0.0), target_modules=targets)
    path = export_policy(checkpoint, out_dir, policy=policy, tokenizer=tokenizer, lora=lora)
    return Exported(path=path, checkpoint=checkpoint, iteration=trainer_state.get("iteration"),
                    source=_written_by(settings, trainer_state), lora=lora if adapters else None,
                    base=base, left_out=_left_out(checkpoint))


def main(argv: list[str] | None = None) -> Exported:
    """``rlhf-torchrl export SOURCE OUT_DIR [--lora merge|adapters] [--base MODEL]``: export and
    say what was read, what was written and what was left out.

    Args:
        argv: the command-line arguments (None: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="rlhf-torchrl export",
        description="Write a checkpoint's policy as a Hugging Face model directory (config.json, "
                    "model.safetensors, tokenizer) that transformers and vLLM load: from one "
                    "process, DDP or FSDP2 (shards consolidated here, no torchrun), LoRA merged or "
                    "as adapters. The value head and the optimiser are not exported.")
    parser.add_argument("source", help="a checkpoint (<run>/checkpoints/iter_<N>) or a run's "
                                       "output_dir (its newest checkpoint)")
    parser.add_argument("out_dir", help="a new or empty folder")
    parser.add_argument("--lora", choices=LORA_MODES, default="merge",
                        help="a LoRA run's adapters: merged into the base weights (default), or "
                             "a PEFT adapter directory for peft.PeftModel.from_pretrained")
    parser.add_argument("--base", default=None,
                        help="the base model (a directory or hub id) in place of the run's "
                             "model.policy, e.g. when it lives elsewhere on this machine")
    args = parser.parse_args(argv)
    exported = export_checkpoint(args.source, args.out_dir, lora=args.lora, base=args.base)
    newest = "" if os.path.samefile(args.source, exported.checkpoint) else (
        f", the newest checkpoint of {args.source}")
    how = {None: "", "merge": "; LoRA adapters merged into the base weights",
           "adapters": "; LoRA adapters as a PEFT adapter directory"}[exported.lora]
    loads = (f"peft.PeftModel.from_pretrained on the base model {exported.base} loads it"
             if exported.lora == "adapters" else
             "transformers.AutoModelForCausalLM.from_pretrained and vLLM load it")
    print(f"Exported {exported.checkpoint} (iteration {exported.iteration}{newest}; "
          f"{exported.source}{how}) to {exported.path}: {', '.join(exported.files)} ({loads}). "
          f"Not exported: {', '.join(exported.left_out)}.", flush=True)
    return exported
