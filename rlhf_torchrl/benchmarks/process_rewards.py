"""Process rewards against outcome rewards on the arithmetic task: PPO (GAE) on the final answer
alone (``gsm8k_correct``), and on the final answer plus the per-step verifier
(``arithmetic_steps``: is each line's arithmetic right?, ``--step-weight`` of it), seeds x arms
full ``rlhf-torchrl ppo`` runs of their own processes, one at a time
(:func:`~rlhf_torchrl.benchmarks.estimators.run`: peak RSS from the kernel). A run whose
``report.json`` exists is skipped, so the command resumes where it stopped; at the end it prints
the table of the runs and, with ``--out``, writes their held-out accuracy curves (JSON, and the
plot beside it).

Each run writes ``<runs>/arithmetic_gae_<arm>_<seed>/`` (``metrics.jsonl``: ``eval/accuracy``
every ``eval.every`` updates; ``report.json``), its output to ``.log`` beside it::

    rlhf-torchrl bench process_rewards --seeds 0 1 2 --out outputs/process_rewards/curves.json
    rlhf-torchrl bench process_rewards --table-only --runs outputs/process_rewards --out curves.json
"""

from __future__ import annotations

import json
import os
import statistics

from rlhf_torchrl.benchmarks.arms import arm_parser, gather, publish, run_arms, run_dirs
from rlhf_torchrl.errors import ConfigError

OUTCOME = "rlhf_torchrl.rewards.functions.gsm8k_correct"
STEPS = "rlhf_torchrl.rewards.functions.arithmetic_steps"
#: the arms, in the order they run
ARMS = ("outcome", "steps")


def arm_settings(arm: str, step_weight: float) -> list[str]:
    """The reward overrides of an arm's runs."""
    if arm == "outcome":
        return [f"reward.functions=[{OUTCOME}]", "reward.function_weights=null"]
    return [f"reward.functions=[{OUTCOME},{STEPS}]", f"reward.function_weights=[1.0,{step_weight}]"]


def run_curve(path: str) -> dict:
    """A finished run's figures: held-out accuracy before and after each evaluation (``curve``:
    ``[updates, accuracy]`` pairs, 0 first), the training score and step reward over the first
    and last quarter, the final KL, the response length, and the share of held-out sample
    responses with a wrong arithmetic line (``arithmetic_steps`` on the report's samples)."""
    from rlhf_torchrl.rewards.functions import arithmetic_steps
    from rlhf_torchrl.rewards.steps import StepSplit

    report = json.load(open(os.path.join(path, "report.json")))
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    curve = [[0, report["eval_before"]["eval/accuracy"]]]
    curve += [[r["iteration"] + 1, r["eval/accuracy"]] for r in rows if "eval/accuracy" in r]
    quarter = max(1, len(rows) // 4)

    def trend(key):
        values = [r.get(key, 0.0) for r in rows]
        return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])

    samples = [s["after"] for s in report.get("held_out_samples", [])]
    steps = [StepSplit().texts(s) for s in samples]
    wrong = [any(v < 0 for v in row) for row in arithmetic_steps([""] * len(steps), samples, steps)]
    return {"curve": curve, "before": curve[0][1], "after": curve[-1][1],
            "train": trend("objective/scores"), "step_reward": trend("objective/step_reward"),
            "kl": report["final_kl"], "length": trend("val/sequence_lengths"),
            "wrong_step_frac": statistics.fmean(wrong) if wrong else None, "samples": len(wrong)}


def table(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The Markdown table of the runs: one row per run, then the mean over seeds per arm."""
    lines = ["| reward | seed | held-out accuracy | after each evaluation | training accuracy, "
             "first -> last quarter | step reward, first -> last quarter | KL at the end | "
             "response tokens, first -> last quarter | held-out samples with a wrong line |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        for seed, f in sorted(seeds.items()):
            wrong = "-" if f["wrong_step_frac"] is None else f"{f['wrong_step_frac']:.2f} of {f['samples']}"
            lines.append(
                f"| {arm} | {seed} | {f['before']:.3f} -> {f['after']:.3f} | "
                f"{', '.join(f'{a:.2f}' for _, a in f['curve'][1:])} | {f['train'][0]:.3f} -> "
                f"{f['train'][1]:.3f} | {f['step_reward'][0]:+.3f} -> {f['step_reward'][1]:+.3f} | "
                f"{f['kl']:.2f} | {f['length'][0]:.0f} -> {f['length'][1]:.0f} | {wrong} |")
        if len(seeds) > 1:
            after = [f["after"] for f in seeds.values()]
            before = statistics.fmean(f["before"] for f in seeds.values())
            lines.append(f"| **{arm}, mean of {len(seeds)}** | | {before:.3f} -> "
                         f"**{statistics.fmean(after):.3f}** ± {statistics.stdev(after):.3f} | "
                         f"{', '.join(f'{a:.2f}' for a in mean_curve(seeds))} | | | "
                         f"{statistics.fmean(f['kl'] for f in seeds.values()):.2f} | | |")
    return lines


def mean_curve(seeds: dict[int, dict]) -> list[float]:
    """The held-out accuracy after each evaluation, averaged over the seeds that have it."""
    points: dict[int, list[float]] = {}
    for f in seeds.values():
        for updates, accuracy in f["curve"][1:]:
            points.setdefault(updates, []).append(accuracy)
    return [statistics.fmean(points[u]) for u in sorted(points)]


def main(argv=None) -> dict:
    parser = arm_parser(__doc__, ARMS, "outputs/process_rewards")
    parser.add_argument("--step-weight", type=float, default=0.5,
                        help="the per-step verifier's weight beside the outcome reward's 1.0")
    args = parser.parse_args(argv)
    if args.step_weight <= 0:
        raise ConfigError(f"--step-weight {args.step_weight}: give a positive weight.")
    names = run_dirs(args, "arithmetic")
    run_arms(args, "arithmetic", list(names.items()), lambda arm: arm_settings(arm, args.step_weight))
    if args.dry_run:
        return {}
    runs = gather(names, run_curve)
    publish(args, "process_rewards", runs, table(runs))
    return runs


if __name__ == "__main__":
    main()
