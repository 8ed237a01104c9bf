"""The plot of each benchmark's figures, drawn from its ``--out`` JSON payload.

``rlhf-torchrl bench <name> --out runs/x.json`` writes ``runs/x.png`` beside the JSON
(:func:`save`, called by :func:`~rlhf_torchrl.benchmarks.common.finish`); :data:`PLOTS` holds
one drawing function per benchmark, ``payload -> figure`` (None: nothing to draw), so an old
JSON file can be drawn again: ``save(PLOTS[name], json.load(open(path)), "x.png")``.
"""

from __future__ import annotations

import os
import sys

#: the phases of an iteration, in the order they run (ppo_iteration, scaling, gpu_suite)
PHASES = ("generation", "scoring", "old_quantities", "advantages", "update")


def plot_path(out: str) -> str:
    """The plot's path for ``--out``: the JSON's, ending in ``.png``."""
    return os.path.splitext(out)[0] + ".png"


def save(draw, payload: dict, path: str) -> str | None:
    """Draw ``payload`` with ``draw`` (a function of :data:`PLOTS`) into the PNG at ``path``;
    returns the path, or None where there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt, payload)
    if fig is None:
        return None
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def _subtitle(payload: dict) -> str:
    args, machine = payload.get("args", {}), payload.get("machine", {})
    parts = [str(args["model"])] if args.get("model") else []
    if machine.get("threads"):
        parts.append(f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}")
    if machine.get("date"):
        parts.append(str(machine["date"]))
    return ", ".join(parts)


def _by_length(payload: dict, series: dict[str, str], ylabel: str, title: str, plt):
    """One panel per response length: ``series`` (label -> result field) against batch size."""
    rows = payload.get("results", [])
    lengths = sorted({r["length"] for r in rows})
    if not lengths:
        return None
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        cell = sorted((r for r in rows if r["length"] == length), key=lambda r: r["batch_size"])
        for label, field in series.items():
            if all(field in r for r in cell):
                ax.plot([r["batch_size"] for r in cell], [r[field] for r in cell], "o-", label=label)
        sizes = [r["batch_size"] for r in cell]
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set(title=f"{length} tokens per response", xlabel="batch size (responses)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title} ({_subtitle(payload)})", fontsize=10)
    return fig


def collectors(plt, payload: dict):
    return _by_length(payload, {"collector": "collector_tokens_per_s",
                                "bare generate, same sampler": "generate_tokens_per_s",
                                "HF multinomial generate": "hf_generate_tokens_per_s"},
                      "response tokens/s", "Collector against a raw generate", plt)


def backends(plt, payload: dict):
    names = payload.get("backends_found") or payload.get("args", {}).get("backends", [])
    return _by_length(payload, {name: f"{name}_tokens_per_s" for name in names},
                      "response tokens/s", "Generation backends", plt)


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))], values,
               width, label=label)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def ppo_iteration(plt, payload: dict):
    ours, floor = payload.get("ours"), payload.get("floor")
    if not ours or not floor:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    _grouped_bars(ax, [*PHASES, "total"], {"ours": [ours[p] for p in (*PHASES, "total")],
                                           "floor (bare model calls)": [floor[p] for p in (*PHASES, "total")]})
    ax.set(ylabel="seconds (median)", title=f"PPO iteration by phase ({_subtitle(payload)})")
    ax.legend(fontsize=8)
    return fig


def _stacked_phases(plt, runs: dict[str, dict], title: str):
    """One bar per run, its phases stacked (seconds per iteration)."""
    if not runs:
        return None
    names = list(runs)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 3.6))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        values = [float(runs[n].get(phase, 0.0)) for n in names]
        ax.bar(names, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="seconds per iteration (median)", title=title)
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return fig


def scaling(plt, payload: dict):
    return _stacked_phases(plt, payload.get("variants", {}),
                           f"The recipe by variant ({_subtitle(payload)})")


def gpu_suite(plt, payload: dict):
    return _stacked_phases(plt, payload.get("recipe", {}),
                           f"The recipe on {payload.get('gpu', 'a GPU')} ({_subtitle(payload)})")


def real_sizes(plt, payload: dict):
    """Each model's recipe variants, phases stacked, beside verl's published step."""
    runs = {f"{model} {variant}": figures
            for model, entry in payload.get("models", {}).items()
            for variant, figures in entry.items() if variant != "floor" and "total" in figures}
    verl = payload.get("verl", {}).get("seconds")
    if verl:
        runs["verl 0.5B (published)"] = {"generation": verl["generation"],
                                         "old_quantities": verl["old_quantities"],
                                         "update": verl["update"]}
    profile = payload.get("profile", {})
    gpu = profile.get("name") or profile.get("device", "a GPU")  # (the first results: "device")
    return _stacked_phases(plt, runs, f"Real sizes on {gpu}, verl's quickstart settings")


def vs_trl(plt, payload: dict):
    median = payload.get("median_seconds")
    if not median:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(list(median), list(median.values()), color=["tab:gray", "tab:blue"][: len(median)])
    left.set(ylabel="seconds per iteration (median)", title="time per iteration")
    for side, runs in payload.get("runs", {}).items():
        if runs:
            right.plot(runs[0]["scores"], label=side)
    right.set(xlabel="iteration", ylabel="mean score", title="reward curve (first run)")
    right.legend(fontsize=8)
    fig.suptitle(f"TRL's PPOTrainer and rlhf_torchrl ({_subtitle(payload)})", fontsize=10)
    return fig


def estimators_table(plt, payload: dict):
    import statistics

    runs = {name: list(seeds.values()) for name, seeds in payload.get("runs", {}).items() if seeds}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = list(runs)
    after = [statistics.fmean(f["after"] for f in runs[n]) for n in names]
    spread = [statistics.stdev(f["after"] for f in runs[n]) if len(runs[n]) > 1 else 0.0
              for n in names]
    ax.bar(names, after, yerr=spread, capsize=4, label="after training (mean, std over seeds)")
    ax.plot(names, [statistics.fmean(f["before"] for f in runs[n]) for n in names], "k_",
            markersize=20, label="before")
    ax.set(ylabel="held-out figure", title=f"Advantage estimators on {payload['args'].get('task')}")
    ax.legend(fontsize=8)
    return fig


def data_loading(plt, payload: dict):
    rows = payload.get("results", [])
    if not rows:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for form in sorted({r["form"] for r in rows}):
        cell = sorted((r for r in rows if r["form"] == form), key=lambda r: r["rows"])
        for when, style in (("cold", "o--"), ("warm", "o-")):
            left.plot([r["rows"] for r in cell], [r[when]["start_s"] for r in cell], style,
                      label=f"{form}, {when}")
            right.plot([r["rows"] for r in cell], [r[when]["peak_rss_mb"] for r in cell], style,
                       label=f"{form}, {when}")
    left.set(xscale="log", yscale="log", xlabel="prompts", ylabel="seconds to the first batch",
             title="start-up")
    right.set(xscale="log", xlabel="prompts", ylabel="peak resident set (MB)", title="memory")
    left.legend(fontsize=7)
    return fig


def reward_server(plt, payload: dict):
    rows = sorted(payload.get("results", []), key=lambda r: r["clients"])
    if not rows:
        return None
    clients = [r["clients"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(clients, [r["p50_ms"] for r in rows], "o-", label="p50")
    left.plot(clients, [r["p99_ms"] for r in rows], "o--", label="p99")
    left.set(xlabel="concurrent clients", ylabel="latency per request (ms)", title="latency")
    left.legend(fontsize=8)
    right.plot(clients, [r["responses_per_s"] for r in rows], "o-")
    right.set(xlabel="concurrent clients", ylabel="responses scored per second", title="throughput")
    fig.suptitle(f"A served reward model under load ({_subtitle(payload)})", fontsize=10)
    return fig


def partial_rollout(plt, payload: dict):
    modes = payload.get("modes", {})
    if not modes:
        return None
    names = list(modes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    _grouped_bars(left, names, {"iteration": [modes[n]["seconds_per_iteration"] for n in names],
                                "generation": [modes[n]["generation_seconds"] for n in names]})
    left.set(ylabel="seconds (median)", title="seconds per iteration")
    left.legend(fontsize=8)
    _grouped_bars(right, names, {"of generation": [modes[n]["tokens_per_second_generation"] for n in names],
                                 "of the iteration": [modes[n]["tokens_per_second_iteration"] for n in names]})
    right.set(ylabel="response tokens trained per second", title="throughput")
    right.legend(fontsize=8)
    fig.suptitle(f"Partial rollouts against whole responses ({_subtitle(payload)})", fontsize=10)
    return fig


def balance(plt, payload: dict):
    """Per layout, the update's seconds unbalanced and balanced: the slowest process's wall clock,
    and the slowest process of each minibatch's busy seconds, summed."""
    layouts = payload.get("layouts", {})
    if not layouts:
        return None
    names = list(layouts)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, figure, title in ((left, "seconds", "slowest process, wall clock"),
                              (right, "critical_busy_seconds", "slowest per minibatch, busy CPU")):
        _grouped_bars(ax, names, {way: [layouts[n][way][figure] for n in names]
                                  for way in ("unbalanced", "balanced")})
        ax.set(ylabel="seconds per update (median)", title=title)
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
    fig.suptitle(f"distributed.balance on ragged responses ({_subtitle(payload)})", fontsize=10)
    return fig


