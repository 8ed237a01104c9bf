"""The figures two or more ``--out`` files share, side by side, with their ratios to the first.

Each file is a benchmark's JSON (``rlhf-torchrl bench <name> --out A.json``), say the same
benchmark before and after a change, or on two machines. Every number in it is a figure, named
by its path: ``ours.update`` (ppo_iteration), ``results[batch_size=16,length=64].collector_tokens_per_s``
(collectors: a row of a table is named by its batch size, length, clients, rows or form),
``variants.bf16.total`` (scaling); the arguments, the machine and the per-iteration lists are
not figures. The figures in every file are printed, ``B/A`` is B's over A's (for seconds,
below 1 is faster; for tokens/s, above 1).

    rlhf-torchrl bench compare before.json after.json --plot compare.png
    rlhf-torchrl bench compare a.json b.json c.json --only total tokens_per_s
"""

from __future__ import annotations

import json
import math
import os

from rlhf_torchrl.benchmarks.common import finish, make_parser, table
from rlhf_torchrl.errors import ConfigError, MissingFileError

#: entries that describe a run rather than measure it
_CONTEXT = ("args", "machine", "benchmark", "vocabulary", "ours_all", "floor_all")
#: the fields that name a row of a results table
_ROW_NAMES = ("batch_size", "length", "clients", "rows", "form")


def figures(value, prefix: str = "") -> dict[str, float]:
    """Every number of a benchmark's payload by its path (see the module docstring)."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if not prefix and key in _CONTEXT:
                continue
            out.update(figures(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, row in enumerate(value):
            names = [k for k in _ROW_NAMES if k in row]
            label = ",".join(f"{k}={row[k]}" for k in names) or str(i)
            out.update(figures({k: v for k, v in row.items() if k not in names}, f"{prefix}[{label}]"))
    return out  # (a list of numbers is a curve: not one figure)


def load(path: str) -> dict:
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} is not a file: give the JSON files that --out wrote.")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a benchmark's JSON ({error}).") from None


def _describe(label: str, path: str, payload: dict) -> str:
    args, machine = payload.get("args", {}), payload.get("machine", {})
    parts = [payload.get("benchmark", "a benchmark"), *([str(args["model"])] if "model" in args else []),
             *(str(machine[k]) for k in ("date", "cpu") if machine.get(k))]
    if machine.get("threads"):
        parts.append(f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}")
    return f"  {label}: {path} ({', '.join(parts)})"


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("files", nargs="+", metavar="FILE", help="two or more --out JSON files")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="keep the figures whose name contains one of these")
    parser.add_argument("--plot", default=None,
                        help="draw the ratios to the first file into this PNG")
    parser.add_argument("--out", default=None,
                        help="write the comparison as JSON to this file (and its plot beside it)")
    args = parser.parse_args(argv)
    if len(args.files) < 2:
        raise ConfigError(f"bench compare needs two or more files, got {len(args.files)}.")
    payloads = [load(path) for path in args.files]
    kinds = {p.get("benchmark") for p in payloads} - {None}
    if len(kinds) > 1:
        raise ConfigError(f"The files come from different benchmarks ({', '.join(sorted(kinds))}): "
                          "compare runs of one benchmark.")
    each = [figures(p) for p in payloads]
    shared = [name for name in each[0] if all(name in f for f in each[1:])]
    if args.only:
        shared = [name for name in shared if any(text in name for text in args.only)]
    if not shared:
        raise ConfigError("The files share no figure" + (f" containing {' or '.join(args.only)}"
                                                         if args.only else "")
                          + ": compare --out files of one benchmark, run with the same sizes.")
    labels = [chr(ord("A") + i) if i < 26 else f"F{i}" for i in range(len(args.files))]
    print(f"{len(shared)} figures in all {len(args.files)} files; ratios to {labels[0]}:")
    for label, path, payload in zip(labels, args.files, payloads):
        print(_describe(label, path, payload))
    header = ["figure".ljust(max(len(name) for name in shared)), labels[0]]
    for label in labels[1:]:
        header += [label, f"{label}/{labels[0]}"]
    rows, width = [], max(len(name) for name in shared)
    for name in shared:
        base, row = each[0][name], [name.ljust(width), _fmt(each[0][name])]
        for f in each[1:]:
            row += [_fmt(f[name]), f"{f[name] / base:.2f}x" if base else "-"]
        rows.append(row)
    print(table(rows, header))
    left_out = sum(len(f) for f in each) - len(shared) * len(each)
    if left_out:
        print(f"({left_out} figures are in some files only: a different size or setting)")
    payload = {"files": args.files, "labels": labels,
               "metrics": {name: [f[name] for f in each] for name in shared}}
    if args.plot:
        from rlhf_torchrl.benchmarks.plots import compare, save

        save(compare, payload, args.plot)
    return finish(args, payload, "compare")


if __name__ == "__main__":
    main()
