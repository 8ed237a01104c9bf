"""rlhf-torchrl plan: model shapes from config.json, activation bytes counted on tiny copies, the
start-up check refusing a run that cannot fit before any weight loads."""

import json
import subprocess
import sys

import pytest
import torch
from test_recipe import TINY, _cfg

from rlhf_torchrl.modules.shapes import ModelShape
from rlhf_torchrl.plan import (
    SHAPES_DIR,
    DeviceProfile,
    check_fits,
    layer_activation_bytes,
    make_plan,
)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "gpt2", "llama"])
def test_shapes_count_the_parameters_of_the_model(name):
    """ModelShape.params equals the parameters transformers builds from the config (meta device),
    to the norms' and biases' few thousands."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig

    config = {"gpt2": lambda: GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000),
              "llama": lambda: LlamaConfig(hidden_size=256, intermediate_size=688,
                                           num_hidden_layers=3, num_attention_heads=8,
                                           num_key_value_heads=2, vocab_size=1000,
                                           tie_word_embeddings=False)}.get(
        name, lambda: AutoConfig.from_pretrained(SHAPES_DIR / f"{name}.json"))()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    assert abs(ModelShape.from_config(config).params - real) / real < 0.01


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_layer_activations_extrapolate_to_the_real_width(autocast):
    """The bytes a layer keeps for the backward, counted on 1- and 2-layer copies at head widths 8
    and 16 and extrapolated, equal those of the model's own width counted directly."""
    from transformers import LlamaConfig

    from rlhf_torchrl.plan import _proxy, _saved_bytes

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    per_token, _ = layer_activation_bytes(config, autocast, gradient_checkpointing=False)
    direct = {layers: _proxy(config, layers, 64) for layers in (1, 2)}  # head width 64 = real
    one_layer = {t: _saved_bytes(direct[2], t, autocast) - _saved_bytes(direct[1], t, autocast)
                 for t in (32, 64)}
    measured = (one_layer[64] - one_layer[32]) / 32
    assert per_token == pytest.approx(measured, rel=0.05)
    checkpointed, _ = layer_activation_bytes(config, autocast, gradient_checkpointing=True)
    assert checkpointed < per_token / 4  # only the layers' inputs stay


def test_plan_holds_every_phase_and_a_bigger_batch_needs_more(tmp_path, tiny_llama_dir):
    cfg = _cfg(tmp_path, tiny_llama_dir, "value_model.init=policy")
    plan = make_plan(cfg)
    assert set(plan.phases) == {"generation", "old_quantities", "update"}
    held = plan.phases["update"]["held"]
    assert held["policy AdamW state"] == pytest.approx(2 * held["policy gradients"])
    assert "critic activations" in held and "reference" in held
    bigger = make_plan(_cfg(tmp_path, tiny_llama_dir, "value_model.init=policy",
                            "ppo.batch_size=64", "ppo.forward_batch_size=64"))
    assert bigger.peak_gb > plan.peak_gb
    lora = make_plan(_cfg(tmp_path, tiny_llama_dir, "lora.r=4"))
    assert "reference" not in lora.phases["update"]["held"]  # the adapters off
    assert all(p["flops"] > 0 and p["seconds"] > 0 for p in plan.phases.values())


def test_fsdp2_divides_the_states_by_the_processes(tmp_path):
    cfg = _cfg(tmp_path, "qwen2.5-7b", "distributed.strategy=fsdp2", "model.autocast=bfloat16",
               "ppo.micro_batch_tokens=4096")
    h100 = DeviceProfile("H100", 79.6, 8e14, 5e13, 3e12)
    one = make_plan(cfg, world=1, profile=h100).phases["update"]["held"]
    eight = make_plan(cfg, world=8, profile=h100).phases["update"]["held"]
    assert eight["policy AdamW state"] == pytest.approx(one["policy AdamW state"] / 8)
    assert "FSDP2 gathered layers" in eight and "FSDP2 gathered layers" not in one


def test_the_check_refuses_a_run_that_cannot_fit_before_loading(tmp_path):
    """A 7B-shaped policy (a config.json alone: no weights to load) on this CPU: one line naming
    the phase, the largest component and settings that would lower it."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text((SHAPES_DIR / "qwen2.5-7b.json").read_text())
    cfg = _cfg(tmp_path / "run", str(model))
    with pytest.raises(Exception, match=r"needs about .* GiB .* largest part is policy AdamW") as e:
        check_fits(cfg)
    assert "model.gradient_checkpointing=true" in str(e.value)


def test_the_ppo_command_stops_under_a_memory_limit(tmp_path, tiny_llama_dir):
    """A run whose plan (~10 GiB: 64 rows x 256 response tokens of 49k-token logits) fits this
    machine is refused under a 6 GiB address-space limit (ulimit -v), one line, before any weight
    loads; the same plan with the machine's memory fits."""
    heavy = ["ppo.batch_size=64", "ppo.forward_batch_size=64", "ppo.num_mini_batches=1",
             "data.limit=128",
             "generation.max_new_tokens=256", "value_model.init=policy"]
    plan = make_plan(_cfg(tmp_path, tiny_llama_dir, *heavy))
    assert 6 < plan.peak_gb < 20
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
            "from rlhf_torchrl.cli import main; main(sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "ppo", f"output_dir={tmp_path / 'run'}",
                          f"model.policy={tiny_llama_dir}", *TINY, *heavy, "device=cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "needs about" in lines[0] and "GiB" in lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_command_prints_the_table_and_json(capsys):
    from rlhf_torchrl.plan import main

    main(["model.policy=qwen2.5-1.5b", "--gpu", "H200", "model.autocast=bfloat16",
          "task=gsm8k", "ppo.batch_size=256"])
    out = capsys.readouterr().out
    assert "policy AdamW state" in out and "peak" in out and "NVIDIA H200" in out
    main(["model.policy=qwen2.5-0.5b", "--gpu", "H100", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["peak_phase"] in ("generation", "old_quantities", "update")
