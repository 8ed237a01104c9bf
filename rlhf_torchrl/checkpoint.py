"""Checkpoints a crash cannot break, and the state an exact resume needs.

A checkpoint is the directory ``<output_dir>/checkpoints/iter_<N>`` (N: iterations done) with

- ``weights/``: the trainable parameters of the given modules and the optimiser's state, written by
  ``torch.distributed.checkpoint`` (under FSDP2 each process writes its own shards; replicated
  tensors are written once). Frozen weights (a LoRA base model, the reference) are not saved: a
  resumed run loads them from where the first run did;
- ``trainer.pt``: the rest of the trainer's state (scheduler, KL coefficient, RNG states, data
  position, rollouts already sampled ahead, ...), a plain ``torch.save`` of a dict;
- ``config.yaml``: the run's resolved config.

It is written as ``checkpoints/.tmp-iter_<N>``, every file flushed to disk (``fsync``), then renamed:
the rename is atomic, so a directory named ``iter_<N>`` is complete, and a crash mid-write leaves the
previous checkpoints as they were. Only the last ``keep`` are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^iter_(\d+)$")
_TRAINER = "trainer.pt"
_WEIGHTS = "weights"


def rng_state() -> dict:
    """The global random states: Python's, NumPy's (when installed), torch's CPU and CUDA ones."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(iterations done, path) of the complete checkpoints in ``output_dir``, oldest first."""
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
    return (os.path.isfile(os.path.join(path, _TRAINER))
            and os.path.isfile(os.path.join(path, _WEIGHTS, ".metadata")))


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


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
                    parallel=None) -> str:
    """Write checkpoint ``iter_<iteration>`` atomically and drop all but the last ``keep``.

    ``modules`` name the trained modules (their trainable parameters are saved); ``optimizer``
    holds exactly their parameters. Under ``torchrun`` every process calls this (the weights are a
    collective write); ``trainer_state`` and the config are written by the main process.
    Returns the checkpoint's path.
    """
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
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=os.path.join(tmp, _WEIGHTS))
    _barrier(parallel)
    if is_main:
        torch.save(trainer_state, os.path.join(tmp, _TRAINER))
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(config_yaml)
        _fsync_tree(tmp)
        if os.path.exists(final):  # the same iteration written again (a resumed run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep:
            for _, old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(parallel)
    return final


def load_checkpoint(path: str, *, modules: Mapping[str, nn.Module], optimizer) -> dict:
    """Load the weights and optimiser state of checkpoint ``path`` into ``modules`` and
    ``optimizer`` (in place, each process its shards) and return its trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a checkpoint (no {_TRAINER} and {_WEIGHTS}/): give "
                                "a checkpoints/iter_<N> directory of a run.")
    model_state, optim_state = _state_dicts(modules, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=os.path.join(path, _WEIGHTS))
    set_state_dict(nn.ModuleDict(dict(modules)), optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=False))
    return torch.load(os.path.join(path, _TRAINER), weights_only=False)


@contextmanager
def _single_process_quiet():
    """DCP warns that it runs in one process when no process group exists: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(parallel) -> None:
    if parallel is not None:
        parallel.barrier()


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