def compare(plt, payload: dict):
    """Each shared figure of the compared files as its ratio to the first file's."""
    files, metrics = payload["files"], payload["metrics"]
    names = [m for m, values in metrics.items() if values[0]]
    if not names or len(files) < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.28 * len(names) * (len(files) - 1)))
    height = 0.8 / (len(files) - 1)
    for k, label in enumerate(files[1:], start=1):
        ratios = [metrics[m][k] / metrics[m][0] for m in names]
        ax.barh([i + (k - 1 - (len(files) - 2) / 2) * height for i in range(len(names))], ratios,
                height, label=f"{payload['labels'][k]}: {label}")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel=f"ratio to {payload['labels'][0]} ({files[0]})", title="Shared figures")
    ax.legend(fontsize=7)
    return fig


def judge_sentiment(plt, payload: dict):
    """Per reward (the judge's p(yes), VADER), its held-out mean before and after training on
    each arm, averaged over the seeds."""
    runs = payload.get("runs") or {}
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, (key, title) in zip(axes, (("eval_judge", "held-out judge p(yes)"),
                                        ("eval_vader", "held-out VADER"))):
        series = {}
        for i, when in enumerate(("before", "after")):
            series[when] = [sum(f[key][i] or 0.0 for f in seeds.values()) / len(seeds)
                            for seeds in runs.values()]
        _grouped_bars(ax, [f"trained on {arm}" for arm in runs], series)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return fig


