"""The PPO recipe end to end with tiny overrides, and the errors it gives before any work."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_torchrl.config import builders, checks, compose, derived

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES))

import ppo  # noqa: E402

TINY = ["ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=2", "generation.max_new_tokens=6", "logging.progress_bar=false",
        "data.limit=16", "optim.lr=1e-3", "eval.num_prompts=4",
        "optim.critic_warmup=0",  # (the sentiment preset warms the critic up for 2 iterations)
        "model.autocast=null"]  # fp32 whatever the default (auto would pick bf16 on some CPUs)
# in-process runs leave the pytest process's allocator alone; the CLI test keeps the default (on)
IN_PROCESS = ["reuse_freed_memory=false"]


def _cfg(tmp_path, model_dir, *overrides):
    return compose([f"output_dir={tmp_path}", f"model.policy={model_dir}", *TINY, *IN_PROCESS,
                    *overrides])


@pytest.mark.parametrize("overrides", [
    ["value_model.init=policy"],
    ["value_model.init=shared"],
    ["value_model.init=shared", "generation.log_probs_from_sampling=false"],
], ids=["separate-critic", "shared-critic", "recomputed-log-probs"])
def test_recipe_runs_and_trains(tmp_path, tiny_llama_dir, overrides):
    report = ppo.train(_cfg(tmp_path, tiny_llama_dir, *overrides))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        metrics = json.loads(line)
        for name in ("objective/kl", "objective/scores", "objective/rlhf_reward", "policy/approxkl_avg",
                     "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/num_eos_tokens",
                     "time/generation", "time/update", "time/tokens_per_second", "lr", "episode"):
            assert math.isfinite(metrics[name]), name
    assert (tmp_path / "ppo" / "scalars").is_dir()  # TorchRL CSV logger
    assert report["iterations"] == 2 and len(report["samples_after"]) == 3
    # the saved policy moved away from the initial weights
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    from transformers import AutoTokenizer  # its tokenizer pads as it sampled: on the left

    assert AutoTokenizer.from_pretrained(tmp_path / "policy").padding_side == "left"


@pytest.mark.parametrize("overrides", [
    ["advantage.estimator=rloo", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.01",
     "advantage.filter_groups=true"],
    ["advantage.estimator=grpo", "advantage.scale_by_std=false",
     "ppo.loss_aggregation=seq_mean_token_sum_norm"],
    ["advantage.estimator=reinforce_pp", "ppo.num_mini_batches=4"],
], ids=["rloo-kl-in-loss-filtered", "dr-grpo", "reinforce-pp"])
def test_critic_free_estimators_train_without_a_value_model(tmp_path, tiny_llama_dir, overrides):
    """Groups of 2 responses per prompt, a critic-free estimator: no value model is built (the
    optimiser and the checkpoint hold the policy alone), no value loss, group statistics logged;
    the run resumes from its checkpoint."""
    overrides = ["ppo.batch_size=8", "generation.samples_per_prompt=2", "checkpoint.every=1",
                 *overrides]
    trainer = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, *overrides))
    assert trainer.critic is None and list(trainer.trained_modules) == ["policy"]
    assert len(trainer.optimizer.param_groups) == 1
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["group/size"] == 2 and 0 <= row["group/equal_score_frac"] <= 1
        assert "loss/value_avg" not in row and "val/value_mean" not in row
        assert row["episode"] == 8 * (row["iteration"] + 1)
    if "advantage.filter_groups=true" in overrides:
        assert all("group/filtered_frac" in row for row in rows)
    updated = [r for r in rows if "loss/policy_avg" in r]
    assert updated and all(math.isfinite(r["loss/policy_avg"]) for r in updated)
    if "ppo.kl_loss_coef=0.01" in overrides:
        assert all(r["policy/kl_to_ref_avg"] >= 0 for r in updated)
    resumed = builders.build_trainer(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=3",
                                          *overrides))
    assert resumed.iteration == 2 and resumed.critic is None


def test_recipe_cli(tmp_path, tiny_gpt2_dir):
    """The command line a user types, on a GPT-2 with an adaptive KL and a missing-EOS penalty.
    Its output goes to a pipe: the progress bar (on by default) gives way to a log line per
    iteration (logging.log_every=1), and nothing writes a carriage return or a loading bar."""
    tiny = [o for o in TINY if not o.startswith("logging.progress_bar")]
    cmd = [sys.executable, str(RECIPES / "ppo.py"), f"model.policy={tiny_gpt2_dir}",
           f"hydra.run.dir={tmp_path}", "ppo.kl_coef=0.05", "ppo.kl_target=0.5", "ppo.kl_horizon=10000",
           "reward.missing_eos_penalty=1.0", "logging.log_every=1",
           "ppo.kl_estimator=k3", "optim.lr_schedule=constant", *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PPO report" in out.stdout
    printed = out.stdout + out.stderr
    assert "Iteration 1/2: score" in printed and "Iteration 2/2: score" in printed
    assert "\r" not in printed and "Loading weights" not in printed
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["objective/kl_coef"] == 0.05 and rows[1]["objective/kl_coef"] != 0.05


def test_empty_prompt_file(tmp_path, tiny_llama_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        ppo.train(_cfg(tmp_path, tiny_llama_dir, f"data.source={empty}"))


SEEN: dict = {}


def reads_the_rollout(prompts, responses, tensordict):
    """The documented contract (docs/custom.md, "Reward functions"): a reward reads token ids."""
    SEEN.setdefault("keys", []).append(sorted(str(k) for k in tensordict.keys(True, True)))
    mask = tensordict.get(("masks", "response"))
    return (mask.sum(-1) / mask.shape[-1]).tolist()


def exact_match(prompts, responses, answer):
    """A verifiable reward: 1 where the response is the row's answer."""
    SEEN.setdefault("pairs", []).extend(zip(prompts, answer))
    return [float(r.strip() == a) for r, a in zip(responses, answer)]


