"""The scripts in examples/ run as a user runs them, on a tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["ppo.num_iterations=2", "ppo.batch_size=8", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=8", "logging.progress_bar=false", "data.limit=40",
        "eval.num_prompts=4", "eval.every=2", "optim.critic_warmup=0", "threads=1"]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_rloo_in_your_own_loop(tiny_llama_dir):
    out = _run("rloo_loop.py", "--model", tiny_llama_dir, "--iterations", "2", "--prompts", "2",
               "--samples", "3", "--max-new-tokens", "6")
    lines = [line for line in out.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2 and "within-group std" in lines[0]


def test_torchrls_gae_and_clip_ppo_loss_in_your_own_loop(tiny_llama_dir):
    out = _run("torchrl_gae_loop.py", "--model", tiny_llama_dir, "--iterations", "2",
               "--batch-size", "4", "--max-new-tokens", "6")
    lines = [line for line in out.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2 and "value loss" in lines[0]


def test_custom_advantage_in_the_trainer(tmp_path, tiny_llama_dir):
    out = _run("custom_advantage.py", f"model.policy={tiny_llama_dir}", f"output_dir={tmp_path}",
               "generation.max_new_tokens=6", *TINY)
    assert "held-out accuracy:" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["group/size"] for r in rows] == [4, 4]
    assert all("loss/value_avg" not in r for r in rows)  # no critic was built


def test_reward_transform_in_the_trainer(tmp_path, tiny_llama_dir):
    # the tiny model never stops: 20 tokens, 4 over the example's budget of 16
    _run("reward_transform.py", f"model.policy={tiny_llama_dir}", f"output_dir={tmp_path}",
         "generation.max_new_tokens=20", "ppo.batch_size=4",
         *(t for t in TINY if not t.startswith("ppo.batch_size")))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["val/sequence_lengths"] == 20
        assert abs(row["objective/length_penalty"] + 0.02 * 4) < 1e-6
