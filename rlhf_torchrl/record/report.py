"""The run report: one self-contained HTML page per run, to see at a glance whether it learned,
drifted or collapsed.

:func:`write_report` reads a run directory (``metrics.jsonl``, ``report.json``) and writes
``report.html`` (plots embedded as PNG data, so the file travels alone) and the PNGs beside it in
``plots/``: score, KL, RLHF reward, policy and value losses, clip fractions, entropy, response
length, the held-out evaluation, seconds per phase; the verdict and its flags
(:mod:`rlhf_torchrl.record.verdict`); the config; responses before and after training, and the
policy's responses to the same held-out prompts before and after. Every plot has the same x-axis,
the iteration (:func:`points`). The recipe writes it at the end of every run; on demand, for one
run or several overlaid (:mod:`rlhf_torchrl.record.compare`):

    rlhf-torchrl report outputs/ppo/<run>
    rlhf-torchrl report outputs/ppo/<run0> outputs/ppo/<run1> --out outputs/compare
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import statistics

from rlhf_torchrl.errors import MissingFileError
from rlhf_torchrl.record.verdict import assess, trend, verdict  # noqa: F401 (trend, verdict: as before)

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


#: the x-axis of every plot: the iteration, counted from 1 (0: before training)
X_LABEL = "iteration"


def check_run(run_dir: str) -> None:
    """Raise, with one line, unless ``run_dir`` is a run's output directory (it holds
    ``metrics.jsonl``).

    Args:
        run_dir: the folder to check.
    """
    if not os.path.isdir(run_dir):
        raise MissingFileError(f"{run_dir} does not exist: give the output directory of a run "
                               f"(the folder that holds its metrics.jsonl).")
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise MissingFileError(f"{run_dir} has no metrics.jsonl: not a run directory.")


def read_run(run_dir: str) -> tuple[list[dict], dict]:
    """(metric rows, report.json) of a run directory.

    Args:
        run_dir: the run's output directory.
    """
    check_run(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    summary = {}
    if os.path.exists(os.path.join(run_dir, "report.json")):
        with open(os.path.join(run_dir, "report.json"), encoding="utf-8") as f:
            summary = json.load(f)
    return rows, summary


def points(rows: list[dict], summary: dict, key: str) -> list[tuple[int, float]]:
    """``(iteration, value)`` of ``key``, on the report's one x-axis: the row of iteration ``i``
    (``metrics.jsonl``'s ``iteration``, from 0) at ``i + 1``, as the progress line counts, so an
    ``eval/`` value sits at the iteration whose update it follows; the evaluation before training
    (``report.json``'s ``eval_before``) at 0.

    Args:
        rows: the run's metric rows.
        summary: the run's ``report.json``.
        key: the metric.
    """
    out = [(r["iteration"] + 1, r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and "iteration" in r]
    before = (summary.get("eval_before") or {}).get(key)
    if key.startswith("eval/") and isinstance(before, (int, float)):
        out.insert(0, (0, before))  # the untrained policy
    return out


def x_limits(last: int) -> tuple[float, float]:
    """The x-range every plot of a report shares: iteration 0 (before training) to ``last``.

    Args:
        last: the last iteration, counted from 1.
    """
    pad = max(0.5, 0.02 * last)
    return -pad, max(last, 1) + pad


def last_iteration(rows: list[dict]) -> int:
    """The run's last iteration, counted from 1 (0 for none).

    Args:
        rows: the run's metric rows.
    """
    return max((r["iteration"] + 1 for r in rows if "iteration" in r), default=0)


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


def new_axes(title: str, ylabel: str, xlim: tuple[float, float]):
    """A figure and its axes in the report's style, on the shared x-axis ``xlim``.

    Args:
        title: the plot's title.
        ylabel: the y-axis label.
        xlim: the x-range (:func:`x_limits`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(ylabel)
    ax.set_xlim(*xlim)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no iteration 0.25 on short runs
    ax.ticklabel_format(axis="y", useOffset=False)  # 64.737 is read as it is, not as +6.47e1
    ax.grid(alpha=0.3)
    return fig, ax


def save_figure(fig, path: str) -> str:
    """Write ``fig`` to the PNG ``path``, close it, and return the PNG as base64.

    Args:
        fig (matplotlib.figure.Figure): the figure.
        path: where the PNG goes.
    """
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


def figure(rows: list[dict], summary: dict, keys: list[str], title: str, ylabel: str,
           xlim: tuple[float, float]):
    """The plot of ``keys`` for one run (None when the run has none of them): each metric
    against the iteration, the noisy ones (:data:`SMOOTHED`) with their moving average.

    Args:
        rows: the run's metric rows.
        summary: the run's ``report.json``.
        keys: the metrics.
        title: the plot's title.
        ylabel: the y-axis label.
        xlim: the x-range the report's plots share.
    """
    series = [(key, pts) for key in keys if (pts := points(rows, summary, key))]
    if not series:
        return None
    fig, ax = new_axes(title, ylabel, xlim)
    for key, pts in series:
        xs, ys = zip(*pts)
        line, = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key,
                        alpha=0.45 if key in SMOOTHED and len(xs) >= 8 else 1.0)
        if key in SMOOTHED and len(xs) >= 8:  # the trend through the batch-to-batch noise
            window = max(3, len(xs) // 8)
            ax.plot(xs, moving_average(list(ys), window), color=line.get_color(), linewidth=2,
                    label=f"{key} ({window}-iteration mean)")
    if len(series) > 1 or any(k in SMOOTHED for k, _ in series):
        ax.legend(fontsize=7)
    return fig


#: the page's style, shared by the report of one run and of several
STYLE = ("<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto;color:#222}"
         "img{width:600px;margin:4px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
         "text-align:left;vertical-align:top}pre{background:#f6f6f6;padding:1em;overflow:auto}"
         "li.flag{color:#a40000}</style>")


def verdict_items(rows: list[dict], summary: dict) -> str:
    """The verdict as ``<li>`` items: the headline, the findings, then each flag
    (``class='flag'``, ``data-flag`` its name).

    Args:
        rows: the run's metric rows.
        summary: the run's ``report.json``.
    """
    esc = html.escape
    found = assess(rows, summary)
    return ("".join(f"<li>{esc(line)}</li>" for line in [found.headline, *found.lines])
            + "".join(f"<li class='flag' data-flag='{f.name}'>Flag {esc(f.name)}: "
                      f"{esc(f.message)}</li>" for f in found.flags))


def _prompt_cell(sample: dict) -> str:
    """A table cell with the user's message (its end, if long); hovering shows the whole prompt as
    the policy read it (system prompt and chat template included)."""
    shown = sample.get("question") or sample["prompt"]
    return f'<td title="{html.escape(sample["prompt"])}">{html.escape(shown[-300:])}</td>'


def write_report(run_dir: str, out_dir: str | None = None) -> str:
    """Write ``report.html`` and ``plots/*.png`` for ``run_dir``; returns the HTML's path.

    Args:
        run_dir: the run's output directory.
        out_dir: where the report goes (None: ``run_dir``).
    """
    rows, summary = read_run(run_dir)
    out_dir = out_dir or run_dir
    plots_dir = os.path.join(out_dir, "plots")
    os.makedirs(plots_dir, exist_ok=True)
    xlim = x_limits(last_iteration(rows))
    figures = []
    for name, title, keys, ylabel in PLOTS:
        fig = figure(rows, summary, keys, title, ylabel, xlim)
        if fig is not None:
            figures.append((title, save_figure(fig, os.path.join(plots_dir, f"{name}.png"))))
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>PPO run report</title>",
        STYLE,
        "</head><body>",
        f"<h1>PPO run report</h1><p>{esc(os.path.abspath(run_dir))}: "
        f"{sum(1 for r in rows if 'objective/scores' in r)} iterations</p>",
        "<h2>At a glance</h2><ul id='verdict'>" + verdict_items(rows, summary) + "</ul>",
        f"<h2>Plots</h2><p>x-axis: the {X_LABEL}, counted from 1; a held-out evaluation at the "
        f"iteration whose update it follows, the one before training at 0.</p>",
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
    out = os.path.join(out_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return out


def main(argv=None) -> None:
    """``python -m rlhf_torchrl.record.report RUN_DIR``: write the run's report and print its path
    (``rlhf-torchrl report`` does this for one run, and overlays several:
    :mod:`rlhf_torchrl.record.report_command`).

    Args:
        argv (list[str] | None): the command-line arguments (None: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description="Write report.html for a PPO run directory.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    print(write_report(args.run_dir))


if __name__ == "__main__":
    main()
