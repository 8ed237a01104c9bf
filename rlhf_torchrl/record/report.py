"""The run report: one self-contained HTML page per run, to see at a glance whether it learned,
drifted or collapsed.

:func:`write_report` reads a run directory (``metrics.jsonl``, ``report.json``) and writes
``report.html`` (plots embedded as PNG data, so the file travels alone) and the PNGs beside it in
``plots/``: score, KL, RLHF reward, policy and value losses, clip fractions, entropy, response
length, the held-out evaluation, seconds per phase; the verdict; the config; responses before
and after training, and the policy's responses to the same held-out prompts before and after. The recipe writes it at the end of every run; on demand:

    python -m rlhf_torchrl.record.report outputs/ppo/<run>
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import statistics

from rlhf_torchrl.errors import MissingFileError

#: (file name, title, metric keys, y label)
PLOTS = [
    ("score", "Score (reward model / functions)", ["objective/scores"], "mean score"),
    ("kl", "KL to the reference", ["objective/kl"], "nats per response"),
    ("kl_loss", "KL in the loss (k3, per token)", ["policy/kl_to_ref_avg"], "nats per token"),
    ("groups", "Groups of responses to one prompt",
     ["group/score_std", "group/equal_score_frac", "group/filtered_frac"], "value"),
    ("episodes", "Multi-turn episodes: turns and tool calls",
     ["env/turns_per_episode", "env/tool_calls_per_episode", "env/tool_errors_per_episode",
      "eval/turns_per_episode", "eval/tool_calls_per_episode"], "per episode"),
    ("rlhf_reward", "RLHF reward (score - KL penalty)", ["objective/rlhf_reward"], "mean"),
    ("losses", "Losses", ["loss/policy_avg", "loss/value_avg"], "loss"),
    ("clipfrac", "Clip fractions", ["policy/clipfrac_avg", "val/clipfrac_avg"], "share of tokens"),
    ("entropy", "Entropy", ["objective/entropy"], "nats per response"),
    ("length", "Response length", ["val/sequence_lengths"], "tokens"),
    ("eval_score", "Held-out evaluation: score and win rate",
     ["eval/score", "eval/reference_score", "eval/win_rate", "eval/accuracy"], "value"),
    ("eval_diversity", "Held-out evaluation: diversity", ["eval/distinct_1", "eval/distinct_2"],
     "distinct n-grams / n-grams"),
    ("time", "Seconds per phase", ["time/generation", "time/scoring", "time/old_quantities",
                                   "time/advantages", "time/update", "time/eval"], "seconds"),
]


#: noisy per-batch metrics drawn with their moving average
SMOOTHED = {"objective/scores", "objective/kl", "objective/rlhf_reward"}


def read_run(run_dir: str) -> tuple[list[dict], dict]:
    """(metric rows, report.json) of a run directory.

    Args:
        run_dir: the run's output directory.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise MissingFileError(f"{run_dir} has no metrics.jsonl: not a run directory.")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    summary = {}
    if os.path.exists(os.path.join(run_dir, "report.json")):
        with open(os.path.join(run_dir, "report.json"), encoding="utf-8") as f:
            summary = json.load(f)
    return rows, summary


