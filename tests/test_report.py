"""Evaluation metrics on known inputs; the run report renders from a finished tiny run."""

import html
import json
import subprocess
import sys

import pytest
import torch
from test_recipe import _cfg, ppo

from rlhf_torchrl.record.report import PLOTS, moving_average, trend, verdict
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
    assert lines[0].startswith("Training score +0.050 -> +0.650 (up; first/last 2 iterations)")
    assert "Held-out score (the same prompts, temperature of eval) +0.100 -> +0.400." in lines
    flat = [{**r, "objective/scores": 0.2 + 0.1 * (-1) ** i} for i, r in enumerate(rows)]
    assert "(no clear change;" in verdict(flat, {})[0]
    assert "Held-out accuracy 0.200 -> 0.500." in lines
    assert any("collapsed" in line for line in lines) and lines[-1].endswith("0.70.")


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
