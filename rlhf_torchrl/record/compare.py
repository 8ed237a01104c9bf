"""Several runs on one page: seeds or settings overlaid on the same plots, with their mean and
spread.

:func:`write_comparison` reads run directories (as :func:`~rlhf_torchrl.record.report.read_run`)
and writes one ``report.html`` (plots embedded, PNGs in ``plots/``): each run's training score, KL
to the reference, held-out score and held-out distinct-2 as a thin line, and across the runs their
mean (a thick line) and min-max band (the lowest and the highest run), at the iterations every run
reached (:func:`across_runs`); a table of each run's verdict, flags and figures with their mean
and range; each run's findings. The x-axis is the single report's
(:func:`~rlhf_torchrl.record.report.points`). The band is the min-max, not ±std: a few seeds give
a poor standard deviation, and the band shows where every run went.

    rlhf-torchrl report outputs/seed0 outputs/seed1 outputs/seed2 --out outputs/seeds
"""

from __future__ import annotations

import html
import os
import statistics

from rlhf_torchrl.record.report import (
    STYLE,
    X_LABEL,
    last_iteration,
    new_axes,
    points,
    read_run,
    save_figure,
    verdict_items,
    x_limits,
)
from rlhf_torchrl.record.verdict import assess, trend

#: (file name, title, metric key, y label) of the overlaid plots
COMPARED = [
    ("score", "Score (reward model / functions)", "objective/scores", "mean score"),
    ("kl", "KL to the reference", "objective/kl", "nats per response"),
    ("eval_score", "Held-out score", "eval/score", "mean score"),
    ("eval_diversity", "Held-out distinct-2", "eval/distinct_2", "distinct bigrams / bigrams"),
]


def across_runs(series: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
    """``(iteration, mean, min, max)`` across the runs, at each iteration every run has a value
    for, in order.

    Args:
        series: each run's ``(iteration, value)`` points (:func:`~rlhf_torchrl.record.report.points`).

    Example:
        >>> across_runs([[(0, 1.0), (1, 2.0)], [(1, 4.0), (2, 5.0)]])
        [(1, 3.0, 2.0, 4.0)]
    """
    values = [dict(s) for s in series]
    common = sorted(set.intersection(*(set(v) for v in values)))
    return [(x, statistics.fmean(at), min(at), max(at)) for x in common
            for at in [[v[x] for v in values]]]


def run_labels(run_dirs: list[str]) -> list[str]:
    """The runs' paths cut to their last folders, as few as tell the runs apart (``seed0`` and
    ``seed1``; ``a/seed0`` and ``b/seed0``).

    Args:
        run_dirs: the runs' directories, each given once.
    """
    parts = [os.path.abspath(d).split(os.sep) for d in run_dirs]
    for depth in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.path.abspath(d) for d in run_dirs]


def _figure(runs: list[tuple[str, list[dict], dict]], key: str, title: str, ylabel: str,
            xlim: tuple[float, float]):
    """The overlay of ``key``: each run's line, the mean and the min-max band across those that
    logged it (None when none did)."""
    series = [(label, pts) for label, rows, summary in runs if (pts := points(rows, summary, key))]
    if not series:
        return None
    fig, ax = new_axes(title, ylabel, xlim)
    for label, pts in series:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, linewidth=1, alpha=0.6, marker="o" if len(xs) < 30 else None,
                markersize=2, label=label)
    if len(series) > 1 and (stats := across_runs([pts for _, pts in series])):
        xs, mean, low, high = zip(*stats)
        ax.fill_between(xs, low, high, color="0.5", alpha=0.25, linewidth=0,
                        label=f"min-max of {len(series)} runs")
        ax.plot(xs, mean, color="black", linewidth=2, label=f"mean of {len(series)} runs")
    ax.legend(fontsize=7)
    return fig


def _figures(rows: list[dict], summary: dict) -> dict[str, float]:
    """A run's figures for the table: its training score's ends, its KL at the end, its held-out
    score, distinct-2 and win rate (those it has)."""
    trained = [r for r in rows if "objective/scores" in r]
    out = {}
    if trained:
        first, last, _, k = trend([r["objective/scores"] for r in trained])
        out.update({"score_first": first, "score_last": last})
        kls = [r["objective/kl"] for r in trained if "objective/kl" in r]
        if kls:
            out["kl_end"] = statistics.fmean(kls[-k:])
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    for key, name in (("eval/score", "held_out"), ("eval/distinct_2", "distinct_2")):
        if key in before and key in after:
            out[f"{name}_before"], out[f"{name}_after"] = before[key], after[key]
    if "eval/win_rate" in after:
        out["win_rate"] = after["eval/win_rate"]
    return out


