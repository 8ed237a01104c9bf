"""The CUDA paths: ``python -m pytest -m gpu`` on a machine with a GPU (two for the NCCL tests).

Skipped, with the reason, where no GPU is visible. What runs: sampling on CUDA with per-row
streams, groups and values read off the sampling pass, on-policy against the training forward and
world-size invariant; the dense one-turn collection path equal to TorchRL's env path; the recipe
with the transformers backend (fp32, bf16 autocast, LoRA, groups, asynchronous overlap) and with
vLLM (sleep mode, overlap); vLLM's sleep mode freeing GPU memory; torchrun DDP and FSDP2 over NCCL
with 2 GPUs against 1. ``rlhf-torchrl bench gpu_suite`` times
them.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_rollouts

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.collectors.on_policy import check_on_policy
from rlhf_torchrl.modules import TokenLevelActor, load_causal_lm, make_critic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]
PROMPTS = [f"Prompt {i} " + "word " * (i % 5) for i in range(16)]


def _skip_without_vllm_on_cuda() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM built for CUDA: pip install vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("the installed vLLM is not a CUDA build")


def _collect(model, tokenizer, critic, *, rank: int, world_size: int, device) -> list:
    local = 8 // world_size
    env = make_generation_env(PROMPTS, tokenizer, batch_size=8, seed=3, rank=rank,
                              world_size=world_size, samples_per_prompt=2)
    gen = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=0.7,
                                 record_log_probs=True, samples_per_prompt=2,
                                 value_head=critic.head, device=device)
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=local, seed=7,
                                 row_offset=rank * local, samples_per_prompt=2, total_batches=2,
                                 device=device)
    rollouts = list(collector)
    collector.shutdown()
    return rollouts


def test_cuda_sampling_is_on_policy_and_world_size_invariant(tiny_llama_dir, tokenizer):
    """On CUDA, in groups of 2 with one prefill per group: recorded log-probs and values equal the
    training forward's, and 2 processes' shards are the 1-process batch row for row."""
    device = torch.device("cuda")
    model = load_causal_lm(tiny_llama_dir, tokenizer).to(device)
    critic = make_critic(policy=model, tokenizer=tokenizer, init="shared").to(device)
    torch.nn.init.normal_(critic.head.weight)
    whole = _collect(model, tokenizer, critic, rank=0, world_size=1, device=device)
    shards = [_collect(model, tokenizer, critic, rank=r, world_size=2, device=device) for r in (0, 1)]
    actor = TokenLevelActor(model, temperature=0.7, trunk_critic=critic)
    for k, rollout in enumerate(whole):
        assert rollout.get(K.RESPONSE_TOKENS).device.type == "cuda"
        stats = check_on_policy(rollout, actor, num_rows=8, atol=1e-3, critic=critic)
        assert stats["max_abs_diff"] < 1e-3 and stats["value_max_abs_diff"] < 1e-3
        texts = shards[0][k].get(K.RESPONSE_TEXT).tolist() + shards[1][k].get(K.RESPONSE_TEXT).tolist()
        assert rollout.get(K.RESPONSE_TEXT).tolist() == texts


def test_the_dense_path_collects_what_torchrls_env_collects_on_cuda(tiny_llama_dir, tokenizer):
    """On CUDA too, the dense one-turn path (no env reset or wrapper objects per batch) yields
    TorchRL's LLMCollector's rollouts key for key: groups, left padding, values and entropies."""
    device = torch.device("cuda")
    model = load_causal_lm(tiny_llama_dir, tokenizer).to(device).eval()
    head = torch.nn.Linear(model.config.hidden_size, 1).to(device)
    rollouts = {}
    for dense in (None, False):
        env = make_generation_env(PROMPTS, tokenizer, batch_size=8, seed=3, samples_per_prompt=2)
        gen = make_generation_policy(model, tokenizer, max_new_tokens=8, temperature=0.7,
                                     record_log_probs=True, record_entropy=True,
                                     samples_per_prompt=2, value_head=head, device=device)
        collector = RolloutCollector(env, gen, tokenizer=tokenizer, seed=7, samples_per_prompt=2,
                                     total_batches=3, device=device, dense=dense)
        assert (collector.collector is None) == (dense is None)
        rollouts[dense] = list(collector)
        collector.shutdown()
    for a, b in zip(rollouts[None], rollouts[False], strict=True):
        assert a.get(K.RESPONSE_TOKENS).device.type == "cuda"
        assert_same_rollouts(a, b)


VARIANTS = {
    "fp32": [],
    "bf16": ["model.autocast=bfloat16"],
    "lora": ["lora.r=8"],
    "rloo-groups": ["advantage.estimator=rloo", "generation.samples_per_prompt=2"],
    "overlap": ["collection.overlap=1"],
    "packed": ["model.packing=true", "ppo.micro_batch_tokens=256"],
    "packed-compiled-bf16": ["model.packing=true", "model.compile=true", "model.autocast=bfloat16"],
    # the compiled decode step (a static cache, CUDA graphs) under bf16 autocast: the on-policy
    # check against the training forward passes; fsdp2's one-process path runs in bench real_sizes
    "compiled-generation-bf16": ["generation.compile=true", "model.autocast=bfloat16"],
    "compiled-generation-fp32": ["generation.compile=true"],
    # the LM head's fp32 logits from three bf16 products (CUDA's bf16 x bf16 -> fp32 matmul):
    # 64 rows x 32 tokens a forward, past the 1,024 rows below which the head stays fp32
    "bf16x3-head": ["model.autocast=bfloat16", "model.lm_head_matmul=bf16x3", "ppo.batch_size=64",
                    "ppo.forward_batch_size=64", "ppo.num_mini_batches=1",
                    "generation.max_new_tokens=32", "data.limit=128"],
}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_recipe_variants_on_cuda(tmp_path, tiny_llama_dir, overrides):
    import ppo
    from test_recipe import _cfg

    report = ppo.train(_cfg(tmp_path, tiny_llama_dir, "device=cuda", *overrides))
    assert report["iterations"] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["objective/kl"]) and math.isfinite(r["loss/policy_avg"]) for r in rows)


def _vllm_model_dir(tmp_path, tokenizer) -> str:
    from conftest import _save_tiny, _tiny_llama

    # head size 32 (the tiny Llama's 8 is below what vLLM's kernels take)
    return _save_tiny(tmp_path / "model", _tiny_llama(tokenizer, hidden_size=128,
                                                      intermediate_size=256), tokenizer)


@pytest.mark.parametrize("overrides", [["vllm.sleep=true"],
                                       ["vllm.sleep=false", "collection.overlap=1"]],
                         ids=["sleep", "overlap"])
def test_recipe_with_vllm_on_cuda(tmp_path, tokenizer, overrides, caplog):
    """vLLM on the GPU beside the trainer: on-policy after each push, weights pushed every update."""
    _skip_without_vllm_on_cuda()
    import ppo
    from test_recipe import _cfg

    cfg = _cfg(tmp_path / "run", _vllm_model_dir(tmp_path, tokenizer), "device=cuda",
               "generation.backend=vllm", "vllm.gpu_memory_utilization=0.2",
               "value_model.init=shared", *overrides)
    with caplog.at_level("INFO"):
        report = ppo.train(cfg)
    assert report["iterations"] == 2
    assert any(r.message.startswith("On-policy check") for r in caplog.records)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["time/weight_sync"] > 0 and all(math.isfinite(r["objective/kl"]) for r in rows)


def test_vllm_sleep_mode_frees_gpu_memory(tokenizer):
    """Between batches the engine sleeps (KV cache freed, weights off the GPU) and wakes for the
    next push and batch, sampling on-policy again."""
    _skip_without_vllm_on_cuda()
    from conftest import _tiny_llama

    from rlhf_torchrl.collectors import WeightSync
    from rlhf_torchrl.collectors.backends.vllm import (
        VLLMGenerator,
        make_vllm_engine,
        make_vllm_generation_policy,
    )

    model = _tiny_llama(tokenizer, hidden_size=128, intermediate_size=256).cuda()
    engine = make_vllm_engine(model, tokenizer, max_model_len=128, device="cuda",
                              gpu_memory_utilization=0.2, sleep_mode=True)
    generator = VLLMGenerator(engine, temperature=0.7, sleep_between_batches=True)
    sync = WeightSync(model, generator)
    sync(0)
    awake_free = torch.cuda.mem_get_info()[0]
    env = make_generation_env(PROMPTS, tokenizer, batch_size=4, seed=0)
    policy = make_vllm_generation_policy(generator, tokenizer, max_new_tokens=8)
    collector = RolloutCollector(env, policy, tokenizer=tokenizer, batch_size=4, seed=1)
    batches = iter(collector)
    rollout = next(batches)
    asleep_free = torch.cuda.mem_get_info()[0]
    assert asleep_free > awake_free + 100 * 2**20  # the KV cache (a fifth of the GPU) went back
    sync(1)  # wakes, loads, samples again
    rollout = next(batches).to("cuda")
    check_on_policy(rollout, TokenLevelActor(model, temperature=0.7), atol=1e-2)
    collector.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_gpus_match_one(tmp_path, tiny_llama_dir, strategy):
    """torchrun over NCCL, one GPU per process, the same global batch: the metrics of every
    iteration agree with one GPU's (GPU reductions round in another order: 1e-3)."""
    from test_distributed import IGNORED, _run

    overrides = [f"distributed.strategy={strategy}", "value_model.init=shared"]
    one = _run(tmp_path / "one", tiny_llama_dir, 1, *overrides, device="cuda")
    two = _run(tmp_path / "two", tiny_llama_dir, 2, *overrides, device="cuda")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key, value in a.items():
            if key in IGNORED or key.startswith("time/") or "clipfrac" in key:
                continue
            assert b[key] == pytest.approx(value, rel=1e-3, abs=1e-4), (a["iteration"], key)


