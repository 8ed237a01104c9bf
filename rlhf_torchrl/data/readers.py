"""Prompt data read as the field stores it: one reader per form, the form told by ``data.source``.

============================  ===============================================  =======================
form                          ``data.source``                                  read by
============================  ===============================================  =======================
JSON lines                    ``prompts.jsonl``                                ``json``, line by line
JSON                          ``prompts.json``: an array of records            ``json``
Parquet                       ``train.parquet``, a folder of ``*.parquet``     ``datasets`` (Arrow)
                              shards, or a glob (``data/train-*.parquet``)
CSV, TSV                      ``prompts.csv``, ``prompts.tsv``                 ``datasets`` (Arrow)
a saved dataset               a folder ``Dataset.save_to_disk`` wrote          ``datasets.load_from_disk``
a hub dataset                 ``openai/gsm8k`` (``data.config``,               ``datasets.load_dataset``
                              ``data.split``), or a folder in its layout
built in                      ``polarity``, ``reasoning_gym:<task>``           their packages
============================  ===============================================  =======================

The JSON forms are read into memory (a line that is not JSON is named by its line). The Arrow
forms are memory-mapped from ``datasets``' cache (a local file is converted once, the next run
reuses it): a row becomes Python objects only when it is read, so a million-row Parquet costs
neither the time nor the memory of a million dicts. Every reader returns a :class:`Table`;
:mod:`rlhf_torchrl.data.prompt_sets` turns its rows into prompts.
"""

from __future__ import annotations

import glob
import json
import os
from array import array
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_torchrl.errors import ConfigError, MissingDependencyError, MissingFileError

#: Built-in offline prompt set: the 200 movie-review sentences gensim ships (Pang & Lee polarity).
POLARITY = "polarity"
#: Prefix of a reasoning-gym task source: ``"reasoning_gym:basic_arithmetic"``.
REASONING_GYM = "reasoning_gym:"
#: What ``data.source`` may name, for the message that refuses anything else.
FORMS = ("a .jsonl file, a .json file (an array of records), a .parquet file (or a folder or glob of "
         ".parquet shards), a .csv or .tsv file, a folder written by datasets' save_to_disk, a hub "
         "dataset name, 'polarity' or reasoning_gym:<task>")
_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}


@dataclass(frozen=True)
class Where:
    """Names row ``i`` of a source in messages: ``prompts.jsonl:12`` (a file line, ``lines[i]``)
    or ``train.parquet[11]``.

    Args:
        name: the source's name (a file name, a hub name).
        lines: each row's line in the file (None: rows are named by index).
    """

    name: str
    lines: array | None = None

    def __call__(self, i: int) -> str:
        return f"{self.name}:{self.lines[i]}" if self.lines is not None else f"{self.name}[{i}]"


@dataclass(frozen=True)
class Table:
    """The rows of one source: ``rows[i]`` is row ``i``, a dict of its columns.

    Args:
        rows: a ``datasets.Dataset`` (memory-mapped Arrow, decoded one row at a time when read) or
            a list of dicts (the JSON forms and the built-in sets, in memory).
        columns: the Arrow schema's columns, or the first row's fields.
        name: the source, as given.
        form: its form (:func:`source_form`).
        where: ``where(i)`` names row ``i`` in messages.
    """

    rows: Sequence[dict]
    columns: tuple[str, ...]
    name: str
    form: str
    where: Where

    @property
    def arrow(self):
        """The Arrow table behind ``rows`` (None for rows in memory)."""
        return getattr(self.rows, "data", None)


def source_form(source: str) -> str:
    """The form ``source`` is in: ``jsonl``, ``json``, ``parquet``, ``csv``, ``tsv``, ``saved``
    (a save_to_disk folder), ``folder`` (a folder ``load_dataset`` reads) or ``hub``.

    A file of another kind is refused, naming the forms accepted; a missing file whose suffix names
    a form is a missing file, not a hub name.

    Args:
        source: a path or a hub name.
    """
    if any(c in source for c in "*?["):
        return "parquet"  # a glob of shards (checked by the reader)
    path = Path(source)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "saved"
        return "parquet" if any(path.glob("*.parquet")) else "folder"
    form = _SUFFIXES.get(path.suffix.lower())
    if path.is_file() and form is None:
        raise ConfigError(f"data.source={source}: a {path.suffix or 'suffix-less'} file is not a "
                          f"form read here. Give {FORMS}.")
    if form is not None and not path.exists():
        raise MissingFileError(f"Prompt file {source!r} does not exist.")
    return form or "hub"


