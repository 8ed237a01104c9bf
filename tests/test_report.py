"""Evaluation metrics on known inputs; the verdict and its flags on hand-written metric rows; the
report of several runs overlaid; the run report renders from a finished tiny run."""

import html
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from test_recipe import _cfg, ppo

from rlhf_torchrl import cli
from rlhf_torchrl.record import verdict as V
from rlhf_torchrl.record.compare import across_runs, run_labels
from rlhf_torchrl.record.report import PLOTS, figure, moving_average, points, x_limits
from rlhf_torchrl.record.verdict import assess, held_out_noise, trend, verdict
from rlhf_torchrl.trainers.evaluation import distinct_n, win_rate


def test_distinct_n_by_hand():
    assert distinct_n(["a b c", "a b d"], 1) == pytest.approx(4 / 6)
    assert distinct_n(["a b c", "a b d"], 2) == pytest.approx(3 / 4)  # (a b) twice
    assert distinct_n(["same", "same"], 1) == 0.5 and distinct_n(["x"], 2) == 0.0


def test_win_rate_counts_ties_half():
    assert win_rate(torch.tensor([1.0, 2.0, 0.0, 5.0]), torch.tensor([0.0, 2.0, 1.0, 1.0])) == 0.625


def test_trend_calls_a_change_only_past_the_noise():
    # quarters of 2: means 0.0 and 1.0, spread 0.1 -> clearly up
    assert trend([0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]) == (0.0, 1.0, "up", 2)
    first, last, call, k = trend([0.1, 0.3, 0.2, 0.2, 0.3, 0.1, 0.2, 0.25])
    assert (k, call) == (2, "no clear change") and last == pytest.approx(0.225)
    assert trend([1.0, 1.1, 0.5, 0.5, 0.0, 0.1, 0.0, 0.1])[2] == "down"
    assert trend([0.0, 1.0]) == (0.0, 1.0, "no clear change", 1)  # too short to measure a spread
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_verdict_reads_held_out_accuracy_and_collapse():
    rows = [{"iteration": i, "objective/scores": 0.1 * i, "objective/kl": 1.0} for i in range(8)]
    summary = {"eval_before": {"eval/score": 0.1, "eval/accuracy": 0.2, "eval/distinct_2": 0.9},
               "eval_after": {"eval/score": 0.4, "eval/accuracy": 0.5, "eval/distinct_2": 0.3,
                              "eval/win_rate": 0.7}}
    lines = verdict(rows, summary)
    assert lines[0] == "Verdict: up on the held-out prompts; 1 flag: falling diversity."
    assert lines[1].startswith("Training score +0.050 -> +0.650 (up; first/last 2 iterations)")
    # no eval/score_sem: the fixed band
    assert ("Held-out score (the same prompts, temperature of eval) +0.100 -> +0.400: up (noise "
            "±0.020: the fixed band: the run logged no eval/score_sem).") in lines
    flat = [{**r, "objective/scores": 0.2 + 0.1 * (-1) ** i} for i, r in enumerate(rows)]
    assert verdict(flat, {})[0] == ("Verdict: no clear change (the training score: no held-out "
                                    "evaluation to check it on); no flags.")
    assert "Held-out accuracy 0.200 -> 0.500." in lines
    assert "Held-out win rate against the reference: 0.70." in lines
    assert lines[-1] == ("Flag falling_diversity: held-out distinct-2 0.90 -> 0.30, 67% lower "
                         "(flagged past 10%); halved: the responses collapsed towards a few "
                         "phrasings.")
    assert verdict([], {}) == ["Verdict: no iteration finished."]


def test_held_out_noise_by_hand():
    # 2 standard errors of the change: 2 * sqrt(0.03² + 0.04²) = 0.1
    band, how = held_out_noise({"eval/score_sem": 0.03}, {"eval/score_sem": 0.04})
    assert band == pytest.approx(0.1) and how.startswith("2 standard errors")
    assert held_out_noise({"eval/score_sem": 0.03}, {})[0] == V.FLAT_SCORE_BAND
    assert held_out_noise({"eval/score_sem": math.nan}, {"eval/score_sem": 0.04})[0] == 0.02
    before = {"eval/score": 0.30, "eval/score_sem": 0.03}
    rows = [{"iteration": 0, "objective/scores": 0.0}]
    for after, call in ((0.39, "flat"), (0.41, "up"), (0.21, "flat"), (0.19, "down")):
        summary = {"eval_before": before, "eval_after": {"eval/score": after, "eval/score_sem": 0.04}}
        assert assess(rows, summary).call == call, after