def test_the_bf16x3_head_on_cuda_is_fp32_to_16_bits_and_its_backward_bf16s():
    """CUDA has the bf16 -> fp32 matmul the split head needs (else the setting would fall back to
    fp32, with a warning); its logits are within 2**-14 of the fp32 product's scale, far inside a
    bf16 head's error, and its gradients are a bf16 backward's."""
    from rlhf_torchrl.functional.matmul import has_fp32_out_mm, split_bf16_linear

    device = torch.device("cuda")
    assert has_fp32_out_mm(device), "this torch has no torch.mm(..., out_dtype=torch.float32) on CUDA"
    torch.manual_seed(0)
    x = torch.randn(4, 300, 896, device=device, requires_grad=True)  # 1,200 rows: the split path
    w = (torch.randn(151936, 896, device=device) * 0.03).requires_grad_()
    out = split_bf16_linear(x, w)
    assert out.dtype == torch.float32
    with torch.no_grad():
        exact = x.double() @ w.double().T
        scale = exact.abs().max().item()
        error = (out.double() - exact).abs().max().item()
        bf16 = ((x.bfloat16() @ w.bfloat16().T).double() - exact).abs().max().item()
        assert error < scale * 2**-14 and error < bf16 / 50, (error, bf16, scale)
        assert not torch.equal(out, torch.nn.functional.linear(x, w))  # not the fp32 product
        del exact
    out.sum().backward()
    ones = torch.ones(4 * 300, 151936, device=device)
    assert torch.allclose(x.grad.reshape(-1, 896), ones @ w.detach(), rtol=1e-2, atol=1e-1)



