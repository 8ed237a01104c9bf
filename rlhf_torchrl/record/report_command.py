"""The ``rlhf-torchrl report`` command: the report of one run, or one page that overlays
several; where it goes, checked before any work.

    rlhf-torchrl report outputs/ppo/<run>                       # <run>/report.html
    rlhf-torchrl report runs/seed0 runs/seed1 runs/seed2        # runs/report.html
    rlhf-torchrl report runs/a runs/b --out runs/compare        # runs/compare/report.html
"""

from __future__ import annotations

import argparse
import os
import textwrap

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.record import verdict as v
from rlhf_torchrl.record.compare import write_comparison
from rlhf_torchrl.record.report import check_run, write_report


def report_dir(run_dirs: list[str], out_dir: str | None) -> str:
    """Where the report of ``run_dirs`` goes, after checking, before any work, that each is a run
    directory given once: ``out_dir``, else the run's own folder (one run) or the runs' common
    parent folder (several). The report of several runs never replaces a run's own.

    Args:
        run_dirs: the runs' output directories.
        out_dir: the folder asked for (None: the default).
    """
    seen = set()
    for run_dir in run_dirs:
        check_run(run_dir)
        if os.path.realpath(run_dir) in seen:
            raise ConfigError(f"{run_dir} is given twice: give each run once.")
        seen.add(os.path.realpath(run_dir))
    if out_dir is not None and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir} is a file: give a folder (report.html and plots/ go "
                          f"into it).")
    if len(run_dirs) == 1:
        out = out_dir or run_dirs[0]
        if os.path.realpath(out) not in seen and os.path.isfile(os.path.join(out, "metrics.jsonl")):
            raise ConfigError(f"--out {out} is another run's directory: its report.html would be "
                              f"replaced; give a folder that holds no run.")
        return out
    out = out_dir or os.path.commonpath([os.path.abspath(d) for d in run_dirs])
    if os.path.isfile(os.path.join(out, "metrics.jsonl")):
        where = f"--out {out}" if out_dir else f"the runs' common folder, {out},"
        raise ConfigError(f"{where} is a run directory: its own report.html would be replaced; "
                          f"give --out a folder that holds no run.")
    return out


def _description() -> str:
    """``--help``'s text, its thresholds read from :mod:`rlhf_torchrl.record.verdict`."""
    paragraphs = [
        "Write report.html for a PPO run directory, or one page that overlays several runs "
        "(seeds, settings).",
        "One run: report.html and plots/ in the run's folder (or --out), as the recipe writes at "
        "the end of every run. Several runs: their training score, KL to the reference, held-out "
        "score and held-out distinct-2 on the same plots, with the mean across the runs and "
        "their min-max band (at the iterations every run reached), and each run's verdict and "
        "flags in a table; written to --out, by default the runs' common parent folder. Every "
        "plot's x-axis is the iteration (0: before training).",
        f"The verdict calls the held-out score up, down or flat: flat within {v.NOISE_SE:g} "
        f"standard errors of its change over the held-out prompts (eval/score_sem; without it, "
        f"within {v.FLAT_SCORE_BAND:g}). Flags: flat_held_out; falling_diversity (held-out "
        f"distinct-2 down by more than {v.DIVERSITY_DROP:.0%}); kl_runaway (the last quarter's "
        f"KL past {v.KL_RUNAWAY_NATS:g} nats per response, or {v.KL_GROWTH_RATIO:g}x the "
        f"quarter before's and past {v.KL_GROWTH_MIN_NATS:g}); length_collapse (the mean "
        f"response length below {v.LENGTH_COLLAPSE_FRAC:.0%} of its start, or under "
        f"{v.LENGTH_MIN_TOKENS:g} tokens). Documented in docs/evaluation.md, \"The run report\".",
    ]
    return "\n\n".join(textwrap.fill(p, 90) for p in paragraphs)


def main(argv=None, prog: str | None = None) -> None:
    """``rlhf-torchrl report RUN [RUN ...] [--out DIR]``: write the report of one run
    (:func:`~rlhf_torchrl.record.report.write_report`), or of several overlaid
    (:func:`~rlhf_torchrl.record.compare.write_comparison`), and print its path.

    Args:
        argv (list[str] | None): the command-line arguments (None: ``sys.argv[1:]``).
        prog: the command's name in ``--help`` (None: argparse's).
    """
    parser = argparse.ArgumentParser(prog=prog, description=_description(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN",
                        help="a run's output directory (it holds metrics.jsonl); several to overlay")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="the folder for report.html and plots/ (default: the run's folder; "
                             "for several runs, their common parent folder)")
    args = parser.parse_args(argv)
    out_dir = report_dir(args.run_dirs, args.out)
    if len(args.run_dirs) == 1:
        print(write_report(args.run_dirs[0], out_dir))
    else:
        print(write_comparison(args.run_dirs, out_dir))
