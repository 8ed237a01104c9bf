"""Readers of files a run did not just write (checkpoints, saved models): data only, never code.

A checkpoint or a model folder may come from shared storage or another user, so reading it must
not run code, and ``pickle`` runs whatever callable a file names. What reads pickles:

- ``torch.distributed.checkpoint`` (DCP) reads ``weights/.metadata`` with plain ``pickle``, and
  a state dict's non-tensor entries (the optimiser's ``lr``, ``betas``, ...) with
  ``torch.load(weights_only=False)``: :func:`load_dcp` and :func:`read_dcp_metadata` read the
  metadata with ``_DCPMetadataUnpickler`` (only the classes DCP's ``Metadata`` holds) and
  those entries with ``weights_only=True``;
- ``.pt`` files: :func:`load_torch_data`, ``torch.load(weights_only=True)`` (containers, numbers,
  strings and tensors only);
- a model folder's ``pytorch_model.bin``: transformers (>= 4.56) reads it with
  ``torch.load(weights_only=True)`` and prefers ``model.safetensors`` (no pickle) when both are
  there; :func:`refusing_code` turns its refusal into one line naming the file.

A file that would run code is refused with :class:`UnsafeFileError`, one line naming it, and
nothing in it runs.
"""

from __future__ import annotations

import glob
import io
import os
import pickle
import re
from contextlib import contextmanager

import torch

from rlhf_torchrl.errors import ConfigError


class UnsafeFileError(ConfigError):
    """A file that names code to run when read (a pickled callable that is not data): refused
    before any of it ran; the message names the file."""


def _refusal(file: str, detail: str) -> UnsafeFileError:
    return UnsafeFileError(f"{file} is not plain data ({detail}): refused, nothing in it ran. "
                           "It was planted, or another program wrote it: load checkpoints and "
                           "models only from sources you trust.")


def _calls(name: str) -> str:
    return f"unpickling it would call {name}"


def _weights_only_reason(error: pickle.UnpicklingError) -> str | None:
    """What ``torch.load(weights_only=True)`` refused (``posix.system``), None for an error that
    is not a refusal (a file cut short)."""
    text = str(error)
    if "Weights only load failed" not in text:
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    return found.group(1) if found else "an object weights_only does not allow"


def load_torch_data(file: str | io.BytesIO, name: str | None = None, **kwargs):
    """``torch.load(file, weights_only=True)``: containers, numbers, strings and tensors; a file
    naming anything else is refused (:class:`UnsafeFileError`) before it runs.

    Args:
        file: a file ``torch.save`` wrote, or its bytes.
        name: what the error calls it (None: ``file``).
        **kwargs: passed to :func:`torch.load` (``map_location``).
    """
    try:
        return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        reason = _weights_only_reason(e)
        if reason is None:
            raise
        raise _refusal(name or str(file), _calls(reason)) from None


#: the globals a ``.metadata`` file that DCP wrote names (read from the checkpoints torch 2.13
#: writes in one process, under DDP and under FSDP2): its dataclasses, ``torch.Size``, the layout
#: and memory-format encodings and the checkpoint's path (``StorageMeta.checkpoint_id``;
#: ``pathlib._local`` on Python 3.13); dtypes too (:data:`TORCH_DTYPES`). Each only builds a value.
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
})


