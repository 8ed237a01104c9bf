"""What the benchmarks that compare arms share (:mod:`.process_rewards`, :mod:`.overlong`,
:mod:`.distillation`, :mod:`.judge_sentiment`): seeds x arms of full ``rlhf-torchrl ppo`` runs
with GAE, each a process of its own, one at a time
(:func:`~rlhf_torchrl.benchmarks.estimators.run`: peak RSS from the kernel), in
``<runs>/<task>_gae_<arm>[_extra]_<seed>/`` with its output in ``.log`` beside it.

A run whose ``report.json`` exists is skipped, so a command resumes where it stopped;
``--dry-run`` prints the commands of the runs still to do; ``--table-only`` runs nothing. At the
end: the table of the runs done, and with ``--out`` the JSON and its plot.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rlhf_torchrl.benchmarks.common import add_out_arg, make_parser, write_json
from rlhf_torchrl.benchmarks.estimators import command, run, run_name

#: (arm, seed) -> the run's folder
Runs = dict[tuple[str, int], str]


def arm_parser(doc: str, arms: tuple[str, ...], runs: str,
               default_arms: list[str] | None = None):
    """The parser of an arms benchmark: ``--seeds``, ``--arms``, ``--runs``, ``--extra``,
    ``--table-only``, ``--dry-run`` and ``--out``; the benchmark adds its own."""
    parser = make_parser(doc)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(default_arms or arms), choices=arms)
    parser.add_argument("--runs", default=runs, help="the folder the runs go to")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="overrides added to every run (a quick check: model.policy=<dir> "
                             "ppo.num_iterations=2); their runs are tagged _extra")
    parser.add_argument("--table-only", action="store_true",
                        help="no runs: the table of those done")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands of the runs still to do, run nothing")
    add_out_arg(parser)
    return parser


def run_dir(args, task: str, arm: str, seed: int) -> str:
    """The folder of one run (``--extra`` tags it ``_extra``)."""
    tag = "_extra" if args.extra else ""
    return os.path.join(args.runs, run_name(task, "gae", seed, arm + tag))


def run_dirs(args, task: str) -> Runs:
    """Every run's folder, arms in the order given, then seeds; ``--runs`` made."""
    os.makedirs(args.runs, exist_ok=True)
    return {(arm, seed): run_dir(args, task, arm, seed) for arm in args.arms for seed in args.seeds}


def done(path: str) -> bool:
    return os.path.exists(os.path.join(path, "report.json"))


def run_arms(args, task: str, todo: list[tuple[tuple[str, int], str]],
             settings: Callable[[str], list[str]],
             adjust: Callable[[str, str, list[str]], list[str] | None] | None = None) -> None:
    """Each run of ``todo`` not done yet, in order: ``rlhf-torchrl ppo task=<task>`` with GAE, its
    seed, ``settings(arm)`` and ``--extra``; ``adjust(arm, folder, command)`` may change the
    command, or return None to skip the run. Printed instead with ``--dry-run``; nothing with
    ``--table-only``."""
    if args.table_only:
        return
    for (arm, seed), path in todo:
        if done(path):
            continue
        cmd = command(task, "gae", seed, path, [*settings(arm), *args.extra])
        if adjust is not None and (cmd := adjust(arm, path, cmd)) is None:
            continue
        print(" ".join(cmd[4:]) if args.dry_run else f"running {path}", flush=True)
        if not args.dry_run and run(cmd, path + ".log", path + ".time"):
            print(f"failed: {path} (see {path}.log)", flush=True)


def gather(runs: Runs, figures: Callable[[str], dict]) -> dict[str, dict[int, dict]]:
    """``figures(folder)`` of each finished run, by arm, then seed."""
    out: dict[str, dict[int, dict]] = {}
    for (arm, seed), path in runs.items():
        if done(path):
            out.setdefault(arm, {})[seed] = figures(path)
    return out


def publish(args, name: str, runs: dict[str, dict[int, dict]], table: list[str],
            after: list[str] = (), **more) -> dict:
    """Print ``table`` (then ``after``); with ``--out`` write the JSON (``more`` beside the runs)
    and draw :data:`~rlhf_torchrl.benchmarks.plots.PLOTS` ``[name]`` beside it."""
    print("\n".join(table))
    if after:
        print("\n" + "\n".join(after))
    payload = {"benchmark": name, "args": vars(args), **more, "runs": runs}
    write_json(args.out, payload)
    if args.out is not None and runs:
        from rlhf_torchrl.benchmarks.plots import PLOTS, plot_path, save

        save(PLOTS[name], payload, plot_path(args.out))
    return payload