def _healthy(n: int = 16) -> tuple[list[dict], dict]:
    """A run that learned: the training and held-out scores rise, the KL grows slowly, the
    responses stay as long and as varied (the default run's held-out figures)."""
    rows = [{"iteration": i, "objective/scores": 0.1 + 0.0125 * i + 0.01 * (-1) ** i,
             "objective/kl": 0.2 + 0.05 * i, "val/sequence_lengths": 10.0} for i in range(n)]
    summary = {"eval_before": {"eval/score": 0.067, "eval/score_sem": 0.05, "eval/distinct_2": 0.917,
                               "eval/response_length": 10.0, "eval/win_rate": 0.5},
               "eval_after": {"eval/score": 0.387, "eval/score_sem": 0.05, "eval/distinct_2": 0.908,
                              "eval/response_length": 10.0, "eval/win_rate": 0.797}}
    return rows, summary


def _with(rows, summary, key=None, values=None, before=None, after=None):
    """A copy of the run with ``key`` set to ``values`` per row, and held-out figures changed."""
    rows = [{**r, key: v} if key else dict(r) for r, v in zip(rows, values or [None] * len(rows))]
    return rows, {"eval_before": {**summary["eval_before"], **(before or {})},
                  "eval_after": {**summary["eval_after"], **(after or {})}}


def test_a_healthy_run_raises_no_flag_and_each_flag_its_own():
    rows, summary = _healthy()
    found = assess(rows, summary)
    assert (found.call, found.flags) == ("up", [])
    assert found.headline == "Verdict: up on the held-out prompts; no flags."
    # KL quarters (4 iterations each): 0.2 + 0.05 i -> 0.675 then 0.875, 1.3x: not a runaway
    cases = {
        # the held-out score stays inside 2 * sqrt(0.05² + 0.05²) = 0.141 of its start
        "flat_held_out": _with(rows, summary, after={"eval/score": 0.067 + 0.14}),
        # distinct-2 0.917 -> 0.80: 12.8% lower, past 10% (0.83, 9.5% lower, is not)
        "falling_diversity": _with(rows, summary, after={"eval/distinct_2": 0.80}),
        # the last quarter's mean KL 5.5 nats, past 5
        "kl_runaway": _with(rows, summary, "objective/kl", [0.2] * 12 + [5.5] * 4),
        # still growing fast: quarter means 0.6 then 1.3 (2.17x, past 1 nat)
        "kl_growing": _with(rows, summary, "objective/kl", [0.2] * 8 + [0.6] * 4 + [1.3] * 4),
        # training responses 10 -> 4 tokens (first/last quarter): below half
        "length_collapse": _with(rows, summary, "val/sequence_lengths", [10.0] * 12 + [4.0] * 4),
        # held-out responses 3 -> 1.8 tokens: 60% of the start, but under 2 tokens
        "length_near_zero": _with(rows, summary, before={"eval/response_length": 3.0},
                                  after={"eval/response_length": 1.8}),
    }
    for case, (case_rows, case_summary) in cases.items():
        flags = [f.name for f in assess(case_rows, case_summary).flags]
        expected = {"kl_growing": "kl_runaway", "length_near_zero": "length_collapse"}.get(case, case)
        assert flags == [expected], (case, flags)
    # just inside each threshold: no flag
    for inside in (_with(rows, summary, after={"eval/distinct_2": 0.83}),
                   _with(rows, summary, "objective/kl", [0.2] * 8 + [0.6] * 4 + [1.1] * 4),
                   _with(rows, summary, "val/sequence_lengths", [10.0] * 12 + [5.5] * 4)):
        assert assess(*inside).flags == []
    line = verdict(*cases["kl_growing"])[-1]
    assert line == ("Flag kl_runaway: KL to the reference still growing fast: 0.60 -> 1.30 nats "
                    "per response over the last two quarters of the run (flagged at 2x, past 1 "
                    "nats).")