def distillation(plt, payload: dict):
    """Held-out VADER against updates, per arm: each seed thin, the arm's mean thick."""
    runs = payload.get("runs") or {}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (arm, seeds), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green")):
        points: dict[int, list[float]] = {}
        for f in seeds.values():
            xs, ys = zip(*f["curve"])
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
            for x, y in f["curve"]:
                points.setdefault(x, []).append(y)
        xs = sorted(points)
        ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], color=color, linewidth=2.5,
                label=f"trained on {arm} (mean of {len(seeds)})")
    ax.set(xlabel="updates", ylabel="held-out VADER",
           title="Sentiment: a student taught by a PPO-trained teacher, and PPO on the reward")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    return fig



def process_rewards(plt, payload: dict):
    """Held-out accuracy against updates, per arm (outcome reward alone, and with the per-step
    verifier): each seed thin, the arm's mean thick."""
    import statistics

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (arm, seeds), color in zip(payload["runs"].items(), ("tab:blue", "tab:orange")):
        points: dict[int, list[float]] = {}
        for f in seeds.values():
            xs, ys = zip(*f["curve"])
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
            for x, y in f["curve"]:
                points.setdefault(x, []).append(y)
        xs = sorted(points)
        ax.plot(xs, [statistics.fmean(points[x]) for x in xs], color=color, linewidth=2.5,
                label=f"{arm} (mean of {len(seeds)})")
    ax.set(xlabel="updates", ylabel="held-out accuracy",
           title="Arithmetic: outcome reward alone, and with the per-step verifier")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    return fig