#: ``torch.float32`` and the other dtypes by name (the module's own attributes: looking a name up
#: with ``getattr`` could import a submodule)
TORCH_DTYPES = {name: value for name, value in vars(torch).items()
                if isinstance(value, torch.dtype)}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's ``Metadata`` and nothing else: a global neither in
    :data:`DCP_METADATA_GLOBALS` nor a dtype is refused before it is called.

    Args:
        file: the open ``.metadata`` file.
        name: its path, for the error.
    """

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise _refusal(self.name, _calls(f"{module}.{name}"))

    def persistent_load(self, pid):
        raise _refusal(self.name, "it names a persistent id, which DCP's metadata never holds")


def read_dcp_metadata(folder: str, rank: int | None = None):
    """The ``Metadata`` of the DCP checkpoint in ``folder``, read with
    ``_DCPMetadataUnpickler``.

    Args:
        folder: what ``dcp.save`` wrote (a checkpoint's ``weights/``).
        rank: read ``__<rank>.metadata`` (DCP without a coordinator); None: ``.metadata``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(folder, ".metadata" if rank is None else f"__{rank}.metadata")
    with open(file, "rb") as f:
        metadata = _DCPMetadataUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise _refusal(file, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _safe_reader(folder: str):
    """A ``FileSystemReader`` of ``folder`` whose metadata comes from :func:`read_dcp_metadata`
    (DCP's own reads it with plain pickle). A refusal is kept in ``refused``: DCP takes any error
    of the global metadata as "absent" and tries each process's own, then raises its own error."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        refused: UnsafeFileError | None = None

        def read_metadata(self, *args, **kwargs):
            try:
                metadata = read_dcp_metadata(str(self.path), kwargs.get("rank"))
            except UnsafeFileError as e:
                self.refused = self.refused or e
                raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # (what DCP's own reader does)
            return metadata

    return Reader(folder)


def _safe_planner(folder: str):
    """DCP's default load planner, reading the state dict's non-tensor entries with
    ``weights_only=True`` (DCP's own uses ``weights_only=False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            file = os.path.join(folder, self.metadata.storage_data[read_item.storage_index]
                                .relative_path)
            data = load_torch_data(value, f"{file} ({read_item.dest_index.fqn})")
            if self.flatten_state_dict:
                # (where DefaultLoadPlanner.load_bytes takes it from)
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            data)
            else:
                self.state_dict[read_item.dest_index.fqn] = data

    return Planner()


def load_dcp(state: dict, folder: str) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` (in place, each process its shards) reading
    data only: the metadata through ``_DCPMetadataUnpickler``, non-tensor entries with
    ``weights_only=True``. A file naming code raises :class:`UnsafeFileError`, whichever process
    read it.

    Args:
        state: the state dict to fill, as saved.
        folder: what ``dcp.save`` wrote.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _safe_reader(folder)
    try:
        dcp.load(state, storage_reader=reader, planner=_safe_planner(folder))
    except CheckpointException as e:  # DCP gathers each process's error into one
        if reader.refused is not None:
            raise reader.refused from None
        for error, _ in e.failures.values():
            if isinstance(error, UnsafeFileError):
                raise error from None
        raise


#: the files TensorDict pickles a non-tensor entry that JSON cannot hold to (tensordict 0.14)
TENSORDICT_PICKLES = ("other.pickle", "pickle.pkl")


def refuse_tensordict_pickles(folder: str) -> None:
    """Refuse the first pickle TensorDict would read under ``folder``: the rollouts this library
    saves hold JSON (and are read with ``allow_pickle=False``, so a planted pickle never loads;
    this names it).

    Args:
        folder: where ``TensorDict.save`` wrote (a checkpoint's ``rollouts/``).
    """
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            if name in TENSORDICT_PICKLES:
                raise _refusal(os.path.join(root, name), "a pickle, where saved rollouts hold JSON")


@contextmanager
def refusing_code(path: str):
    """Turn transformers' refusal of a ``pytorch_model.bin`` that names code (it loads with
    ``weights_only=True``) into :class:`UnsafeFileError` naming the file.

    Args:
        path: the model folder or hub name being loaded.
    """
    try:
        yield
    except pickle.UnpicklingError as e:
        reason = _weights_only_reason(e)
        if reason is None:
            raise
        raise _refusal(_first_refused(path) or path, _calls(reason)) from None


def _first_refused(path: str) -> str | None:
    """The first pickled weights file of model folder ``path`` that ``weights_only`` refuses."""
    if not os.path.isdir(path):
        return None
    for file in sorted(glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))):
        try:
            load_torch_data(file, map_location="meta")
        except UnsafeFileError:
            return file
        except Exception:  # noqa: BLE001 - another kind of failure: not the file refused
            continue
    return None