def test_recipe_reward_reading_the_rollout(tmp_path, tiny_llama_dir):
    """A fn(prompts, responses, tensordict) reward runs from start-up on, and the start-up probe
    gives it the keys a real rollout has."""
    SEEN.clear()
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "reward.functions=[test_recipe.reads_the_rollout]",
                   "ppo.num_iterations=1", "eval.every=0"))  # (evaluation would call it too)
    probe_keys, first_keys = SEEN["keys"]
    assert probe_keys == first_keys


def test_recipe_passes_dataset_columns_to_rewards(tmp_path, tiny_llama_dir):
    """JSON lines with prompt and answer, an exact-match reward: each response is scored against
    its own row's answer."""
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(16)]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    SEEN.clear()
    ppo.train(_cfg(tmp_path, tiny_llama_dir, f"data.source={data}",
                   "reward.functions=[test_recipe.exact_match]", "eval.every=0"))
    pairs = SEEN["pairs"]
    assert len(pairs) == 2 + 2 * 4  # the probe's 2 rows, then 2 iterations of 4
    for prompt, answer in pairs:
        i = int(prompt.split("What is ")[1].split()[0])
        assert answer == str(2 * i)


def test_recipe_on_policy_check(tmp_path, tiny_llama_dir, caplog):
    """On by default: a zero tolerance trips it on float noise (and names the cause); off, the same
    run goes through."""
    from rlhf_torchrl.collectors.on_policy import OffPolicyError

    with pytest.raises(OffPolicyError, match="generation.on_policy_tolerance"):
        ppo.train(_cfg(tmp_path / "a", tiny_llama_dir, "generation.on_policy_tolerance=0",
                       "eval.every=0"))
    ppo.train(_cfg(tmp_path / "b", tiny_llama_dir, "generation.on_policy_tolerance=0",
                   "generation.check_on_policy=false", "ppo.num_iterations=1"))
    with caplog.at_level("INFO", logger="rlhf_torchrl"):
        ppo.train(_cfg(tmp_path / "c", tiny_llama_dir, "ppo.num_iterations=1"))
    assert "On-policy check: recorded and recomputed log-probs" in caplog.text
    assert ", values to " in caplog.text  # the shared trunk's values, read off the sampling pass


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "auto"])
def test_recipe_precision_and_memory_settings(tmp_path, tiny_llama_dir, dtype):
    """Explicit device, bf16/fp16 autocast over fp32 weights (fp16 with a gradient scaler), or
    auto (bf16 where this CPU computes it natively, with TIS; the report's config says which),
    gradient checkpointing, SDPA attention, a reference offloaded to the CPU between phases,
    token-budget micro-batches: it trains, and the saved weights are fp32."""
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "device=cpu", f"model.autocast={dtype}",
                   "model.gradient_checkpointing=true", "model.attn_implementation=sdpa",
                   "model.offload_reference=true", "ppo.micro_batch_tokens=64",
                   "value_model.init=policy"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(math.isfinite(r["loss/policy_avg"]) and 0 < r["grad_norm"] < 1e3 for r in rows)
    ran = json.loads((tmp_path / "report.json").read_text())["config"]
    if dtype == "auto":
        from rlhf_torchrl.runtime import native_bf16

        native = native_bf16(torch.device("cpu"))
        assert ran["model"]["autocast"] == ("bfloat16" if native else None)
        assert ran["ppo"]["tis_cap"] == (derived.AUTO_TIS_CAP if native else None)
        assert ("policy/behaviour_approxkl" in rows[0]) == native  # recomputed old log-probs
    else:  # bf16/fp16 however spelled: the old log-probs recomputed, TIS on
        assert ran["model"]["autocast"] == dtype and ran["ppo"]["tis_cap"] == derived.AUTO_TIS_CAP
        assert "policy/behaviour_approxkl" in rows[0] and "policy/tis_capped_frac" in rows[0]
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype="auto").state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_tis_is_on_wherever_the_sampler_differs(monkeypatch, native):
    """One rule, from what happens: with ppo.tis_cap null, TIS (cap 2) is on where the old
    log-probs are recomputed and the sampler computed its own another way (bf16/fp16 by any
    spelling, vLLM, older weights, a compiled decode step), off where nothing differs; the
    resolution is written into the config once, and a set cap is kept."""
    monkeypatch.setattr(derived, "native_bf16", lambda device: native)
    on, off = derived.AUTO_TIS_CAP, None
    cases = {
        # bf16 however it is spelled (it was 2 for auto, none for bfloat16)
        ("model.autocast=auto",): on if native else off,  # auto: fp32 without native bf16
        ("model.autocast=bfloat16",): on,
        ("model.autocast=float16",): on,
        ("model.autocast=null", "model.dtype=bfloat16"): on,
        ("model.autocast=auto", "model.dtype=bfloat16"): on,  # (auto adds nothing to bf16)
        # another engine or older weights with an fp32 trainer (vLLM had none)
        ("model.autocast=null", "generation.backend=vllm"): on,
        ("model.autocast=null", "collection.overlap=1"): on,
        ("model.autocast=null", "collection.partial_rollout=true"): on,
        ("model.autocast=null", "generation.compile=true"): on,
        # nothing to correct: the sampler is the training forward, or its log-probs are kept
        ("model.autocast=null",): off,
        ("model.autocast=null", "generation.log_probs_from_sampling=false"): off,
        ("model.autocast=bfloat16", "generation.log_probs_from_sampling=true"): off,
        ("model.autocast=null", "generation.backend=vllm", "generation.log_probs_from_sampling=true"): off,
        # set: kept
        ("model.autocast=bfloat16", "ppo.tis_cap=1.5"): 1.5,
    }
    for overrides, cap in cases.items():
        cfg = compose(list(overrides))
        assert derived.tis_cap(cfg) == cap, overrides  # before the resolution too
        builders.resolve_precision(cfg)
        assert cfg.ppo.tis_cap == cap, overrides
        builders.resolve_precision(cfg)  # idempotent
        assert derived.tis_cap(cfg) == cap and cfg.ppo.tis_cap == cap, overrides


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("extra", [[], ["model.autocast=bfloat16", "model.offload_reference=true"]],
                         ids=["fp32", "bf16-offload"])