#: the table's figure columns: (title, (first figure, last figure) or (figure,), format)
COLUMNS = [
    ("training score (first/last quarter)", ("score_first", "score_last"), "{:+.3f}"),
    ("KL at the end", ("kl_end",), "{:.2f}"),
    ("held-out score", ("held_out_before", "held_out_after"), "{:+.3f}"),
    ("held-out distinct-2", ("distinct_2_before", "distinct_2_after"), "{:.2f}"),
    ("win rate", ("win_rate",), "{:.2f}"),
]


def _cell(figures: dict, names: tuple[str, ...], fmt: str) -> str:
    if not all(n in figures for n in names):
        return "<td></td>"
    return "<td>" + " -> ".join(fmt.format(figures[n]) for n in names) + "</td>"


def _spread_cell(all_figures: list[dict], names: tuple[str, ...], fmt: str) -> str:
    """The mean and the min-max across the runs of the column's last figure."""
    values = [f[names[-1]] for f in all_figures if names[-1] in f]
    if not values:
        return "<td></td>"
    mean, low, high = statistics.fmean(values), min(values), max(values)
    return f"<td>{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]</td>"


def write_comparison(run_dirs: list[str], out_dir: str) -> str:
    """Write one ``report.html`` (and ``plots/*.png``) in ``out_dir`` that overlays the runs in
    ``run_dirs``; returns the HTML's path.

    Args:
        run_dirs: the runs' output directories (each holds ``metrics.jsonl``), each given once.
        out_dir: the folder for the page and its plots
            (:func:`~rlhf_torchrl.record.report_command.report_dir` picks and checks it).
    """
    runs = [(label, *read_run(d)) for label, d in zip(run_labels(run_dirs), run_dirs)]
    plots_dir = os.path.join(out_dir, "plots")
    os.makedirs(plots_dir, exist_ok=True)
    xlim = x_limits(max(last_iteration(rows) for _, rows, _ in runs))
    figures = []
    for name, title, key, ylabel in COMPARED:
        fig = _figure(runs, key, title, ylabel, xlim)
        if fig is not None:
            figures.append((title, save_figure(fig, os.path.join(plots_dir, f"{name}.png"))))
    esc = html.escape
    numbers = [_figures(rows, summary) for _, rows, summary in runs]
    table = ["<table id='runs'><tr><th>run</th><th>iterations</th><th>verdict</th><th>flags</th>"
             + "".join(f"<th>{esc(title)}</th>" for title, _, _ in COLUMNS) + "</tr>"]
    for (label, rows, summary), figs, run_dir in zip(runs, numbers, run_dirs):
        found = assess(rows, summary)
        table.append(
            f"<tr><td title='{esc(os.path.abspath(run_dir))}'>{esc(label)}</td>"
            f"<td>{sum(1 for r in rows if 'objective/scores' in r)}</td><td>{esc(found.call)}</td>"
            f"<td>{esc(', '.join(f.name for f in found.flags)) or 'none'}</td>"
            + "".join(_cell(figs, names, fmt) for _, names, fmt in COLUMNS) + "</tr>")
    table.append("<tr><th colspan='4'>mean [min, max] across the runs (the last figure)</th>"
                 + "".join(_spread_cell(numbers, names, fmt) for _, names, fmt in COLUMNS)
                 + "</tr></table>")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>PPO runs compared</title>",
        STYLE,
        "</head><body>",
        f"<h1>PPO runs compared</h1><p>{len(runs)} runs: "
        + ", ".join(esc(os.path.abspath(d)) for d in run_dirs) + "</p>",
        "<h2>At a glance</h2>", "".join(table),
        f"<h2>Plots</h2><p>Each run a thin line; across the runs, their mean (black) and their "
        f"min-max band (grey: the lowest and the highest run), at the iterations every run "
        f"reached. x-axis: the {X_LABEL}, counted from 1; a held-out evaluation at the "
        f"iteration whose update it follows, the one before training at 0.</p>",
        "".join(f"<img alt='{esc(t)}' title='{esc(t)}' src='data:image/png;base64,{data}'>"
                for t, data in figures),
        "<h2>Each run's verdict</h2>",
    ]
    for label, rows, summary in runs:
        parts.append(f"<h3>{esc(label)}</h3><ul class='verdict' data-run='{esc(label)}'>"
                     + verdict_items(rows, summary) + "</ul>")
    parts.append("</body></html>")
    out = os.path.join(out_dir, "report.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return out