def read_table(source: str, *, split: str = "train", config: str | None = None,
               limit: int | None = None, generator_args: dict | None = None,
               seed: int = 0) -> Table:
    """The rows of ``source`` in whichever form it is (:func:`source_form`).

    Args:
        source: a path, a hub name, ``polarity`` or ``reasoning_gym:<task>``.
        split: a hub dataset's split, or one of a saved DatasetDict's.
        config: a hub dataset's configuration name.
        limit: how many rows ``reasoning_gym:<task>`` generates (None: 1000).
        generator_args: the reasoning-gym task's settings.
        seed: the seed reasoning-gym's rows are generated from.
    """
    if source == POLARITY:
        sentences = [text for _, text in polarity_sentences()]
        return _in_memory([{"prompt": text} for text in sentences], POLARITY, "polarity")
    if source.startswith(REASONING_GYM):
        return _reasoning_gym_table(source[len(REASONING_GYM):], limit or 1000, seed,
                                    generator_args or {})
    form = source_form(source)
    if form == "jsonl":
        rows, lines = read_json_lines(source)
        return _in_memory(rows, source, form, lines)
    if form == "json":
        return _read_json(source)
    with _quiet_datasets() as datasets:
        if form == "parquet":
            files = _parquet_files(source)
            ds = _load(datasets, source, "parquet", data_files=files, split="train")
        elif form in ("csv", "tsv"):
            if os.path.getsize(source) == 0:
                raise ConfigError(f"The prompt file {source} is empty: point data.source at prompts.")
            ds = _load(datasets, source, "csv", data_files=source, split="train",
                       sep="\t" if form == "tsv" else ",")
        elif form == "saved":
            ds = datasets.load_from_disk(source)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"data.source={source} holds the splits {sorted(ds)}, not "
                                      f"data.split={split!r}.")
                ds = ds[split]
        else:  # a hub name, or a folder in the hub's layout (the same builder)
            ds = datasets.load_dataset(source, config, split=split)
    if len(ds) == 0:
        raise ConfigError(f"The prompt set {source!r} is empty: point data.source at prompts.")
    return Table(ds, tuple(ds.column_names), source, form, Where(source))


def _load(datasets, source: str, builder: str, **kwargs):
    """``datasets.load_dataset(builder, ...)``; a file it cannot read is one line naming it."""
    try:
        return datasets.load_dataset(builder, **kwargs)
    except Exception as e:  # the builders raise many kinds: pandas', pyarrow's, their own
        cause = e.__cause__ or e
        if "EmptyDataError" in type(cause).__name__ or "corresponds to no data" in str(e):
            raise ConfigError(f"The prompt file {source} is empty: point data.source at prompts.") from None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise ConfigError(f"data.source={source}: not readable as {builder.upper()} "
                          f"({type(cause).__name__}: {first}).") from None


def _parquet_files(source: str) -> list[str]:
    """The Parquet files ``source`` names (a file, a folder of shards, a glob), each checked from
    its footer (a file that is no Parquet, or no rows in all): one line, before any conversion."""
    import pyarrow.parquet as pq

    if os.path.isdir(source):
        files = sorted(str(p) for p in Path(source).glob("*.parquet"))
    elif any(c in source for c in "*?["):
        files = sorted(glob.glob(source))
        if not files:
            raise MissingFileError(f"data.source={source}: no file matches this pattern.")
        others = [f for f in files if not f.endswith(".parquet")]
        if others:
            raise ConfigError(f"data.source={source}: a glob names Parquet shards; it matches "
                              f"{others[0]}.")
    else:
        files = [source]
    rows = 0
    for file in files:
        try:
            rows += pq.ParquetFile(file).metadata.num_rows
        except Exception as e:  # pyarrow's ArrowInvalid and OSError: a torn or foreign file
            raise ConfigError(f"{file}: not a Parquet file ({str(e).splitlines()[0]}).") from None
    if rows == 0:
        raise ConfigError(f"The prompt file {source} is empty (no rows): point data.source at prompts.")
    return files