def test_recipe_on_cuda(tmp_path, tiny_llama_dir, extra):
    """The recipe end to end on the GPU: every model and rollout tensor on cuda."""
    report = ppo.train(_cfg(tmp_path, tiny_llama_dir, "device=cuda", *extra))
    assert report["iterations"] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["objective/kl"]) for r in rows)


def test_low_precision_recomputes_old_log_probs(tmp_path, tiny_llama_dir):
    """In bf16/fp16 the old log-probs come from the training forward and the on-policy check is
    coarser; fp32 keeps the recorded ones and 1e-3; explicit settings win."""
    fp32 = _cfg(tmp_path, tiny_llama_dir)
    assert derived.log_probs_from_sampling(fp32) and derived.on_policy_tolerance(fp32) == 1e-3
    for setting in ("model.autocast=bfloat16", "model.dtype=bfloat16"):
        low = _cfg(tmp_path, tiny_llama_dir, setting)
        assert not derived.log_probs_from_sampling(low) and derived.on_policy_tolerance(low) == 0.5
    # an fp32 trainer sampled by a bf16 vLLM engine: the engine's rounding, the same coarse check
    engine = _cfg(tmp_path, tiny_llama_dir, "generation.backend=vllm", "vllm.dtype=bfloat16")
    assert not derived.log_probs_from_sampling(engine) and derived.on_policy_tolerance(engine) == 0.5
    engine32 = _cfg(tmp_path, tiny_llama_dir, "generation.backend=vllm", "vllm.dtype=float32")
    assert derived.on_policy_tolerance(engine32) == 1e-3
    mine = _cfg(tmp_path, tiny_llama_dir, "model.autocast=bfloat16",
                "generation.log_probs_from_sampling=true", "generation.on_policy_tolerance=0.1")
    assert derived.log_probs_from_sampling(mine) and derived.on_policy_tolerance(mine) == 0.1


