"""The report of an evaluation: one self-contained HTML page from its ``eval.json``.

:func:`write_eval_report` writes ``report.html`` beside ``eval.json`` (the ``evaluate`` command
does, at its end): the settings, each metric with its 95% interval, pass@k and maj@k against k
(a table and an inline SVG plot: no network, no image files), and every prompt with its verdicts
and first response. On demand:

    python -m rlhf_torchrl.record.eval_report outputs/evaluate/<evaluation>
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re

from rlhf_torchrl.errors import MissingFileError

#: prompts listed in the page (eval.json holds them all)
MAX_PROMPTS = 200

_STYLE = ("<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
          "td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}"
          "td.num{text-align:right;font-variant-numeric:tabular-nums}"
          "pre{white-space:pre-wrap;margin:0;font-size:90%}</style>")
_SETTINGS = ("policy", "reference", "prompts", "num_prompts", "samples_per_prompt", "temperature",
             "max_new_tokens", "k", "seed")


def read_evaluation(folder: str) -> dict:
    """The ``eval.json`` of an evaluation's folder.

    Args:
        folder: the evaluation's output directory.
    """
    path = os.path.join(folder, "eval.json")
    if not os.path.isfile(path):
        raise MissingFileError(f"{folder} has no eval.json: not an evaluation's folder "
                               "(rlhf-torchrl evaluate writes one).")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_eval_report(folder: str) -> str:
    """Write ``<folder>/report.html`` for the evaluation in ``folder``; returns its path.

    Args:
        folder: the evaluation's output directory (its ``eval.json``).
    """
    found = read_evaluation(folder)
    esc = html.escape
    metrics = {k: v for k, v in found.items() if k.startswith("eval/") and not k.endswith("_ci95")}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Evaluation of "
             f"{esc(str(found.get('policy')))}</title>{_STYLE}</head><body>",
             f"<h1>Evaluation of {esc(str(found.get('policy')))}</h1>",
             "<h2>Settings</h2><table id='settings'>"]
    parts += [f"<tr><th>{key}</th><td>{esc(json.dumps(found[key]))}</td></tr>"
              for key in _SETTINGS if key in found]
    parts.append("</table><h2>Metrics</h2><p>Means over the prompts; the interval is the normal "
                 "95% interval over prompts (the mean &plusmn; 1.96 standard errors), cut to "
                 "[0, 1]: with few prompts, a rough one.</p>"
                 "<table id='metrics'><tr><th>metric</th><th>value</th><th>95% interval</th></tr>")
    for key, value in metrics.items():
        half = found.get(f"{key}_ci95")
        # a share (pass@k, maj@k): the interval within [0, 1], where the normal one may not be
        interval = (f"[{max(value - half, 0.0):.3f}, {min(value + half, 1.0):.3f}]"
                    if half is not None else "")
        parts.append(f"<tr><td>{esc(key)}</td><td class='num'>{value:.3f}</td>"
                     f"<td class='num'>{interval}</td></tr>")
    parts.append("</table>")
    curves = _curves(found)
    if curves:
        ks = sorted({k for points in curves.values() for k in points})
        parts.append("<h2>pass@k and maj@k</h2><table id='at_k'><tr><th>k</th>"
                     + "".join(f"<th>{name}@k</th>" for name in curves) + "</tr>")
        for k in ks:
            cells = "".join(f"<td class='num'>{_with_half(found, f'eval/{name}@{k}')}</td>"
                            for name in curves)
            parts.append(f"<tr><td>{k}</td>{cells}</tr>")
        parts.append("</table>" + _svg_plot(curves))
    parts.append(_prompt_table(found.get("responses") or []))
    parts.append("</body></html>")
    path = os.path.join(folder, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return path


def _curves(found: dict) -> dict[str, dict[int, float]]:
    """``{"pass": {k: value}, "maj": {k: value}}`` of the metrics present."""
    curves: dict[str, dict[int, float]] = {}
    for key, value in found.items():
        match = re.fullmatch(r"eval/(pass|maj)@(\d+)", key)
        if match:
            curves.setdefault(match.group(1), {})[int(match.group(2))] = value
    return curves


def _with_half(found: dict, key: str) -> str:
    if key not in found:
        return ""
    half = found.get(f"{key}_ci95")
    return f"{found[key]:.3f}" + (f" &plusmn; {half:.3f}" if half is not None else "")


def _svg_plot(curves: dict[str, dict[int, float]]) -> str:
    """pass@k and maj@k against k (log2 axis), 0 to 1, as an inline SVG."""
    width, height, pad = 480, 260, 40
    ks = sorted({k for points in curves.values() for k in points})
    span = max(math.log2(ks[-1]), 1.0)

    def xy(k: int, v: float) -> tuple[float, float]:
        return (pad + (width - 2 * pad) * math.log2(k) / span,
                height - pad - (height - 2 * pad) * v)

    out = [f"<svg id='at_k_plot' xmlns='http://www.w3.org/2000/svg' width='{width}' "
           f"height='{height}' font-size='11' font-family='sans-serif'>",
           f"<line x1='{pad}' y1='{height - pad}' x2='{width - pad}' y2='{height - pad}' stroke='#444'/>",
           f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{height - pad}' stroke='#444'/>"]
    for v in (0.0, 0.5, 1.0):
        _, y = xy(1, v)
        out.append(f"<text x='{pad - 6}' y='{y + 4:.1f}' text-anchor='end'>{v:.1f}</text>")
    for k in ks:
        x, _ = xy(k, 0.0)
        out.append(f"<text x='{x:.1f}' y='{height - pad + 14}' text-anchor='middle'>{k}</text>")
    out.append(f"<text x='{width / 2}' y='{height - 6}' text-anchor='middle'>k (samples)</text>")
    for (name, points), color in zip(curves.items(), ("#1f77b4", "#d62728")):
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(k, v) for k, v in sorted(points.items())))
        out.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{line}'/>")
        for k, v in sorted(points.items()):
            x, y = xy(k, v)
            out.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{color}'/>")
        _, y = xy(1, 1.0)
        slot = list(curves).index(name)
        out.append(f"<text x='{width - pad}' y='{y + 14 * slot:.1f}' text-anchor='end' "
                   f"fill='{color}'>{name}@k</text>")
    out.append("</svg>")
    return "".join(out)


def _prompt_table(responses: list[dict]) -> str:
    """Each prompt (the first :data:`MAX_PROMPTS`): its correct samples, the answers they gave,
    its mean score and its first response."""
    esc = html.escape
    prompts: dict[int, list[dict]] = {}
    for i, row in enumerate(responses):
        prompts.setdefault(row.get("prompt_index", i), []).append(row)
    if not prompts:
        return ""
    verified = any("correct" in r for r in responses)
    head = ("<tr><th>#</th><th>prompt</th>" + ("<th>correct</th><th>answers</th>" if verified else "")
            + "<th>mean score</th><th>first response</th></tr>")
    rows = []
    for index, group in list(prompts.items())[:MAX_PROMPTS]:
        first = group[0]
        shown = first.get("question") or first["prompt"]
        cells = [f"<td>{index}</td>",
                 f"<td title=\"{esc(first['prompt'])}\">{esc(shown[-300:])}</td>"]
        if verified:
            answers = sorted({json.dumps(r.get("answer")) for r in group})
            cells.append(f"<td class='num'>{sum(bool(r.get('correct')) for r in group)}/{len(group)}</td>")
            cells.append(f"<td>{esc(', '.join(answers))}</td>")
        mean = sum(r["score"] for r in group) / len(group)
        cells.append(f"<td class='num'>{mean:.3f}</td><td><pre>{esc(first['response'])}</pre></td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    shown = (f"the first {MAX_PROMPTS} of {len(prompts)}; eval.json holds every response"
             if len(prompts) > MAX_PROMPTS else f"all {len(prompts)}")
    return (f"<h2>Prompts</h2><p>Each prompt ({shown}): the whole prompt on hover.</p>"
            f"<table id='prompts'>{head}{''.join(rows)}</table>")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write report.html for an evaluation's folder.")
    parser.add_argument("folder", help="an evaluation's output directory (its eval.json)")
    args = parser.parse_args(argv)
    print(write_eval_report(args.folder))


if __name__ == "__main__":
    main()
