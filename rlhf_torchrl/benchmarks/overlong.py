"""DAPO's overlong shaping on a task whose responses run into the length limit: PPO (GAE) with and
without ``reward.overlong_buffer``, seeds x arms full ``rlhf-torchrl ppo`` runs of their own
processes, one at a time (:func:`~rlhf_torchrl.benchmarks.estimators.run`: peak RSS from the
kernel).

The arithmetic task's answers run 10-48 tokens; at ``generation.max_new_tokens=32``
(``--max-new-tokens``) a share of them is cut before its final answer. The arms:

- ``none``: the task's reward alone;
- ``overlong``: plus the soft overlong punishment over the last ``--buffer`` tokens before the
  limit (``reward.overlong_buffer``, ``reward.overlong_penalty=--penalty``).

The figures: the held-out share of responses cut by the limit (``eval/truncated_frac``: no stop
token) and their length, the held-out accuracy (what the shaping must not cost), before and after
training; in training, the share cut in the first and last quarter (``1 - val/num_eos_tokens /
ppo.batch_size``) and, on the ``overlong`` arm, the mean penalty. A run whose ``report.json``
exists is skipped, so the command resumes where it stopped; at the end it prints the table of the
runs and, with ``--out``, writes their held-out curves (JSON, and the plot beside it)::

    rlhf-torchrl bench overlong --seeds 0 1 2 --out outputs/overlong/curves.json
    rlhf-torchrl bench overlong --table-only --runs outputs/overlong --out curves.json
"""

from __future__ import annotations

import json
import os
import statistics

from rlhf_torchrl.benchmarks.arms import arm_parser, gather, publish, run_arms, run_dirs
from rlhf_torchrl.errors import ConfigError

#: the arms, in the order they run
ARMS = ("none", "overlong")


def arm_settings(arm: str, max_new_tokens: int, buffer: int, penalty: float) -> list[str]:
    """The overrides of an arm's runs."""
    shaping = ([f"reward.overlong_buffer={buffer}", f"reward.overlong_penalty={penalty}"]
               if arm == "overlong" else ["reward.overlong_buffer=null"])
    return [f"generation.max_new_tokens={max_new_tokens}", *shaping]


def run_curve(path: str) -> dict:
    """A finished run's figures: held-out truncated share, accuracy (or score) and length before
    and after each evaluation (``curve``: ``[updates, truncated share]`` pairs, 0 first), the
    training truncated share and overlong penalty over the first and last quarter, the final KL."""
    report = json.load(open(os.path.join(path, "report.json")))
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    before = report["eval_before"]
    evals = [r for r in rows if "eval/truncated_frac" in r]
    after = evals[-1] if evals else before
    headline = "eval/accuracy" if "eval/accuracy" in before else "eval/score"
    quarter = max(1, len(rows) // 4)

    def trend(values):
        return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])

    return {
        "curve": [[0, before["eval/truncated_frac"]],
                  *[[r["iteration"] + 1, r["eval/truncated_frac"]] for r in evals]],
        "headline": headline,
        "truncated": (before["eval/truncated_frac"], after["eval/truncated_frac"]),
        "result": (before[headline], after[headline]),
        "length": (before["eval/response_length"], after["eval/response_length"]),
        # (a row's batch: "episode" counts the responses trained on, iterations done x batch)
        "train_truncated": trend([1 - r["val/num_eos_tokens"] * (r["iteration"] + 1) / r["episode"]
                                  for r in rows]),
        "penalty": trend([r.get("reward/overlong_penalty", 0.0) for r in rows]),
        "kl": report["final_kl"],
    }


def table(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The Markdown table of the runs: one row per run, then the mean over seeds per arm."""
    lines = ["| shaping | seed | held-out cut by the limit | held-out result | held-out tokens | "
             "training cut, first -> last quarter | overlong penalty, first -> last quarter | "
             "KL at the end |", "|---|---|---|---|---|---|---|---|"]

    def arrow(pair, fmt=".2f"):
        return f"{pair[0]:{fmt}} -> {pair[1]:{fmt}}"

    for arm, seeds in runs.items():
        for seed, f in sorted(seeds.items()):
            lines.append(f"| {arm} | {seed} | {arrow(f['truncated'])} | {arrow(f['result'], '.3f')} "
                         f"({f['headline']}) | {arrow(f['length'], '.1f')} | "
                         f"{arrow(f['train_truncated'])} | {arrow(f['penalty'], '+.3f')} | "
                         f"{f['kl']:.2f} |")
        if len(seeds) > 1:
            def mean(key, seeds=seeds):  # the seeds' mean after training, and their spread
                values = [f[key][1] for f in seeds.values()]
                return f"**{statistics.fmean(values):.3f}** ± {statistics.stdev(values):.3f}"

            lines.append(f"| **{arm}, mean of {len(seeds)}** | | {mean('truncated')} | "
                         f"{mean('result')} | {mean('length')} | {mean('train_truncated')} | | "
                         f"{statistics.fmean(f['kl'] for f in seeds.values()):.2f} |")
    return lines


def main(argv=None) -> dict:
    parser = arm_parser(__doc__, ARMS, "outputs/overlong")
    parser.add_argument("--task", default="arithmetic", help="the task preset (task=...)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="generation.max_new_tokens of every run: L_max")
    parser.add_argument("--buffer", type=int, default=8,
                        help="reward.overlong_buffer of the overlong arm: L_cache")
    parser.add_argument("--penalty", type=float, default=1.0,
                        help="reward.overlong_penalty of the overlong arm")
    args = parser.parse_args(argv)
    if not 0 < args.buffer < args.max_new_tokens:
        raise ConfigError(f"--buffer {args.buffer}: give a buffer > 0 and below --max-new-tokens "
                          f"{args.max_new_tokens}.")
    names = run_dirs(args, args.task)
    run_arms(args, args.task, list(names.items()),
             lambda arm: arm_settings(arm, args.max_new_tokens, args.buffer, args.penalty))
    if args.dry_run:
        return {}
    runs = gather(names, run_curve)
    publish(args, "overlong", runs, table(runs))
    return runs


if __name__ == "__main__":
    main()
