"""A language-model judge against VADER on the sentiment task: does the policy learn what the judge
rewards, and what does it exploit?

Two arms, each seed a full ``rlhf-torchrl ppo task=sentiment`` run of its own process (one at a
time, :func:`~rlhf_torchrl.benchmarks.estimators.run`):

- ``judge``: trained on the judge alone (``reward.functions=[judge, vader_sentiment]`` with
  weights ``[1, 0]``: VADER is scored and logged, never trained on);
- ``vader``: trained on VADER alone, the judge scored and logged beside it (weights ``[0, 1]``).

The judge is SmolLM2-135M-Instruct in process (``--judge-model``), asked whether each
continuation of a review opening is positive (:data:`RUBRIC`), scored as ``p(yes) / (p(yes) +
p(no))`` over its first token (``reward.judge.scoring=prob``). Each run's held-out evaluations log
both rewards (``eval/scores/judge``, ``eval/scores/vader_sentiment``), so one arm's gain on the
other's reward says whether the two agree; where the judge's score rises and VADER's does not,
the samples show what the policy found. A run whose ``report.json`` exists is skipped, so the
command resumes where it stopped; at the end it prints the table of the runs and, per run, the
held-out responses before and after training with both scores (the judge re-scores them)::

    rlhf-torchrl bench judge_sentiment --seeds 0 1 2 --runs outputs/judge_sentiment \\
        --out outputs/judge_sentiment/table.json
    rlhf-torchrl bench judge_sentiment --table-only --runs outputs/judge_sentiment
"""

from __future__ import annotations

import json
import os
import statistics

from rlhf_torchrl.benchmarks.arms import arm_parser, gather, publish, run_arms, run_dirs

VADER = "rlhf_torchrl.rewards.functions.vader_sentiment"
#: the arms, in the order they run
ARMS = ("judge", "vader")
#: what the judge reads: the review's opening (the prompt) and the policy's continuation
RUBRIC = ("Here is the opening of a movie review and how the writer went on.\n\n"
          "Opening: {prompt}\nContinuation: {response}\n\n"
          "Is the continuation positive about the movie? Answer with one word: yes or no.\n")


def arm_settings(arm: str, judge_model: str, rubric_path: str) -> list[str]:
    """The reward overrides of an arm's runs: both rewards scored, one trained on."""
    weights = "[1.0,0.0]" if arm == "judge" else "[0.0,1.0]"
    return [f"reward.functions=[judge,{VADER}]", f"reward.function_weights={weights}",
            f"reward.judge.model={judge_model}", "reward.judge.scoring=prob",
            f"reward.judge.rubric={rubric_path}", "reward.judge.options=[yes,no]",
            f"eval.judge={'judge' if arm == 'judge' else 'vader_sentiment'}"]


def run_figures(path: str) -> dict:
    """A finished run's figures: each reward's held-out mean before and after, each reward's
    training mean over the first and last quarter, the judge's unread share, the final KL and
    distinct-2, and the held-out samples (prompt, before, after)."""
    report = json.load(open(os.path.join(path, "report.json")))
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    quarter = max(1, len(rows) // 4)

    def trend(key):
        values = [r[key] for r in rows if key in r]
        return (statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])) if values else (None, None)

    before, after = report.get("eval_before", {}), report.get("eval_after", {})
    return {
        "eval_judge": (before.get("eval/scores/judge"), after.get("eval/scores/judge")),
        "eval_vader": (before.get("eval/scores/vader_sentiment"), after.get("eval/scores/vader_sentiment")),
        "win_rate": after.get("eval/win_rate"), "distinct_2": after.get("eval/distinct_2"),
        "train_judge": trend("objective/scores/judge"),
        "train_vader": trend("objective/scores/vader_sentiment"),
        "parse_fail_frac": trend("reward/judge_parse_fail_frac")[1],
        "kl": report.get("final_kl"), "samples": report.get("held_out_samples", []),
    }


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _mean(seeds: dict[int, dict], key: str) -> tuple:
    """(before, after) of ``key`` averaged over the seeds that have it."""
    out = []
    for i in (0, 1):
        values = [f[key][i] for f in seeds.values() if f[key][i] is not None]
        out.append(statistics.fmean(values) if values else None)
    return tuple(out)


