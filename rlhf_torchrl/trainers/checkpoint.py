"""Checkpoints a crash cannot break, and the state an exact resume needs.

A checkpoint is the directory ``<output_dir>/checkpoints/iter_<N>`` (N: iterations done) with

- ``weights/``: the trainable parameters of the given modules and the optimiser's state, written by
  ``torch.distributed.checkpoint`` (under FSDP2 each process writes its own shards; replicated
  tensors are written once). Frozen weights (a LoRA base model, the reference) are not saved: a
  resumed run loads them from where the first run did;
- ``trainer.pt``: the rest of the trainer's state (scheduler, KL coefficient, RNG states, data
  position, hooks' state, the reward transform's statistics, ...): plain containers, tensors and numbers;
- ``rollouts/rank_<k>/<i>/``: the rollouts process ``k`` had sampled ahead (asynchronous
  collection), in TensorDict's own format (memory-mapped tensors, JSON for the texts);
- ``rng/rank_<k>.pt``: process ``k``'s random states (each process draws its own numbers);
- ``lineage.json``: the runs whose iterations the checkpoint continues (see below);
- ``config.yaml``: the run's resolved config;
- ``manifest.json``: every file's size, so that a file a bad disk tore is found before it is read.

A checkpoint is data: reading one runs none of its code. The pickles (``.pt`` files, the weights'
``.metadata`` and their non-tensor entries) are read by :mod:`rlhf_torchrl.safe_loading`'s
restricted readers, the rollouts with ``allow_pickle=False``, the rest as JSON and YAML. A file
that names code is refused with one line naming it
(:class:`~rlhf_torchrl.safe_loading.UnsafeFileError`); :func:`verify_checkpoint` reads the
trainer state, the random states and the weights' metadata, so a resume refuses a planted one
before any model loads.

It is written as ``checkpoints/.tmp-iter_<N>``, every file flushed to disk (``fsync``), then renamed:
the rename is atomic, so a directory named ``iter_<N>`` is complete, and a crash mid-write leaves the
previous checkpoints as they were. An ``iter_<N>`` already there is first renamed away, never
deleted before the new one is complete.

A run resumed from an older checkpoint starts a new lineage: the checkpoints after its starting
point (the future it abandons) belong to another. Its first write moves them, and any other
checkpoint not of its lineage, to ``checkpoints/abandoned/<time>/`` (kept for you to resume from or
delete), so that ``resume=auto`` finds this run's newest. Pruning keeps the newest ``keep`` of the
lineage, the checkpoint just written always among them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rlhf_torchrl.errors import ConfigError, DiskFullError, MissingFileError
from rlhf_torchrl.safe_loading import (
    UnsafeFileError,
    load_dcp,
    load_torch_data,
    read_dcp_metadata,
    refuse_tensordict_pickles,
)

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^iter_(\d+)$")
_TRAINER = "trainer.pt"
WEIGHTS = "weights"
_ROLLOUTS = "rollouts"
_MANIFEST = "manifest.json"
_RNG = "rng"
_LINEAGE = "lineage.json"
#: where checkpoints of another lineage go (a resumed run's abandoned future)
ABANDONED = "abandoned"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read (a torn or missing file); the message names it."""