@contextmanager
def _quiet_datasets():
    """``datasets``, its loading bars off while it reads (a run's own progress is the only bar)."""
    try:
        import datasets
    except ImportError as e:
        raise MissingDependencyError(
            "Reading Parquet, CSV, saved or hub datasets needs the `datasets` package: "
            "`pip install 'rlhf_torchrl[datasets]'` (or give a .jsonl file).") from e
    were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if not were_off:
            datasets.enable_progress_bars()


def read_json_lines(path: str) -> tuple[list[dict], list[int]]:
    """The objects of a JSON-lines file and the line each is on (blank lines skipped). A line
    that is not UTF-8, not JSON or not an object is named by its number.

    Args:
        path: the file.
    """
    if not os.path.exists(path):
        raise MissingFileError(f"Prompt file {path!r} does not exist.")
    rows, lines = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                  f"column {e.start + 1}): save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: a {type(row).__name__}, not an object "
                                  "({\"prompt\": ...}).")
            rows.append(row)
            lines.append(lineno)
    return rows, lines


def read_jsonl(path: str, column: str) -> list[tuple[dict, str]]:
    """``(row, "path:line")`` of a JSON-lines file whose every row has ``column``.

    Args:
        path: the file.
        column: the field every row must have.
    """
    rows, lines = read_json_lines(path)
    for row, lineno in zip(rows, lines):
        if column not in row:
            raise ConfigError(f"{path}:{lineno}: expected an object with a {column!r} field "
                              f"(set data.column to the field holding the prompt).")
    return [(row, f"{path}:{lineno}") for row, lineno in zip(rows, lines)]


def _read_json(path: str) -> Table:
    """A ``.json`` file: an array of records (a file of JSON lines named .json is read as one)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}): save the file as UTF-8.") from None
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object per line
            return _in_memory(*read_json_lines(path), path, "json")
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}).") from e
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ConfigError(f"{path}: expected an array of records ([{{\"prompt\": ...}}, ...]), "
                          f"got a {type(data).__name__}{'' if not isinstance(data, list) else ' of other values'}.")
    return _in_memory(data, path, "json")


def _in_memory(rows: list[dict], name: str, form: str, lines: list[int] | None = None) -> Table:
    """A table of rows read into memory (``lines``: the file line of each)."""
    if not rows:
        raise ConfigError(f"The prompt set {name!r} is empty: point data.source at prompts.")
    return Table(rows, tuple(rows[0]), name, form,
                 Where(name, array("q", lines) if lines is not None else None))


def read_hub_rows(name: str, split: str, column: str,
                  config: str | None = None) -> list[tuple[dict, str]]:
    """``(row, "name[i]")`` of a hub dataset (or a folder in its layout) with a ``column``.

    Args:
        name: the hub dataset's name, or a folder in its layout.
        split: the split.
        column: the column every row must have.
        config: the configuration name (None: the default).
    """
    with _quiet_datasets() as datasets:
        ds = datasets.load_dataset(name, config, split=split)
    if column not in ds.column_names:
        raise ConfigError(
            f"Dataset {name!r} has no column {column!r}; its columns are {ds.column_names}. "
            "Set data.column."
        )
    return [(row, f"{name}[{i}]") for i, row in enumerate(ds)]


def polarity_sentences() -> list[tuple[str, str]]:
    """``(label, sentence)`` pairs from gensim's ``pang_lee_polarity.cor`` (labels ``pos``/``neg``)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("The 'polarity' prompt set needs gensim: `pip install gensim`.")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "pang_lee_polarity.cor"
    pairs = []
    for line in path.read_text(encoding="latin-1").splitlines():
        label, _, text = line.strip().partition(" ")
        if text:
            pairs.append((label.removeprefix("__label__"), text.strip()))
    return pairs


def _reasoning_gym_table(name: str, size: int, seed: int, settings: dict) -> Table:
    """``size`` rows of the reasoning-gym task ``name`` (``question``, ``answer``, ``metadata``)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingDependencyError(f"data.source={REASONING_GYM}{name} needs reasoning-gym: "
                                     "`pip install 'rlhf_torchrl[tasks]'`.") from e
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ConfigError(f"reasoning-gym has no task {name!r}; it has {', '.join(sorted(DATASETS))}.")
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
    except (TypeError, AssertionError, ValueError) as e:
        raise ConfigError(f"reasoning-gym task {name!r} refused data.generator_args={settings}: "
                          f"{e}") from e
    return _in_memory([dict(entry) for entry in dataset], f"{REASONING_GYM}{name}", "reasoning_gym")
