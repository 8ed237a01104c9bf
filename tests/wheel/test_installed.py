"""The installed package as a user has it: a wheel in a fresh venv, run from outside any checkout
(``.ci/wheel``). Skipped in the main suite, where the package is the checkout itself."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_torchrl

SOURCE = os.environ.get("RLHF_TORCHRL_SOURCE")  # the checkout the wheel was built from
pytestmark = pytest.mark.skipif(
    not SOURCE or Path(rlhf_torchrl.__file__).resolve().is_relative_to(Path(SOURCE).resolve()),
    reason="checks a wheel install (.ci/wheel); here the package is the checkout")
COMMAND = shutil.which("rlhf-torchrl") or str(Path(sys.executable).parent / "rlhf-torchrl")
TINY = ["ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=4", "generation.max_new_tokens=8", "data.limit=12",
        "eval.num_prompts=4", "eval.every=2", "optim.critic_warmup=0", "threads=2"]


def _run(*args, cwd):
    return subprocess.run([COMMAND, *args], capture_output=True, text=True, cwd=cwd, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_help_lists_the_commands_groups_and_settings(tmp_path):
    out = _run("--help", cwd=tmp_path)
    assert out.returncode == 0 and "ppo" in out.stdout and "reward-model" in out.stdout
    ppo = _run("ppo", "--help", cwd=tmp_path)
    assert ppo.returncode == 0, ppo.stderr
    assert "task=arithmetic|arithmetic_tools|custom|gsm8k|hh|sentiment|tldr" in ppo.stdout
    # the default task's values, with each setting's comment from ppo.yaml
    assert "ppo.batch_size=32" in ppo.stdout and "responses per rollout, over all processes" in ppo.stdout
    arithmetic = _run("ppo", "task=arithmetic", "--help", cwd=tmp_path)
    assert "data.source=reasoning_gym:basic_arithmetic" in arithmetic.stdout


def test_default_task_runs_from_another_directory(tmp_path):
    """``rlhf-torchrl ppo`` on the offline default task (SmolLM2, review openings, VADER), tiny."""
    run_dir = tmp_path / "run"
    out = _run("ppo", f"hydra.run.dir={run_dir}", *TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PPO report: 2 iterations" in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("objective/scores" in r for r in rows)
    assert (run_dir / "report.html").is_file() and (run_dir / "policy" / "config.json").is_file()
    assert (run_dir / "ppo.log").is_file()  # Hydra's log, named after the command
    # a bad setting: one line, no traceback
    bad = _run("ppo", f"hydra.run.dir={tmp_path / 'bad'}", "ppo.clip_epsilon=-1", cwd=tmp_path)
    assert bad.returncode == 1 and "Error: ppo.clip_epsilon=-1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_benchmarks_run_from_the_installed_command(tmp_path):
    """``rlhf-torchrl bench``: the benchmarks ship in the wheel and build their own tiny model and
    tokenizer (no clone, no SmolLM2); figures go where ``--out`` says and nowhere else."""
    listing = _run("bench", "--help", cwd=tmp_path)
    assert listing.returncode == 0 and "ppo_iteration" in listing.stdout and "scaling" in listing.stdout
    usage = _run("bench", "ppo_iteration", "--help", cwd=tmp_path)
    assert usage.returncode == 0 and "(default: tiny-gpt2)" in usage.stdout
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "results" / "it.json"
    it = _run("bench", "ppo_iteration", "--model", "tiny-gpt2", "--batch-size", "4",
              "--response-length", "4", "--iterations", "1", "--warmup", "0", "--out", str(out),
              cwd=work)
    assert it.returncode == 0, it.stderr[-3000:]
    assert "ours/floor" in it.stdout
    result = json.loads(out.read_text())
    assert result["vocabulary"] == 260 and result["ours"]["total"] > 0
    # the recipe-driving one: `rlhf-torchrl ppo` in a process of its own, on the saved tiny Llama
    scaling = _run("bench", "scaling", "--model", "tiny-llama", "--variants", "fp32",
                   "--iterations", "2", "--batch-size", "4", "--response-length", "4",
                   "--out", str(tmp_path / "results" / "s.json"), "data.limit=16", cwd=work)
    assert scaling.returncode == 0, scaling.stderr[-3000:]
    assert json.loads((tmp_path / "results" / "s.json").read_text())["variants"]["fp32"]["total"] > 0
    assert list(work.iterdir()) == []


def test_plan_runs_from_the_installed_command(tmp_path):
    """``rlhf-torchrl plan``: the packaged model shapes ship in the wheel; a 7B plan for 8 H100s
    prints its components and peak, nothing written."""
    plan = _run("plan", "task=gsm8k", "model.policy=qwen2.5-7b", "--gpu", "H100",
                "--world-size", "8", "distributed.strategy=fsdp2", "model.autocast=bfloat16",
                cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "policy AdamW state" in plan.stdout and "peak" in plan.stdout
    assert list(tmp_path.iterdir()) == []
