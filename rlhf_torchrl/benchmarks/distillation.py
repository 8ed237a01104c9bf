"""On-policy distillation on the sentiment task: a fresh SmolLM2-135M-Instruct student taught by a
PPO-trained teacher (the default run's saved policy), against PPO on the reward alone.

The runs, each a full ``rlhf-torchrl ppo task=sentiment`` of its own process, one at a time
(:func:`~rlhf_torchrl.benchmarks.estimators.run`: peak RSS from the kernel):

- ``reward``: PPO on VADER alone, the default run. Its seed-0 run saves its policy
  (``logging.save_model=true``): that folder, ``<runs>/sentiment_gae_reward_0/policy``, is the
  teacher (or ``--teacher <saved policy folder>``);
- ``teacher``: the same student trained on the teacher alone: ``reward.teacher=<teacher>``,
  minus the per-token reverse KL to it (``reward.teacher_coef``, k1), VADER scored and logged but
  weighted 0, no KL to the reference (``ppo.kl_coef=0``: the teacher is the anchor);
- ``both`` (``--arms``): VADER at weight 1 and the teacher beside it, the reference KL kept.

Every run is evaluated on the same 32 held-out openings every 8 updates; the figure is VADER's
held-out mean (``eval/scores/vader_sentiment`` where VADER is weighted 0, ``eval/score``
otherwise). A run whose ``report.json`` exists is skipped, so the command resumes where it
stopped; at the end it prints the table of the runs and, with ``--out``, writes their held-out
curves (JSON, and the plot beside it)::

    rlhf-torchrl bench distillation --seeds 0 1 2 --out outputs/distillation/curves.json
    rlhf-torchrl bench distillation --table-only --runs outputs/distillation --out curves.json
"""

from __future__ import annotations

import json
import os
import statistics

from rlhf_torchrl.benchmarks.arms import (
    arm_parser,
    gather,
    publish,
    run_arms,
    run_dir,
    run_dirs,
)
from rlhf_torchrl.errors import ConfigError

VADER = "rlhf_torchrl.rewards.functions.vader_sentiment"
#: the arms, in the order they run (the teacher comes from the first's seed 0)
ARMS = ("reward", "teacher", "both")
#: the held-out VADER score: its own entry where it is weighted 0, else the score
HELD_OUT = ("eval/scores/vader_sentiment", "eval/score")


def arm_settings(arm: str, teacher: str, teacher_coef: float) -> list[str]:
    """The reward overrides of an arm's runs."""
    if arm == "reward":
        return [f"reward.functions=[{VADER}]", "reward.function_weights=null"]
    distil = [f"reward.teacher={teacher}", f"reward.teacher_coef={teacher_coef}"]
    if arm == "teacher":
        return [f"reward.functions=[{VADER}]", "reward.function_weights=[0.0]", "ppo.kl_coef=0.0",
                "eval.judge=vader_sentiment", *distil]
    return [f"reward.functions=[{VADER}]", "reward.function_weights=null", *distil]


def held_out(row: dict) -> float | None:
    """A metrics row's held-out VADER mean (None: no evaluation in it)."""
    return next((row[k] for k in HELD_OUT if k in row), None)


def run_curve(path: str) -> dict:
    """A finished run's figures: held-out VADER before and after each evaluation (``curve``:
    ``[updates, score]`` pairs, 0 first), the training VADER and teacher KL over the first and
    last quarter, the KL to the reference at the end, the held-out distinct-2."""
    report = json.load(open(os.path.join(path, "report.json")))
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    curve = [[0, held_out(report["eval_before"])]]
    curve += [[r["iteration"] + 1, held_out(r)] for r in rows if held_out(r) is not None]
    quarter = max(1, len(rows) // 4)

    def trend(key):
        values = [r[key] for r in rows if key in r]
        if not values:
            return None, None
        return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])

    return {"curve": curve, "before": curve[0][1], "after": curve[-1][1],
            "train_vader": trend("objective/scores/vader_sentiment"),
            "teacher_kl": trend("objective/teacher_kl"), "kl": report.get("final_kl"),
            "distinct_2": report.get("eval_after", {}).get("eval/distinct_2")}


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def mean_curve(seeds: dict[int, dict]) -> list[float]:
    """The held-out score after each evaluation, averaged over the seeds that have it."""
    points: dict[int, list[float]] = {}
    for f in seeds.values():
        for updates, score in f["curve"][1:]:
            points.setdefault(updates, []).append(score)
    return [statistics.fmean(points[u]) for u in sorted(points)]


def table(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The Markdown table of the runs: one row per run, then the mean over seeds per arm."""
    lines = ["| trained on | seed | held-out VADER | after each evaluation | training VADER, first -> "
             "last quarter | teacher KL, first -> last quarter | KL to the reference at the end | "
             "distinct-2 |", "|---|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        for seed, f in sorted(seeds.items()):
            lines.append(
                f"| {arm} | {seed} | {_f(f['before'])} -> {_f(f['after'])} | "
                f"{', '.join(_f(s, '{:.2f}') for _, s in f['curve'][1:])} | "
                f"{_f(f['train_vader'][0])} -> {_f(f['train_vader'][1])} | "
                f"{_f(f['teacher_kl'][0], '{:.2f}')} -> {_f(f['teacher_kl'][1], '{:.2f}')} | "
                f"{_f(f['kl'], '{:.2f}')} | {_f(f['distinct_2'], '{:.2f}')} |")
        if len(seeds) > 1:
            after = [f["after"] for f in seeds.values()]
            before = statistics.fmean(f["before"] for f in seeds.values())
            lines.append(f"| **{arm}, mean of {len(seeds)}** | | {before:.3f} -> "
                         f"**{statistics.fmean(after):.3f}** ± {statistics.stdev(after):.3f} | "
                         f"{', '.join(f'{s:.2f}' for s in mean_curve(seeds))} | | | | |")
    return lines


def main(argv=None) -> dict:
    parser = arm_parser(__doc__, ARMS, "outputs/distillation", default_arms=["reward", "teacher"])
    parser.add_argument("--teacher", default=None,
                        help="a saved policy folder to teach with (default: the reward arm's "
                             "seed-0 run's <run>/policy, trained first)")
    parser.add_argument("--teacher-coef", type=float, default=1.0, help="reward.teacher_coef")
    args = parser.parse_args(argv)
    if args.teacher_coef <= 0:
        raise ConfigError(f"--teacher-coef {args.teacher_coef}: give a positive coefficient.")
    names = run_dirs(args, "sentiment")
    teacher_run = run_dir(args, "sentiment", "reward", 0)
    teacher = os.path.abspath(args.teacher or os.path.join(teacher_run, "policy"))
    todo = list(names.items())
    if args.teacher is None and any(arm != "reward" for arm in args.arms):
        todo = [(("reward", 0), teacher_run)] + [(k, p) for k, p in todo if p != teacher_run]

    def adjust(arm: str, path: str, cmd: list[str]) -> list[str] | None:
        if path == teacher_run and args.teacher is None:  # the teacher: its policy saved
            return [c if c != "logging.save_model=false" else "logging.save_model=true" for c in cmd]
        if arm != "reward" and not args.dry_run and not os.path.isdir(teacher):
            print(f"skipped: {path} (no teacher at {teacher})", flush=True)
            return None
        return cmd

    run_arms(args, "sentiment", todo, lambda arm: arm_settings(arm, teacher, args.teacher_coef),
             adjust)
    if args.dry_run:
        return {}
    runs = gather(names, run_curve)
    publish(args, "distillation", runs, table(runs), teacher=teacher)
    return runs


if __name__ == "__main__":
    main()