def test_the_plan_times_its_one_layer_copies_on_this_gpu(tmp_path, tiny_llama_dir, monkeypatch):
    """On a CUDA GPU planned with its own profile, the seconds are timed on one-layer copies
    there (every row sampled, the batches whole, the layers read from CUDA events): each phase
    takes time, each layer's share is part of its call's, the table says where it was timed, and
    a profile named for another GPU plans from FLOPs instead."""
    import rlhf_torchrl.plan as plan
    from rlhf_torchrl.config import compose

    monkeypatch.setenv("RLHF_TORCHRL_CACHE", str(tmp_path / "cache"))
    cfg = compose([f"model.policy={tiny_llama_dir}", "device=cuda", "model.autocast=bfloat16",
                   "ppo.batch_size=8", "ppo.num_mini_batches=2", "generation.max_new_tokens=8",
                   "data.max_prompt_length=24", f"output_dir={tmp_path / 'run'}"])
    timed = plan.make_plan(cfg)
    assert timed.settings["times"] == "timed on one-layer copies on this GPU"
    assert all(timed.phases[p]["seconds"] > 0 for p in plan.PHASES)
    config = plan._config_of(str(tiny_llama_dir))
    work = plan.PhaseWork(rows=8, prompt=24, response=8, forward_rows=4, micro_rows=2,
                          minibatches=2, epochs=1, temperature=1.0, autocast="bfloat16",
                          dtype="float32", checkpointing=False, recompute=True,
                          sampled_entropy=False, critic="separate", exact_entropy=True, threads=1)
    figures = plan.timed_phases(config, work, repeats=1, device="cuda")["timed"]
    assert figures["old_quantities"]["rows"] == 4 and figures["update"]["rows"] == 2  # whole
    assert "generation_4_rows" not in figures  # every row sampled: no halved batch
    step = figures["generation_8_rows"]
    assert 0 < step["layer_step"] < step["step"] and 0 < step["layer_prefill"] < step["prefill"]
    assert 0 < sum(figures["old_quantities"]["layers"]) < figures["old_quantities"]["seconds"]
    other = plan.make_plan(cfg, profile=plan.PROFILES["H100"])
    assert other.settings["times"].startswith("FLOPs")
