"""The run's verdict: did the held-out score rise past its noise, and four flags for what a rising
score can hide (a flat held-out score, falling diversity, a KL runaway, a length collapse), each
against a threshold defined here.

The call (``up``, ``down`` or ``flat``) is the held-out score's, before training against after;
the training score decides only for a run without a held-out evaluation. A training score that
rose while the held-out score stayed flat is called ``flat``, never ``up``:

    >>> rows = [{"iteration": i, "objective/scores": 0.1 * i, "objective/kl": 1.0}
    ...         for i in range(8)]
    >>> held_out = {"eval_before": {"eval/score": 0.5}, "eval_after": {"eval/score": 0.5}}
    >>> found = assess(rows, held_out)
    >>> found.call, [flag.name for flag in found.flags]
    ('flat', ['flat_held_out'])
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from rlhf_torchrl.record.metrics import number

#: the held-out score's noise, in standard errors of the change: a change within NOISE_SE x
#: sqrt(sem_before² + sem_after²) (``eval/score_sem``: the standard error of each evaluation's
#: mean over its prompts) is flat
NOISE_SE = 2.0
#: the noise band where the run logged no ``eval/score_sem`` (rows written before it was): an
#: absolute change of the held-out score, on the score's own scale
FLAT_SCORE_BAND = 0.02
#: falling diversity: held-out distinct-2 after training below (1 - DIVERSITY_DROP) x before
DIVERSITY_DROP = 0.10
#: a KL runaway: the mean KL to the reference over the last quarter of the iterations past this
#: many nats per response ...
KL_RUNAWAY_NATS = 5.0
#: ... or still growing fast: the last quarter's mean at least KL_GROWTH_RATIO x the quarter
#: before's, and past KL_GROWTH_MIN_NATS (a KL of 0.01 doubling early on is no runaway)
KL_GROWTH_RATIO = 2.0
KL_GROWTH_MIN_NATS = 1.0
#: a length collapse: the mean response length (training: last quarter against first; held-out:
#: after against before) below LENGTH_COLLAPSE_FRAC of its start ...
LENGTH_COLLAPSE_FRAC = 0.5
#: ... or below this many tokens (the stop token alone is one) from a start at or above it
LENGTH_MIN_TOKENS = 2.0

#: the flags, in the order the report lists them, and their one-phrase titles
FLAGS = {
    "flat_held_out": "flat held-out score",
    "falling_diversity": "falling diversity",
    "kl_runaway": "KL runaway",
    "length_collapse": "length collapse",
}


@dataclass(frozen=True)
class Flag:
    """A warning about the run: its name (a key of :data:`FLAGS`) and what was measured against
    which threshold."""

    name: str
    message: str

    @property
    def title(self) -> str:
        return FLAGS[self.name]


@dataclass
class Assessment:
    """What :func:`assess` found.

    Attributes:
        call: ``"up"``, ``"down"`` or ``"flat"`` (the held-out score), or, without a held-out
            evaluation, the training score's trend (``"up"``, ``"down"``, ``"no clear change"``);
            ``"no iteration finished"`` for a run with none.
        held_out: whether the call is the held-out score's.
        flags: the flags raised, in :data:`FLAGS`' order.
        lines: the findings in plain language (training score, KL, held-out score, accuracy,
            distinct-2, win rate, skipped iterations).
    """

    call: str
    held_out: bool
    flags: list[Flag] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def headline(self) -> str:
        """One line: the call, on what, and the flags raised."""
        where = ("on the held-out prompts" if self.held_out
                 else "(the training score: no held-out evaluation to check it on)")
        flags = (f"{len(self.flags)} flag{'s' if len(self.flags) > 1 else ''}: "
                 + ", ".join(f.title for f in self.flags)) if self.flags else "no flags"
        if self.call == "no iteration finished":
            return "Verdict: no iteration finished."
        return f"Verdict: {self.call} {where}; {flags}."


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


def held_out_noise(before: dict, after: dict) -> tuple[float, str]:
    """``(band, how)``: the largest change of the held-out score that is noise, and how it was
    measured: ``NOISE_SE * sqrt(sem_before² + sem_after²)`` from the two evaluations'
    ``eval/score_sem``, else :data:`FLAT_SCORE_BAND`.

    Args:
        before: the evaluation's metrics before training.
        after: its metrics after training.
    """
    sems = [before.get("eval/score_sem"), after.get("eval/score_sem")]
    if all(isinstance(s, (int, float)) and math.isfinite(s) for s in sems):
        return (NOISE_SE * math.hypot(*sems),
                f"{NOISE_SE:g} standard errors of the change over the held-out prompts")
    return FLAT_SCORE_BAND, "the fixed band: the run logged no eval/score_sem"


def _quarter_means(values: list[float]) -> tuple[float, float, int]:
    """The means of the first and the last quarter of ``values``, and the quarter's length."""
    k = max(1, len(values) // 4)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:]), k


def _length_collapsed(start: float, end: float) -> bool:
    return end < LENGTH_COLLAPSE_FRAC * start or start >= LENGTH_MIN_TOKENS > end


def assess(rows: list[dict], summary: dict) -> Assessment:
    """The run's call, its flags and its findings, from its metric rows and ``report.json``.

    Args:
        rows: the run's metric rows (``metrics.jsonl``).
        summary: the run's ``report.json`` (``eval_before``, ``eval_after``; ``{}`` for none).
    """
    trained = [r for r in rows if "objective/scores" in r]
    if not trained:
        return Assessment("no iteration finished", False)
    first, last, call, k = trend([r["objective/scores"] for r in trained])
    kls = [r["objective/kl"] for r in trained if "objective/kl" in r]
    kl = statistics.fmean(kls[-k:]) if kls else float("nan")
    quarter = f"first/last {k} iteration{'s' if k > 1 else ''}"
    found = Assessment(call, False)
    found.lines.append(f"Training score {first:+.3f} -> {last:+.3f} ({call}; {quarter}); KL to "
                       f"the reference {number(kl, '.2f')} nats per response at the end.")
    flags = {}
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if "eval/score" in before and "eval/score" in after:
        s0, s1 = before["eval/score"], after["eval/score"]
        band, how = held_out_noise(before, after)
        found.held_out = True
        found.call = "up" if s1 - s0 > band else "down" if s0 - s1 > band else "flat"
        found.lines.append(f"Held-out score (the same prompts, temperature of eval) {s0:+.3f} -> "
                           f"{s1:+.3f}: {found.call} (noise ±{band:.3f}: {how}).")
        if found.call == "flat":
            rose = " while the training score rose" if call == "up" else ""
            flags["flat_held_out"] = (
                f"held-out score {s0:+.3f} -> {s1:+.3f}, a change of {s1 - s0:+.3f} within the "
                f"noise ±{band:.3f}{rose}: the policy did not get better on prompts it did not "
                f"train on.")
    if "eval/accuracy" in before and "eval/accuracy" in after:
        found.lines.append(f"Held-out accuracy {before['eval/accuracy']:.3f} -> "
                           f"{after['eval/accuracy']:.3f}.")
    if "eval/distinct_2" in before and "eval/distinct_2" in after:
        d0, d1 = before["eval/distinct_2"], after["eval/distinct_2"]
        found.lines.append(f"Held-out distinct-2 {d0:.2f} -> {d1:.2f}.")
        if d1 < (1 - DIVERSITY_DROP) * d0:
            collapsed = ("; halved: the responses collapsed towards a few phrasings"
                         if d1 < 0.5 * d0 else "")
            flags["falling_diversity"] = (
                f"held-out distinct-2 {d0:.2f} -> {d1:.2f}, {1 - d1 / d0:.0%} lower (flagged "
                f"past {DIVERSITY_DROP:.0%}){collapsed}.")
    if "eval/win_rate" in after:
        found.lines.append(f"Held-out win rate against the reference: {after['eval/win_rate']:.2f}.")
    if kls:
        kl_first, kl_last, k_kl = _quarter_means(kls)
        previous = statistics.fmean(kls[-2 * k_kl:-k_kl]) if len(kls) >= 8 else None
        if kl_last > KL_RUNAWAY_NATS:
            flags["kl_runaway"] = (
                f"KL to the reference {kl_last:.2f} nats per response over the last {k_kl} "
                f"iterations, past {KL_RUNAWAY_NATS:g}.")
        elif (previous is not None and kl_last > KL_GROWTH_MIN_NATS
              and kl_last >= KL_GROWTH_RATIO * previous):
            flags["kl_runaway"] = (
                f"KL to the reference still growing fast: {previous:.2f} -> {kl_last:.2f} nats "
                f"per response over the last two quarters of the run (flagged at "
                f"{KL_GROWTH_RATIO:g}x, past {KL_GROWTH_MIN_NATS:g} nats).")
    collapses = []
    lengths = [r["val/sequence_lengths"] for r in trained if "val/sequence_lengths" in r]
    if len(lengths) >= 2:
        l0, l1, k_len = _quarter_means(lengths)
        if _length_collapsed(l0, l1):
            collapses.append(f"training responses {l0:.1f} -> {l1:.1f} tokens (first/last {k_len} "
                             f"iteration{'s' if k_len > 1 else ''})")
    if "eval/response_length" in before and "eval/response_length" in after:
        l0, l1 = before["eval/response_length"], after["eval/response_length"]
        if _length_collapsed(l0, l1):
            collapses.append(f"held-out responses {l0:.1f} -> {l1:.1f} tokens")
    if collapses:
        flags["length_collapse"] = (
            "; ".join(collapses) + f": below {LENGTH_COLLAPSE_FRAC:.0%} of the start, or under "
            f"{LENGTH_MIN_TOKENS:g} tokens.")
    found.flags = [Flag(name, flags[name]) for name in FLAGS if name in flags]
    skipped = sum(1 for r in rows if r.get("guard/skipped"))
    if skipped:
        found.lines.append(f"{skipped} iteration(s) skipped by the divergence guards.")
    return found


def verdict(rows: list[dict], summary: dict) -> list[str]:
    """Plain-language findings: the verdict's headline, then did the score rise (training and
    held-out), did the KL stay bounded, did the responses stay varied, and each flag raised.

    Args:
        rows: the run's metric rows.
        summary: the run's ``report.json``.
    """
    found = assess(rows, summary)
    return ([found.headline] + found.lines
            + [f"Flag {f.name}: {f.message}" for f in found.flags])