def test_warmup_raises_the_policy_learning_rate_from_zero(tmp_path, tiny_llama_dir):
    """2 optimiser steps per iteration; a 3-step warm-up: after iteration 0 the policy's rate is
    at (2 + 1) / (3 + 1) of optim.lr, after iteration 1 at all of it."""
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "optim.warmup_steps=3", "optim.lr_schedule=constant",
                   "eval.every=0"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([0.75e-3, 1e-3])


def test_critic_warmup_holds_the_policy_while_the_value_head_learns(tmp_path, tiny_llama_dir):
    """optim.critic_warmup=1: iteration 0 trains the value head alone (the policy's rate is 0, so
    its ratio stays 1 through both minibatches and iteration 1 samples from the reference), and
    the adaptive KL coefficient waits; from iteration 1 the policy moves."""
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "optim.critic_warmup=1", "ppo.num_iterations=4",
                   "eval.every=0", "ppo.kl_target=1.0", "ppo.kl_horizon=4"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["policy/approxkl_avg"] < 1e-9 < 1e-6 < rows[1]["policy/approxkl_avg"]
    assert abs(rows[1]["objective/kl"]) < 1e-3 < abs(rows[2]["objective/kl"])
    assert rows[1]["loss/value_avg"] < rows[0]["loss/value_avg"]  # the head learned alone
    # the coefficient waits for the first batch of the moved policy (iteration 2), then adapts
    coefs = [r["objective/kl_coef"] for r in rows]
    assert coefs[0] == coefs[1] == coefs[2] != coefs[3]
    with pytest.raises(ValueError, match="optim.critic_warmup=3 iterations leave the policy none"):
        checks.check_config(_cfg(tmp_path, tiny_llama_dir, "optim.critic_warmup=3",
                                   "ppo.num_iterations=3"))