def test_a_flat_held_out_score_is_never_called_up():
    # the custom run of issue 50: training score up, held-out 0.500 -> 0.500, distinct-2 0.89 -> 0.72
    rows = [{"iteration": i, "objective/scores": 0.1 * i, "objective/kl": 0.5} for i in range(12)]
    summary = {"eval_before": {"eval/score": 0.5, "eval/score_sem": 0.04, "eval/distinct_2": 0.89},
               "eval_after": {"eval/score": 0.5, "eval/score_sem": 0.04, "eval/distinct_2": 0.72}}
    found = assess(rows, summary)
    assert trend([r["objective/scores"] for r in rows])[2] == "up"
    assert found.call == "flat" and [f.name for f in found.flags] == ["flat_held_out",
                                                                      "falling_diversity"]
    assert found.headline == ("Verdict: flat on the held-out prompts; 2 flags: flat held-out "
                              "score, falling diversity.")
    assert "while the training score rose" in found.flags[0].message


def test_the_docs_give_each_threshold_as_the_code_has_it():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    for name in ("NOISE_SE", "FLAT_SCORE_BAND", "DIVERSITY_DROP", "KL_RUNAWAY_NATS",
                 "KL_GROWTH_RATIO", "KL_GROWTH_MIN_NATS", "LENGTH_COLLAPSE_FRAC",
                 "LENGTH_MIN_TOKENS"):
        assert re.search(rf"`{name}` = {getattr(V, name):g}(?![\d.])", page), name
    assert all(f"| `{flag}` |" in page for flag in V.FLAGS)


def test_every_plot_shares_one_iteration_axis(tmp_path):
    rows, summary = _healthy(6)
    rows[-1].update({"eval/score": 0.387, "eval/distinct_2": 0.908, "time/update": 1.0})
    # the row of iteration i at i + 1; the evaluation before training at 0
    assert points(rows, summary, "objective/kl")[:2] == [(1, 0.2), (2, 0.25)]
    assert points(rows, summary, "eval/score") == [(0, 0.067), (6, 0.387)]
    shown = []
    for _, title, keys, ylabel in PLOTS:
        fig = figure(rows, summary, keys, title, ylabel, x_limits(6))
        if fig is not None:
            ax = fig.axes[0]
            shown.append((ax.get_xlabel(), ax.get_xlim()))
            fig.clf()
    assert len(shown) == 6  # score, KL, RLHF reward... those the rows hold
    assert set(shown) == {("iteration", x_limits(6))} and x_limits(6) == (-0.5, 6.5)


def test_several_runs_overlaid_on_one_page(tmp_path, capsys):
    # mean and min-max at the iterations every run reached
    assert across_runs([[(0, 1.0), (1, 2.0), (2, 6.0)], [(1, 4.0), (2, 0.0)]]) == [
        (1, 3.0, 2.0, 4.0), (2, 3.0, 0.0, 6.0)]
    assert run_labels(["a/seed0", "b/seed0", "b/seed1"]) == ["a/seed0", "b/seed0", "b/seed1"]
    assert run_labels(["runs/seed0", "runs/seed1"]) == ["seed0", "seed1"]
    runs = []
    for seed, (rows, summary) in enumerate([_healthy(), _healthy(12),
                                            _with(*_healthy(), after={"eval/distinct_2": 0.7})]):
        run = tmp_path / "runs" / f"seed{seed}"
        run.mkdir(parents=True)
        rows[-1].update(summary["eval_after"])
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "report.json").write_text(json.dumps(summary))
        runs.append(str(run))
    cli.main(["report", *runs])
    out = tmp_path / "runs" / "report.html"  # beside the runs
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 4 and "min-max" in page
    for title in ("Score (reward model / functions)", "KL to the reference", "Held-out score",
                  "Held-out distinct-2"):
        assert (tmp_path / "runs" / "plots").exists() and f"title='{title}'" in page
    # each run's row: its call and flags; the mean [min, max] of the held-out score after
    assert page.count("<td>up</td>") == 3 and "<td>falling_diversity</td>" in page
    assert "<td>+0.387 [+0.387, +0.387]</td>" in page
    assert page.count("class='verdict'") == 3
    # --out: a folder of its own; one run: its own folder, as before
    cli.main(["report", *runs[:2], "--out", str(tmp_path / "two")])
    assert (tmp_path / "two" / "report.html").exists()
    cli.main(["report", runs[0]])
    assert "PPO run report" in (tmp_path / "runs" / "seed0" / "report.html").read_text()