def plan_check(plt, payload: dict):
    """Per size, plan / measured for the peak memory and each phase's seconds, the 20% band."""
    sizes = [e for e in payload.get("sizes", []) if "compare" in e]
    if not sizes:
        return None
    figures = list(sizes[0]["compare"])
    fig, ax = plt.subplots(figsize=(8, 4))
    _grouped_bars(ax, [e["size"] for e in sizes],
                  {f: [e["compare"][f]["ratio"] for e in sizes] for f in figures})
    target = payload.get("target", 0.2)
    ax.axhspan(1 - target, 1 + target, color="green", alpha=0.1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("plan / measured")
    ax.set_title(f"rlhf-torchrl plan against the run, {payload.get('machine', {}).get('cpu', 'CPU')}"
                 f" ({_subtitle(payload)})", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def overlong(plt, payload: dict):
    """The held-out share of responses cut by the length limit against updates, with and without
    overlong shaping: each seed thin, the arm's mean thick."""
    import statistics

    runs = payload.get("runs") or {}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (arm, seeds), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        points: dict[int, list[float]] = {}
        for f in seeds.values():
            xs, ys = zip(*f["curve"])
            ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
            for x, y in f["curve"]:
                points.setdefault(x, []).append(y)
        xs = sorted(points)
        ax.plot(xs, [statistics.fmean(points[x]) for x in xs], color=color, linewidth=2.5,
                label=f"{arm} (mean of {len(seeds)})")
    ax.set(xlabel="updates", ylabel="held-out share cut by the limit",
           title="Overlong shaping: responses cut by generation.max_new_tokens")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    return fig


def soak(plt, payload: dict):
    """Seconds per iteration and the resident set against the iteration, per segment (before and
    after the kill), the kill and the resume marked; beside the seconds, the fixed probe's
    milliseconds per block (the machine's speed; in older files the load average)."""
    segments = payload.get("segments") or []
    if not segments:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    load_ax = top.twinx()
    colors = ("tab:blue", "tab:orange")
    for k, (segment, blocks) in enumerate(zip(segments, payload.get("blocks", [[]] * 2))):
        rows, samples, color = segment["rows"], segment["samples"], colors[k % 2]
        label = "before the kill" if k == 0 else "resumed"
        ticks = set(map(int, segment.get("eval_s", {}))) | set(map(int, segment.get("checkpoint_s", {})))
        plain = [(i, s) for i, s in zip(rows["iteration"], rows["seconds"])
                 if s is not None and i not in ticks]
        if plain:
            top.plot(*zip(*plain), ".", color=color, markersize=1.5, alpha=0.35)
        middle = [(b["iterations"][0] + b["iterations"][1]) / 2 for b in blocks]
        top.plot(middle, [b["seconds"] for b in blocks], "-", color=color, linewidth=2,
                 label=f"{label}: median time/total per block")
        top.plot(middle, [b["wall_seconds"] for b in blocks], "--", color=color, linewidth=1,
                 label=f"{label}: wall clock per block")
        probes = [(m, b["probe_ms"]) for m, b in zip(middle, blocks) if b.get("probe_ms")]
        if probes:  # the machine's speed per block (older files: the load average)
            load_ax.plot(*zip(*probes), "x", color="black", markersize=4)
        else:
            known = [(i, load) for i, load in zip(samples["iteration"], samples["load"])
                     if i is not None]
            if known:
                load_ax.plot(*zip(*known), color="gray", linewidth=0.6, alpha=0.5)
        bottom.plot(rows["iteration"], rows["rss_mb"], "-", color=color, linewidth=1,
                    label=f"{label}: VmRSS")
        # (a sample of the resource tracker alone as the run exited: older files hold one)
        floor = 0.5 * min((r for r in rows["rss_mb"] if r), default=0.0)
        known = [(i, h) for i, h, r in zip(samples["iteration"], samples["hwm_mb"], samples["rss_mb"])
                 if i is not None and r and r > floor]
        if known:
            bottom.plot(*zip(*known), ":", color=color, linewidth=1.2, label=f"{label}: VmHWM (peak)")
    for ax in (top, bottom):
        killed = segments[0].get("last_row_written") or segments[0].get("killed_after")
        if killed is not None:
            ax.axvline(killed, color="red", linewidth=1, label="SIGKILL" if ax is bottom else None)
        if len(segments) > 1:
            ax.axvline(segments[1]["first_iteration"], color="red", linestyle=":", linewidth=1,
                       label="resumed from its checkpoint" if ax is bottom else None)
        ax.grid(alpha=0.3)
    probed = any(b.get("probe_ms") for blocks in payload.get("blocks", []) for b in blocks)
    load_ax.set_ylabel("fixed probe, ms per block (x)" if probed else "load average (1 min, gray)",
                       fontsize=8)
    top.set_ylabel("seconds per iteration")
    figures = [b[f] for blocks in payload.get("blocks", []) for b in blocks
               for f in ("seconds", "wall_seconds") if b.get(f)]
    top.set_ylim(0, 2.5 * max(figures) if figures else None)  # a few slow iterations cut off
    load_ax.set_ylim(bottom=0)
    bottom.set(xlabel="iteration", ylabel="resident set (MB)")
    top.legend(fontsize=7, loc="upper left", ncol=2)
    bottom.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Soak: {payload.get('args', {}).get('iterations')} iterations, killed and resumed "
                 f"({_subtitle(payload)})", fontsize=10)
    return fig


#: benchmark name -> its drawing function
PLOTS = {"ppo_iteration": ppo_iteration, "collectors": collectors, "backends": backends,
         "scaling": scaling, "vs_trl": vs_trl, "gpu_suite": gpu_suite,
         "real_sizes": real_sizes, "plan_check": plan_check,
         "estimators": estimators_table, "estimators_table": estimators_table, "data_loading": data_loading,
         "reward_server": reward_server, "partial_rollout": partial_rollout, "compare": compare,
         "judge_sentiment": judge_sentiment,
         "process_rewards": process_rewards, "overlong": overlong, "distillation": distillation,
         "balance": balance, "soak": soak}
