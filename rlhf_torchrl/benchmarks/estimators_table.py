"""The table of :mod:`.estimators`' runs: one row per run, then the mean over seeds.

Reads ``<runs>/<task>_<estimator>[_<tag>]_<seed>/`` (``report.json``, ``metrics.jsonl``) and
``<runs>/<task>_<estimator>[_<tag>]_<seed>.time`` (the peak RSS, in ``/usr/bin/time -v``'s
words). The held-out figure is ``eval/accuracy`` on arithmetic and ``eval/score`` elsewhere;
seconds per iteration are the median ``time/total`` (an iteration with an evaluation, or one paused, does not move it). Prints
a Markdown table.

    rlhf-torchrl bench estimators_table --task arithmetic --runs outputs/estimators
"""

from __future__ import annotations

import json
import os
import re
import statistics

from rlhf_torchrl.benchmarks.common import add_out_arg, finish, make_parser
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS

#: the registered estimators (a plugin's too, once imported)
ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)


def run_figures(path: str, held_out: str) -> dict:
    report = json.load(open(os.path.join(path, "report.json")))
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    peak = None
    if os.path.exists(path + ".time"):
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path + ".time").read())
        peak = int(match.group(1)) / 2**20 if match else None
    quarter = max(1, len(rows) // 4)
    return {
        "before": report["eval_before"][held_out], "after": report["eval_after"][held_out],
        "train_first": statistics.fmean(r["objective/scores"] for r in rows[:quarter]),
        "train_last": statistics.fmean(r["objective/scores"] for r in rows[-quarter:]),
        "kl": report["final_kl"],  # over the last quarter, as the training score
        "distinct_2": report["eval_after"]["eval/distinct_2"],
        "seconds": statistics.median(r["time/total"] for r in rows),
        "peak_gib": peak,
        "equal_groups": (statistics.fmean(r["group/equal_score_frac"] for r in rows)
                         if "group/equal_score_frac" in rows[0] else None),
    }


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--task", default="arithmetic", help="the task preset the runs trained on")
    parser.add_argument("--runs", default="outputs/estimators",
                        help="the folder of the runs (estimators' --runs)")
    parser.add_argument("--tag", default="",
                        help="a variant's runs (estimators' --tag), e.g. bf16; none: the plain runs")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    add_out_arg(parser)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.runs):
        raise ConfigError(f"--runs {args.runs} is not a folder: give the OUT folder of "
                          "`rlhf-torchrl bench estimators`' runs.")
    held_out = "eval/accuracy" if args.task == "arithmetic" else "eval/score"
    print(f"| estimator | seed | held-out {held_out.split('/')[1]} | training score, first -> last "
          "quarter | KL at the end | held-out distinct-2 | s/iteration (median) | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    tag = f"_{args.tag}" if args.tag else ""
    for estimator in args.estimators:
        runs = []
        for name in sorted(os.listdir(args.runs)):
            match = re.fullmatch(rf"{args.task}_{estimator}{tag}_(\d+)", name)
            path = os.path.join(args.runs, name)
            if match and os.path.exists(os.path.join(path, "report.json")):
                runs.append((int(match.group(1)), run_figures(path, held_out)))
        results[estimator] = dict(runs)
        for seed, f in runs:
            rss = f"{f['peak_gib']:.2f} GiB" if f["peak_gib"] else "-"
            print(f"| {estimator}{tag} | {seed} | {f['before']:.3f} -> {f['after']:.3f} | "
                  f"{f['train_first']:.3f} -> {f['train_last']:.3f} | {f['kl']:.2f} | "
                  f"{f['distinct_2']:.2f} | {f['seconds']:.1f} | {rss} |")
        if len(runs) > 1:
            def mean(key, runs=runs):
                return statistics.fmean(f[key] for _, f in runs)

            def spread(key, runs=runs):
                return statistics.stdev(f[key] for _, f in runs)

            print(f"| **{estimator}{tag}, mean of {len(runs)}** | | {mean('before'):.3f} -> "
                  f"**{mean('after'):.3f}** ± {spread('after'):.3f} | {mean('train_first'):.3f} -> "
                  f"{mean('train_last'):.3f} | {mean('kl'):.2f} | {mean('distinct_2'):.2f} | "
                  f"{mean('seconds'):.1f} | |")
    finish(args, {"args": vars(args), "runs": results}, "estimators_table")
    return results


if __name__ == "__main__":
    main()