def rng_state() -> dict:
    """The global random states: Python's, NumPy's (when installed), torch's CPU and CUDA ones."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, key, pos, has_gauss, gauss = np.random.get_state()
        # plain numbers, not an array: trainer.pt loads with weights_only=True
        state["numpy"] = (kind, key.tolist(), pos, has_gauss, gauss)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping) -> None:
    """Restore the global random states :func:`rng_state` took (CUDA's where CUDA is available).

    Args:
        state: :func:`rng_state`'s dict.
    """
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(iterations done, path) of the complete checkpoints in ``output_dir``, oldest first.

    Args:
        output_dir: the run's directory.
    """
    root = os.path.join(output_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match and is_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint directory (its trainer state and weights'
    metadata written).

    Args:
        path: a directory.
    """
    return (os.path.isfile(os.path.join(path, _TRAINER))
            and os.path.isfile(os.path.join(path, WEIGHTS, ".metadata")))


def latest_checkpoint(output_dir: str, verify: bool = False) -> str | None:
    """The newest complete checkpoint of ``output_dir`` (None: none). With ``verify``, the newest
    that :func:`verify_checkpoint` accepts: a torn one is named in a warning and skipped; when
    none can be read, :class:`CheckpointError` (a run never starts over silently). One holding
    code is not skipped: :class:`~rlhf_torchrl.safe_loading.UnsafeFileError` stops the run.

    Args:
        output_dir: the run's directory.
        verify: skip torn checkpoints (:func:`verify_checkpoint`).
    """
    found = list_checkpoints(output_dir)
    if not verify:
        return found[-1][1] if found else None
    for _, path in reversed(found):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as error:
            log.warning("%s; resuming from the checkpoint before it.", error)
    if found:
        raise CheckpointError(
            f"No checkpoint in {output_dir} can be read (torn, or written by another version of "
            "rlhf_torchrl): resume=never starts over, deleting them.")
    return None


def verify_checkpoint(path: str) -> None:
    """Raise :class:`CheckpointError` naming the first file of checkpoint ``path`` that is missing,
    of another size than when it was written, or unreadable (``config.yaml``, ``trainer.pt``, the
    weights' metadata, the random states), and
    :class:`~rlhf_torchrl.safe_loading.UnsafeFileError` naming one that would run code (read
    through the restricted readers, so nothing in it runs).

    Args:
        path: the checkpoint directory.
    """
    manifest = os.path.join(path, _MANIFEST)
    try:
        if os.path.exists(manifest):  # (checkpoints of earlier versions have none)
            with open(manifest, encoding="utf-8") as f:
                sizes = json.load(f)
            for name, size in sizes.items():
                file = os.path.join(path, name)
                if not os.path.isfile(file):
                    raise CheckpointError(f"Checkpoint {path} is torn: {name} is missing")
                if os.path.getsize(file) != size:
                    raise CheckpointError(f"Checkpoint {path} is torn: {name} has "
                                          f"{os.path.getsize(file)} bytes, {size} when written")
        from omegaconf import OmegaConf

        config = os.path.join(path, "config.yaml")
        if os.path.exists(config):
            OmegaConf.load(config)
        load_trainer_state(path)
        read_dcp_metadata(os.path.join(path, WEIGHTS))
        rng = os.path.join(path, _RNG)
        for name in sorted(os.listdir(rng)) if os.path.isdir(rng) else ():
            load_torch_data(os.path.join(rng, name))
        refuse_tensordict_pickles(os.path.join(path, _ROLLOUTS))
    except (CheckpointError, UnsafeFileError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever a torn file makes the readers raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"Checkpoint {path} is unreadable ({type(e).__name__}: {first})") from e


def load_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint ``path`` (``weights_only``: no code runs).

    Args:
        path: the checkpoint directory.
    """
    return load_torch_data(os.path.join(path, _TRAINER))


def _state_dicts(modules: Mapping[str, nn.Module], optimizer):
    """(model, optimiser) state dicts of the trainable parameters: frozen ones are left out (the
    DCP option misses a frozen weight tied to another, e.g. an LM head under LoRA)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    container = nn.ModuleDict(dict(modules))
    model_state, optim_state = get_state_dict(container, optimizer,
                                              options=StateDictOptions(ignore_frozen_params=True))
    trainable = {name for name, p in container.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trainable}, optim_state


def save_checkpoint(output_dir: str, iteration: int, *, modules: Mapping[str, nn.Module], optimizer,
                    trainer_state: dict, config_yaml: str, keep: int | None = None,
                    parallel=None, rollouts: Sequence = (), rng: Mapping | None = None,
                    lineage: Sequence | None = None, weights_only: bool = False) -> str:
    """Write checkpoint ``iter_<iteration>`` atomically and drop all but the last ``keep`` of its
    lineage.

    Under ``torchrun`` every process calls this (the weights are a collective write) with its own
    rollouts and random states; the trainer state and the config are written by the main process.
    Checkpoints of another lineage (``iter_<iteration>`` already there included) are moved to
    ``checkpoints/abandoned/``. Returns the checkpoint's path.

    Args:
        output_dir: the run's directory; the checkpoint goes to
            ``<output_dir>/checkpoints/iter_<iteration>``.
        iteration: the iterations done.
        modules: the trained modules by name (their trainable parameters are saved).
        optimizer (torch.optim.Optimizer): holds exactly their parameters.
        trainer_state: the trainer's :meth:`~rlhf_torchrl.trainers.ppo.PPOTrainer.state_dict`.
        config_yaml: the run's config, written as ``config.yaml``.
        keep: how many checkpoints of the lineage to keep, this one included (None: all).
        parallel (rlhf_torchrl.distributed.DataParallel | None): this process's place in a
            torchrun job (None: one process).
        rollouts: this process's TensorDicts sampled ahead (each process's rows differ).
        rng: this process's random states (:func:`rng_state`; None: not saved).
        lineage: ``[run, resumed_at]`` pairs, oldest first, the last this run's
            (:func:`in_lineage`); None: the checkpoints below ``iteration`` are its lineage.
        weights_only: leave the optimiser's state out (a third of the size in fp32; a run
            resumed from it starts AdamW's moments afresh, :func:`load_checkpoint`).
    """
    name = f"iter_{iteration:08d}"
    try:
        return _save(output_dir, iteration, modules=modules, optimizer=optimizer,
                     trainer_state=trainer_state, config_yaml=config_yaml, keep=keep,
                     parallel=parallel, rollouts=rollouts, rng=rng, lineage=lineage,
                     weights_only=weights_only)
    except BaseException as error:  # (DCP's CheckpointException is a BaseException)
        root = os.path.join(output_dir, CHECKPOINTS)
        if isinstance(error, KeyboardInterrupt | SystemExit) or not disk_full(error, root):
            raise
        if parallel is None or parallel.is_main:  # the room the partial write took, back
            shutil.rmtree(os.path.join(root, f".tmp-{name}"), ignore_errors=True)
        before = [os.path.basename(path) for _, path in list_checkpoints(output_dir)]
        raise DiskFullError(
            f"The disk of {root} filled while checkpoint {name} was written ({_cause(error)}): its "
            f"partial files are removed; the checkpoints before it are whole "
            f"({', '.join(before) if before else 'none yet'}). Make room (or write less: "
            "checkpoint.keep=1, checkpoint.weights_only=true), then run the same command again: "
            "resume=auto continues from the newest checkpoint.") from error


def _save(output_dir: str, iteration: int, *, modules: Mapping[str, nn.Module], optimizer,
          trainer_state: dict, config_yaml: str, keep: int | None = None,
          parallel=None, rollouts: Sequence = (), rng: Mapping | None = None,
          lineage: Sequence | None = None, weights_only: bool = False) -> str:
    """:func:`save_checkpoint` itself: its files into ``.tmp-iter_<N>``, renamed when whole."""
    import torch.distributed.checkpoint as dcp

    is_main = parallel is None or parallel.is_main
    root = os.path.join(output_dir, CHECKPOINTS)
    name = f"iter_{iteration:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a write that a crash cut short
        os.makedirs(tmp)
    _barrier(parallel)
    model_state, optim_state = _state_dicts(modules, optimizer)
    state = {"model": model_state} if weights_only else {"model": model_state, "optim": optim_state}
    with single_process_quiet():
        dcp.save(state, checkpoint_id=os.path.join(tmp, WEIGHTS))
    rank = parallel.rank if parallel is not None else 0
    for i, rollout in enumerate(rollouts):
        rollout.detach().cpu().save(os.path.join(tmp, _ROLLOUTS, f"rank_{rank}", f"{i:04d}"))
    if rng is not None:
        os.makedirs(os.path.join(tmp, _RNG), exist_ok=True)
        torch.save(dict(rng), os.path.join(tmp, _RNG, f"rank_{rank}.pt"))
    _barrier(parallel)
    if is_main:
        torch.save(trainer_state, os.path.join(tmp, _TRAINER))
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(config_yaml)
        if lineage is not None:
            with open(os.path.join(tmp, _LINEAGE), "w", encoding="utf-8") as f:
                json.dump({"lineage": [list(segment) for segment in lineage]}, f)
        _write_manifest(tmp)
        _fsync_tree(tmp)
        ours, others = _split_by_lineage(output_dir, iteration, lineage)
        if others or os.path.exists(final):
            _set_aside(root, others, final, iteration)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep:
            for _, old in ours[:max(0, len(ours) - (keep - 1))]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(parallel)
    return final


#: free bytes below which a failed write is taken for a full disk (the writers' own errors do not
#: always say so: torch.save's is "unexpected pos 704 vs 598")
_FULL = 1 << 20


def disk_full(error: BaseException, path: str) -> bool:
    """Whether ``error`` is a write that failed for want of room on ``path``'s disk: ENOSPC or
    EDQUOT anywhere in its chain (DCP's per-rank failures included), or under 1 MiB left."""
    import errno

    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend((e.__cause__, e.__context__))
    try:
        return shutil.disk_usage(path).free < _FULL
    except OSError:
        return False


def _cause(error: BaseException) -> str:
    """The failed write in a few words: the OSError's own text where there is one."""
    return (os.strerror(error.errno) if isinstance(error, OSError) and error.errno
            else "No space left on device")


def in_lineage(lineage: Sequence, iteration: int, writer: str | None) -> bool:
    """Whether the checkpoint of ``iteration`` that run ``writer`` wrote is in ``lineage``.

    A lineage is the list of ``[run, resumed_at]`` of the runs behind a checkpoint, oldest first:
    run ``r`` resumed at iteration ``a`` wrote the iterations after ``a`` up to the next run's
    ``resumed_at``. Iteration ``n`` is the lineage's when its writer is the last run with
    ``resumed_at < n`` (None, a checkpoint that records no lineage: where no run of the lineage
    is known to have written it).

    Args:
        lineage: ``[run, resumed_at]`` pairs, oldest first.
        iteration: the checkpoint's iterations done.
        writer: the run that wrote it (None: not recorded).

    Example:
        >>> lineage = [["a", 0], ["b", 2]]  # run b resumed a's checkpoint 2
        >>> in_lineage(lineage, 2, "a"), in_lineage(lineage, 3, "a"), in_lineage(lineage, 3, "b")
        (True, False, True)
    """
    owner = None
    for run, resumed_at in lineage:
        if resumed_at < iteration:
            owner = run
    return owner == writer


def read_lineage(path: str) -> list | None:
    """The lineage checkpoint ``path`` records (None: none, a checkpoint of an earlier version).

    Args:
        path: the checkpoint directory.
    """
    try:
        with open(os.path.join(path, _LINEAGE), encoding="utf-8") as f:
            return json.load(f)["lineage"]
    except (OSError, ValueError, KeyError):
        return None


def _split_by_lineage(output_dir: str, iteration: int, lineage: Sequence | None):
    """The complete checkpoints of ``output_dir`` other than ``iteration``'s: (those of
    ``lineage``, the others), oldest first. Without a lineage, the lower iterations are its."""
    ours, others = [], []
    for n, path in list_checkpoints(output_dir):
        if n == iteration:
            continue
        if lineage is None:
            mine = n < iteration
        else:
            recorded = read_lineage(path)
            mine = in_lineage(lineage, n, recorded[-1][0] if recorded else None)
        (ours if mine else others).append((n, path))
    return ours, others


def _set_aside(root: str, others: list, final: str, iteration: int) -> None:
    """Move the checkpoints of another lineage, and ``final`` (the iteration about to be
    written), to ``<root>/abandoned/<time>/``: renames, so nothing is lost."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, i = os.path.join(root, ABANDONED, stamp), 1
    while os.path.exists(dest):
        dest, i = os.path.join(root, ABANDONED, f"{stamp}-{i}"), i + 1
    os.makedirs(dest)
    moved = [path for _, path in others]
    if os.path.exists(final):
        moved.append(final)
    for path in moved:
        os.replace(path, os.path.join(dest, os.path.basename(path)))
    _fsync_dir(dest)
    _fsync_dir(root)
    log.warning("Checkpoint %d: %s of another lineage (the future a resumed run abandons) moved to "
                "%s: resume=<path> continues one, deleting the folder frees the space.", iteration,
                ", ".join(os.path.basename(p) for p in sorted(moved)), dest)


def load_rng_state(path: str, rank: int = 0) -> dict | None:
    """The random states process ``rank`` saved with checkpoint ``path`` (None: none saved, a
    checkpoint of an earlier version or of fewer processes).

    Args:
        path: the checkpoint directory.
        rank: the process whose states to read.
    """
    file = os.path.join(path, _RNG, f"rank_{rank}.pt")
    return load_torch_data(file) if os.path.isfile(file) else None


def load_checkpoint(path: str, *, modules: Mapping[str, nn.Module], optimizer) -> dict:
    """Load the weights and optimiser state of checkpoint ``path`` into ``modules`` and
    ``optimizer`` (in place, each process its shards) and return its trainer state.

    Args:
        path: the checkpoint directory.
        modules: the trained modules by name, as saved.
        optimizer (torch.optim.Optimizer): over exactly their parameters.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    if not is_checkpoint(path):
        raise MissingFileError(f"{path} is not a checkpoint (no {_TRAINER} and {WEIGHTS}/): give "
                                "a checkpoints/iter_<N> directory of a run.")
    verify_checkpoint(path)
    with_optimizer = _holds_optimizer(os.path.join(path, WEIGHTS))
    model_state, optim_state = _state_dicts(modules, optimizer)
    state = {"model": model_state, "optim": optim_state} if with_optimizer else {"model": model_state}
    try:
        with single_process_quiet():
            load_dcp(state, os.path.join(path, WEIGHTS))
    except UnsafeFileError:
        raise
    # (DCP gathers each process's error in a CheckpointException, a BaseException)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a torn weights file
        raise CheckpointError(f"Checkpoint {path} is unreadable: its weights could not be loaded "
                              f"({type(e).__name__}). Resume from an earlier one "
                              f"(resume=<output_dir>/{CHECKPOINTS}/iter_<N>).") from e
    if with_optimizer:
        set_state_dict(nn.ModuleDict(dict(modules)), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=False))
    else:
        set_model_state_dict(nn.ModuleDict(dict(modules)), state["model"],
                             options=StateDictOptions(strict=False))
        log.warning("Checkpoint %s holds the weights alone (checkpoint.weights_only): AdamW's "
                    "moments start afresh, so the run goes on as a new optimiser would, not as "
                    "the uninterrupted run.", path)
    return load_trainer_state(path)


def _holds_optimizer(weights: str) -> bool:
    """Whether a checkpoint's ``weights/`` holds the optimiser's state (not one written with
    ``weights_only``), from its metadata; True where that cannot be read (the load then names
    the torn file)."""
    try:
        keys = read_dcp_metadata(weights).state_dict_metadata
    except (OSError, UnsafeFileError, EOFError, ValueError):
        return True
    return any(key.startswith("optim.") for key in keys)


def load_rollouts(path: str, rank: int = 0, device=None) -> list:
    """The rollouts process ``rank`` saved with checkpoint ``path`` (in order), on ``device``.

    Args:
        path: the checkpoint directory.
        rank: the process whose rollouts to read.
        device (torch.device | str | None): where they are placed (None: the CPU).
    """
    from tensordict import TensorDict

    folder = os.path.join(path, _ROLLOUTS, f"rank_{rank}")
    if not os.path.isdir(folder):
        return []
    refuse_tensordict_pickles(folder)  # (to name the file: allow_pickle=False refuses it too)
    # clone(): plain tensors, not memory maps of the checkpoint's files
    # allow_pickle=False: no code runs, whatever the folder holds
    return [TensorDict.load(os.path.join(folder, name), allow_pickle=False).clone().to(device or "cpu")
            for name in sorted(os.listdir(folder))]


@contextmanager
def single_process_quiet():
    """DCP warns that it runs in one process when no process group exists: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(parallel) -> None:
    if parallel is not None:
        parallel.barrier()


def _write_manifest(path: str) -> None:
    sizes = {}
    for folder, _, files in os.walk(path):
        for name in files:
            file = os.path.join(folder, name)
            sizes[os.path.relpath(file, path)] = os.path.getsize(file)
    with open(os.path.join(path, _MANIFEST), "w", encoding="utf-8") as f:
        json.dump(sizes, f, indent=0, sort_keys=True)


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