def trend(values: list[float]) -> tuple[float, float, str, int]:
    """``(first, last, call, k)``: the means of the first and the last quarter of ``values`` (k
    each) and whether the change is larger than their noise: ``"up"``/``"down"`` when the
    difference passes two standard errors of the iteration-to-iteration spread, else (and with
    fewer than 8 values, too few to measure a spread) ``"no clear change"``.

    Args:
        values: the series, one value per iteration.
    """
    k = max(1, len(values) // 4)
    head, tail = values[:k], values[-k:]
    first, last = sum(head) / k, sum(tail) / k
    if k < 2:  # one iteration at each end: no spread to compare the change with
        return first, last, "no clear change", k
    error = (statistics.variance(head) / k + statistics.variance(tail) / k) ** 0.5
    call = ("up" if last - first > 2 * error else "down" if first - last > 2 * error
            else "no clear change")
    return first, last, call, k


def verdict(rows: list[dict], summary: dict) -> list[str]:
    """Plain-language findings: did the score rise, did the KL stay bounded, did the responses
    stay varied.

    Args:
        rows: the run's metric rows.
        summary: the run's ``report.json``.
    """
    trained = [r for r in rows if "objective/scores" in r]
    if not trained:
        return ["No iteration finished."]
    first, last, call, k = trend([r["objective/scores"] for r in trained])
    kls = [r["objective/kl"] for r in trained[-k:] if "objective/kl" in r]
    kl = sum(kls) / len(kls) if kls else float("nan")
    quarter = f"first/last {k} iteration{'s' if k > 1 else ''}"
    out = [f"Training score {first:+.3f} -> {last:+.3f} ({call}; {quarter}); KL to the reference "
           f"{kl:.2f} nats per response at the end."]
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if "eval/score" in before and "eval/score" in after:
        out.append(f"Held-out score (the same prompts, temperature of eval) "
                   f"{before['eval/score']:+.3f} -> {after['eval/score']:+.3f}.")
    if "eval/accuracy" in before and "eval/accuracy" in after:
        out.append(f"Held-out accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}.")
    if "eval/distinct_2" in before and "eval/distinct_2" in after:
        d0, d1 = before["eval/distinct_2"], after["eval/distinct_2"]
        collapsed = d1 < 0.5 * d0
        out.append(f"Held-out distinct-2 {d0:.2f} -> {d1:.2f}"
                   + (": responses collapsed towards a few phrasings." if collapsed else "."))
    if "eval/win_rate" in after:
        out.append(f"Held-out win rate against the reference: {after['eval/win_rate']:.2f}.")
    skipped = sum(1 for r in rows if r.get("guard/skipped"))
    if skipped:
        out.append(f"{skipped} iteration(s) skipped by the divergence guards.")
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (the first ones over fewer).

    Args:
        values: the series.
        window: the most values a mean covers.
    """
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _plot(rows: list[dict], summary: dict, keys: list[str], title: str, ylabel: str, path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = []
    for key in keys:
        points = [(r["iteration"] + 1 if key.startswith("eval/") else r["iteration"], r[key])
                  for r in rows if isinstance(r.get(key), (int, float))]
        before = (summary.get("eval_before") or {}).get(key)
        if key.startswith("eval/") and before is not None:
            points.insert(0, (0, before))  # the untrained policy
        if points:
            series.append((key, points))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for key, points in series:
        xs, ys = zip(*points)
        line, = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key,
                        alpha=0.45 if key in SMOOTHED and len(xs) >= 8 else 1.0)
        if key in SMOOTHED and len(xs) >= 8:  # the trend through the batch-to-batch noise
            window = max(3, len(xs) // 8)
            ax.plot(xs, moving_average(list(ys), window), color=line.get_color(), linewidth=2,
                    label=f"{key} ({window}-iteration mean)")
    ax.set_title(title)
    evals = [key.startswith("eval/") for key, _ in series]
    ax.set_xlabel("updates done" if all(evals) else
                  "iteration (eval/*: updates done)" if any(evals) else "iteration")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no iteration 0.25 on short runs
    ax.ticklabel_format(axis="y", useOffset=False)  # 64.737 is read as it is, not as +6.47e1
    ax.grid(alpha=0.3)
    if len(series) > 1 or any(k in SMOOTHED for k, _ in series):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _prompt_cell(sample: dict) -> str:
    """A table cell with the user's message (its end, if long); hovering shows the whole prompt as
    the policy read it (system prompt and chat template included)."""
    shown = sample.get("question") or sample["prompt"]
    return f'<td title="{html.escape(sample["prompt"])}">{html.escape(shown[-300:])}</td>'


def write_report(run_dir: str) -> str:
    """Write ``report.html`` and ``plots/*.png`` for ``run_dir``; returns the HTML's path.

    Args:
        run_dir: the run's output directory.
    """
    rows, summary = read_run(run_dir)
    plots_dir = os.path.join(run_dir, "plots")
    os.makedirs(plots_dir, exist_ok=True)
    figures = []
    for name, title, keys, ylabel in PLOTS:
        path = os.path.join(plots_dir, f"{name}.png")
        if _plot(rows, summary, keys, title, ylabel, path):
            with open(path, "rb") as f:
                figures.append((title, base64.b64encode(f.read()).decode()))
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>PPO run report</title>",
        "<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto;color:#222}"
        "img{width:600px;margin:4px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
        "text-align:left;vertical-align:top}pre{background:#f6f6f6;padding:1em;overflow:auto}</style>",
        "</head><body>",
        f"<h1>PPO run report</h1><p>{esc(os.path.abspath(run_dir))}: "
        f"{sum(1 for r in rows if 'objective/scores' in r)} iterations</p>",
        "<h2>At a glance</h2><ul id='verdict'>" + "".join(f"<li>{esc(v)}</li>" for v in verdict(rows, summary)) + "</ul>",
        "<h2>Plots</h2>",
        "".join(f"<img alt='{esc(t)}' title='{esc(t)}' src='data:image/png;base64,{data}'>"
                for t, data in figures),
    ]
    timings = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("time/") and k != "time/tokens_per_second":
                timings.setdefault(k, []).append(v)
    if timings:
        parts.append("<h2>Seconds per phase (median over iterations)</h2><table>"
                     + "".join(f"<tr><td>{esc(k[5:])}</td><td>{statistics.median(v):.2f}</td></tr>"
                               for k, v in timings.items()) + "</table>")
    # the ids name the report.json entry each table shows (tests/test_report_browser.py finds them)
    for title, key in (("Responses before training", "samples_before"),
                       ("Responses after training", "samples_after")):
        samples = summary.get(key) or []
        if samples:
            parts.append(f"<h2>{title}</h2><table id='{key}'><tr><th>score</th><th>prompt</th><th>response</th></tr>"
                         + "".join(f"<tr><td>{s['score']:+.3f}</td>{_prompt_cell(s)}"
                                   f"<td>{esc(s['response'])}</td></tr>" for s in samples)
                         + "</table>")
    held_out = summary.get("held_out_samples") or []
    if held_out:
        parts.append("<h2>Held-out prompts: the policy's response before and after training</h2>"
                     "<table id='held_out_samples'><tr><th>prompt</th><th>before</th><th>after</th></tr>"
                     + "".join(f"<tr>{_prompt_cell(s)}"
                               f"<td>{esc(s['before'])} <i>({s['score_before']:+.3f})</i></td>"
                               f"<td>{esc(s['after'])} <i>({s['score_after']:+.3f})</i></td></tr>"
                               for s in held_out) + "</table>")
    if summary.get("config"):
        parts.append("<h2>Config</h2><details><summary>every setting of the run</summary><pre>"
                     + esc(json.dumps(summary["config"], indent=1)) + "</pre></details>")
    parts.append("</body></html>")
    out = os.path.join(run_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return out


def main(argv=None) -> None:
    """``python -m rlhf_torchrl.record.report RUN_DIR``: write the run's report and print its path.

    Args:
        argv (list[str] | None): the command-line arguments (None: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description="Write report.html for a PPO run directory.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    print(write_report(args.run_dir))


if __name__ == "__main__":
    main()