def table(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The Markdown table of the runs: one row per run, then the mean over seeds per arm."""
    lines = ["| trained on | seed | held-out judge p(yes) | held-out VADER | training judge, first -> "
             "last quarter | training VADER, first -> last quarter | win rate (its reward) | "
             "distinct-2 | KL at the end | judge unread |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        for seed, f in sorted(seeds.items()):
            lines.append(
                f"| {arm} | {seed} | {_f(f['eval_judge'][0])} -> {_f(f['eval_judge'][1])} | "
                f"{_f(f['eval_vader'][0])} -> {_f(f['eval_vader'][1])} | {_f(f['train_judge'][0])} -> "
                f"{_f(f['train_judge'][1])} | {_f(f['train_vader'][0])} -> {_f(f['train_vader'][1])} | "
                f"{_f(f['win_rate'], '{:.2f}')} | {_f(f['distinct_2'], '{:.2f}')} | {_f(f['kl'], '{:.2f}')} | "
                f"{_f(f['parse_fail_frac'], '{:.2f}')} |")
        if len(seeds) > 1:
            judge, vader = _mean(seeds, "eval_judge"), _mean(seeds, "eval_vader")
            lines.append(f"| **{arm}, mean of {len(seeds)}** | | {_f(judge[0])} -> **{_f(judge[1])}** | "
                         f"{_f(vader[0])} -> **{_f(vader[1])}** | | | | | | |")
    return lines


def sample_lines(runs: dict[str, dict[int, dict]], judge_model: str, per_run: int) -> list[str]:
    """The first ``per_run`` held-out responses of each run, before and after training, each with
    the judge's p(yes) and VADER's score (the judge loaded once, in process)."""
    from rlhf_torchrl.rewards.functions import vader_sentiment
    from rlhf_torchrl.rewards.judge import LLMJudge, TransformersJudge

    judge = LLMJudge(TransformersJudge(judge_model), scoring="prob", rubric=RUBRIC,
                     max_parse_fail_frac=1.0)
    lines = ["| trained on | seed | opening | response | judge p(yes) | VADER |", "|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        for seed, f in sorted(seeds.items()):
            samples = f["samples"][:per_run]
            if not samples:
                continue
            for when in ("before", "after"):
                prompts, responses = [s["prompt"] for s in samples], [s[when] for s in samples]
                judged = judge(prompts, responses).tolist()
                vader = vader_sentiment(prompts, responses)
                for p, r, j, v in zip(prompts, responses, judged, vader):
                    shown = " ".join(r.split()).replace("|", "\\|")
                    lines.append(f"| {arm} ({when}) | {seed} | {' '.join(p.split())} | {shown} | "
                                 f"{j:.2f} | {v:+.2f} |")
    return lines


def main(argv=None) -> dict:
    parser = arm_parser(__doc__, ARMS, "outputs/judge_sentiment")
    parser.add_argument("--judge-model", default="smollm2-135m-instruct",
                        help="the judge (reward.judge.model), in process")
    parser.add_argument("--samples", type=int, default=4, help="held-out samples shown per run")
    args = parser.parse_args(argv)
    names = run_dirs(args, "sentiment")
    rubric = os.path.abspath(os.path.join(args.runs, "rubric.txt"))
    with open(rubric, "w", encoding="utf-8") as f:
        f.write(RUBRIC)
    run_arms(args, "sentiment", list(names.items()),
             lambda arm: arm_settings(arm, args.judge_model, rubric))
    if args.dry_run:
        return {}
    runs = gather(names, run_figures)
    samples = sample_lines(runs, args.judge_model, args.samples) if runs and args.samples else []
    publish(args, "judge_sentiment", runs, table(runs), after=samples, samples=samples)
    return runs


if __name__ == "__main__":
    main()
