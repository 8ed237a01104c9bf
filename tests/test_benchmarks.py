"""The benchmarks run end to end at tiny sizes and write their JSON (figures are not asserted)."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_ppo_iteration_benchmark(tmp_path, smollm2_dir):
    import ppo_iteration

    out = tmp_path / "it.json"
    ppo_iteration.main(["--model", "tiny-llama", "--batch-size", "4", "--response-length", "4",
                        "--minibatches", "2", "--iterations", "1", "--warmup", "0", "--threads", "1",
                        "--no-reuse-freed-memory", "--json", str(out)])
    result = json.loads(out.read_text())
    for side in ("ours", "floor"):
        for phase in ("generation", "evaluation", "update", "total", "tokens_per_second"):
            assert result[side][phase] > 0, (side, phase)
    assert result["machine"]["threads"] == 1 and result["peak_rss_mb"] > 0


def test_collectors_benchmark(tmp_path, smollm2_dir):
    import collectors

    out = tmp_path / "c.json"
    collectors.main(["--model", "tiny-gpt2", "--batch-sizes", "2", "--lengths", "4",
                     "--repeats", "1", "--threads", "1", "--no-reuse-freed-memory",
                     "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["batch_size"] == 2
    for name in ("collector", "generate", "hf_generate"):
        assert row[f"{name}_tokens_per_s"] > 0, name


def test_backends_benchmark_transformers(tmp_path, smollm2_dir):
    """The backend sweep with the transformers backend alone (tests/test_vllm.py runs both)."""
    import backends

    out = tmp_path / "b.json"
    backends.main(["--model", "tiny-llama", "--backends", "transformers", "--batch-sizes", "1", "3",
                   "--lengths", "4", "--repeats", "1", "--threads", "1", "--no-reuse-freed-memory",
                   "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["batch_size"] for r in result["results"]] == [1, 3]
    assert all(r["transformers_tokens_per_s"] > 0 for r in result["results"])
    assert result["weight_sync_s"]["ModelCopy"] > 0 and result["weight_mb"] > 0


def test_scaling_benchmark(tmp_path, tiny_llama_dir):
    """Recipe variants in their own processes: phase times and a per-process peak RSS each."""
    import scaling

    out = tmp_path / "s.json"
    scaling.main(["--model", tiny_llama_dir, "--variants", "fp32", "token-budget", "two-processes",
                  "--iterations", "2", "--batch-size", "4", "--response-length", "4",
                  "--micro-batch-tokens", "16", "--threads", "1", "--json", str(out),
                  "data.limit=16", "ppo.num_mini_batches=2", "ppo.forward_batch_size=2"])
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"fp32", "token-budget", "two-processes"}
    for name, row in variants.items():
        assert row["total"] > 0 and row["update"] > 0 and row["peak_rss_mb"] > 50, name
    assert variants["two-processes"]["command"].startswith("torchrun")


def test_gpu_suite_says_what_it_needs_without_a_gpu(capsys):
    """Without CUDA the GPU suite names what it needs and the command to run, and times nothing."""
    import gpu_suite
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is visible: `python benchmarks/gpu_suite.py` runs for real")
    assert gpu_suite.main([]) == {"skipped": "no CUDA GPU"}
    assert "python benchmarks/gpu_suite.py" in capsys.readouterr().out


def test_estimators_table_reads_the_runs(tmp_path, capsys):
    """One row per finished run (an unfinished one is left out), the mean over seeds, the median
    iteration and the peak RSS of `/usr/bin/time -v`."""
    import estimators_table

    for seed, (after, seconds) in enumerate([(0.5, [30.0, 31.0, 300.0]), (0.3, [32.0, 33.0, 34.0])]):
        run = tmp_path / f"arithmetic_rloo_{seed}"
        run.mkdir()
        (run / "report.json").write_text(json.dumps({
            "eval_before": {"eval/accuracy": 0.25, "eval/distinct_2": 0.4},
            "eval_after": {"eval/accuracy": after, "eval/distinct_2": 0.5}, "final_kl": 2.0}))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"objective/scores": 0.1 * i, "time/total": s, "group/equal_score_frac": 0.5})
            + "\n" for i, s in enumerate(seconds)))
        (tmp_path / f"arithmetic_rloo_{seed}.time").write_text(
            "\tMaximum resident set size (kbytes): 5242880\n")
    (tmp_path / "arithmetic_gae_0").mkdir()  # still running: no report yet
    results = estimators_table.main(["--task", "arithmetic", "--out", str(tmp_path)])
    assert results["gae"] == {} and sorted(results["rloo"]) == [0, 1]
    assert results["rloo"][0]["seconds"] == 31.0 and results["rloo"][0]["peak_gib"] == 5.0
    out = capsys.readouterr().out
    assert "| rloo | 0 | 0.250 -> 0.500 |" in out and "**0.400** ± 0.141" in out