@pytest.mark.parametrize("case", ["not a run", "twice", "into a run", "beside a run"])
def test_report_of_bad_folders_is_one_line_before_any_work(tmp_path, capsys, case):
    run, inner = tmp_path / "run", tmp_path / "run" / "inner"  # a run inside a run's folder
    for folder in (run, inner):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "objective/scores": 0.1})
                                              + "\n")
    args, message = {
        "not a run": ([str(run), str(tmp_path)], f"{tmp_path} has no metrics.jsonl: not a run "
                                                 f"directory."),
        "twice": ([str(run), str(run)], f"{run} is given twice: give each run once."),
        "into a run": ([str(inner), "--out", str(run)], f"--out {run} is another run's directory"),
        "beside a run": ([str(run), str(inner)], f"the runs' common folder, {run}, is a run "
                                                 f"directory: its own report.html would be "
                                                 f"replaced; give --out a folder"),
    }[case]
    with pytest.raises(SystemExit) as stop:
        cli.main(["report", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith(f"Error: {message}") and err.count("\n") == 1
    assert not list(tmp_path.rglob("report.html"))  # nothing written


def test_report_renders_every_plot_of_a_finished_run(tmp_path, tiny_llama_dir):
    # groups of 2 responses under RLOO (filtered when equal), the KL in the loss and episodes with
    # a tool: the plots of those too
    report = ppo.train(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=3", "eval.every=2",
                            "generation.samples_per_prompt=2", "advantage.estimator=rloo",
                            "advantage.filter_groups=true", "ppo.kl_loss_coef=0.01",
                            "env.max_turns=2", "env.tools=[calculator]",
                            "data.chat_template=null"))
    page = (tmp_path / "report.html").read_text()
    for name, title, _, _ in PLOTS:
        assert (tmp_path / "plots" / f"{name}.png").exists(), name
        assert f"title='{title}'" in page, title
    assert page.count("data:image/png;base64,") == len(PLOTS)
    assert "Responses before training" in page and "Responses after training" in page
    assert "At a glance" in page and "Training score " in page and "Held-out score " in page
    # the verdict's call and flags in report.json; the held-out score's standard error logged
    assert report["verdict"] in ("up", "down", "flat") and isinstance(report["flags"], list)
    assert "<li>Verdict: " in page and report["eval_before"]["eval/score_sem"] >= 0
    # the same held-out prompts, answered before and after training
    pairs = report["held_out_samples"]
    assert len(pairs) == 4 and all({"before", "after", "score_before", "score_after"} <= set(p)
                                   for p in pairs)
    assert len({p["prompt"] for p in pairs}) == 4  # four held-out prompts, each answered twice
    assert "Held-out prompts: the policy's response before and after training" in page
    # each prompt shown as its user message (the rendered prompt, chat template included, on hover)
    assert all(p["question"] in p["prompt"] and p["question"] != p["prompt"] for p in pairs)
    assert f'">{html.escape(pairs[0]["question"])}</td>' in page
    # held-out evaluation before training, after updates 2 and 3 (the last)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["eval/score" in r for r in rows] == [False, True, True]
    for key in ("eval/score", "eval/win_rate", "eval/distinct_1", "eval/distinct_2",
                "eval/response_length"):
        assert key in report["eval_before"] and key in report["eval_after"]
    assert report["eval_before"]["eval/win_rate"] == 0.5  # the untrained policy is the reference
    # on demand, from the run directory
    (tmp_path / "report.html").unlink()
    out = subprocess.run([sys.executable, "-m", "rlhf_torchrl.record.report", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and (tmp_path / "report.html").exists()


def test_standalone_evaluation_of_a_saved_policy(tmp_path, tiny_llama_dir):
    import evaluate_policy as evaluate

    ppo.train(_cfg(tmp_path / "run", tiny_llama_dir, "ppo.num_iterations=1", "optim.lr=1e-2"))
    saved = tmp_path / "run" / "policy"
    out = tmp_path / "eval"
    # the base model against itself: every response ties
    same = evaluate.evaluate(_cfg(out, tiny_llama_dir, f"model.reference={tiny_llama_dir}"))
    assert same["eval/win_rate"] == 0.5
    metrics = evaluate.evaluate(_cfg(out, str(saved), f"model.reference={tiny_llama_dir}"))
    written = json.loads((out / "eval.json").read_text())
    assert written["eval/score"] == metrics["eval/score"] and len(written["responses"]) == 4
    for key in ("eval/score", "eval/win_rate", "eval/reference_score", "eval/distinct_2"):
        assert key in metrics
