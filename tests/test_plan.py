"""rlhf-torchrl plan: model shapes from config.json, activation bytes counted on tiny copies, the
start-up check refusing a run that cannot fit before any weight loads."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recipe import TINY, _cfg

from rlhf_torchrl.modules.shapes import ModelShape
from rlhf_torchrl.plan import (
    PROFILES,
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
    assert ModelShape.counted(config).params == real


def _small(model_type: str, **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 500,
        "pad_token_id": 0, **changes})


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi", "opt", "bloom", "mixtral", "qwen2_moe",
                                        "qwen3_moe", "gpt_oss"])
def test_counted_shapes_are_exact_where_the_widths_alone_are_not(model_type):
    """Non-gated MLPs (Pythia, Phi-2, OPT, BLOOM) and mixtures of experts: the widths' count is
    off (by a fifth to a factor of 4 here); counted on the meta device, the model's parameters,
    its trunk's and each layer's are the model's own."""
    from transformers import AutoModelForCausalLM

    config = _small(model_type, n_embd=64, n_layer=3, n_head=4, ffn_dim=160,
                    word_embed_proj_dim=64, moe_intermediate_size=48, num_experts=8,
                    num_local_experts=8, num_experts_per_tok=2,
                    shared_expert_intermediate_size=96)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    shape = ModelShape.counted(config)
    assert abs(ModelShape.from_config(config).params - real) / real > 0.05
    assert shape.params == real and shape.layers == 3
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    assert shape.trunk_params == real - (0 if tied else sum(p.numel() for p in head.parameters()))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == 3][0]
    assert shape.layer_params * 3 == sum(p.numel() for p in layers.parameters())


def test_a_mixture_of_experts_counts_the_experts_a_token_visits():
    """Memory holds every expert; a token's FLOPs go through the router, the shared expert and
    num_experts_per_tok of the routed ones: Mixtral's and Qwen2-MoE's layers by hand."""
    h, heads, kv, d, E, k = 64, 4, 2, 16, 8, 2
    attention = h * heads * d * 2 + h * kv * d * 2  # q, o; k, v
    mixtral = ModelShape.counted(_small("mixtral", num_local_experts=E, num_experts_per_tok=k))
    experts = E * 3 * h * 160  # gate, up, down of each expert (intermediate_size=160)
    assert mixtral.layer_params == attention + E * h + experts + 2 * h  # + router, norms
    assert mixtral.layer_matmul_params == attention + E * h + experts * k / E
    qwen = ModelShape.counted(_small("qwen2_moe", num_experts=E, num_experts_per_tok=k,
                                     moe_intermediate_size=48,
                                     shared_expert_intermediate_size=96))
    biases = heads * d + 2 * kv * d  # q, k, v have biases
    experts, shared = E * 3 * h * 48, 3 * h * 96 + h  # the shared expert and its gate
    assert qwen.layer_params == attention + biases + E * h + experts + shared + 2 * h
    assert qwen.layer_matmul_params == attention + E * h + shared + experts * k / E
    flops = qwen.forward_flops(rows=1, length=10, head_positions=0)
    assert flops == 3 * 2 * qwen.layer_matmul_params * 10 + 3 * 2 * heads * d * 100


def test_the_plan_holds_every_expert_of_a_mixture(tmp_path):
    """A mixture of experts planned from its config.json alone: the policy's weights are its
    every parameter (4 bytes each in fp32), whichever experts a token visits; the FLOPs count
    those it visits (2 of 8 here against all 8: fewer, by the layers' matmul weights)."""
    from transformers import AutoModelForCausalLM

    plans = {}
    for k in (2, 8):
        config = _small("mixtral", num_local_experts=8, num_experts_per_tok=k)
        config.save_pretrained(tmp_path / f"moe{k}")
        plans[k] = make_plan(_cfg(tmp_path, tmp_path / f"moe{k}", "model.autocast=null"),
                             profile=PROFILES["H100"])
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert plans[2].settings["params"] == plans[8].settings["params"] == real
    assert plans[2].components["policy weights"] == pytest.approx(real * 4 / 2**30)
    assert plans[2].components["policy weights"] == plans[8].components["policy weights"]
    few, every = (plans[k].phases["update"]["flops"] for k in (2, 8))
    assert few < 0.6 * every


@pytest.mark.parametrize("model", ["llama", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_layer_activations_extrapolate_to_the_real_width(autocast, model):
    """The bytes a layer keeps for the backward, counted on 1- and 2-layer copies at head widths 8
    and 16 and extrapolated, equal those of the model's own width counted directly (a mixture of
    experts, whose copies' inner widths are rounded to a multiple of 8 for its grouped matmuls:
    within 5% at these unaligned widths; DeepSeek's latent attention, its ranks and head parts
    scaled with the heads)."""
    from transformers import LlamaConfig, MixtralConfig

    from rlhf_torchrl.plan import _proxy, _saved_bytes

    widths = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000)
    config = {
        "llama": lambda: LlamaConfig(intermediate_size=688, **widths),
        "mixtral": lambda: MixtralConfig(intermediate_size=344, num_local_experts=4,
                                         num_experts_per_tok=2, **widths),
        "deepseek_v3": lambda: _small(
            "deepseek_v3", **{**widths, "num_key_value_heads": 4}, intermediate_size=512,
            moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192,
            qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_group=1, topk_group=1,
            head_dim=32)}[model]()
    real = ModelShape.from_config(config).head_dim
    per_token, _ = layer_activation_bytes(config, autocast, gradient_checkpointing=False)
    direct = {layers: _proxy(config, layers, real) for layers in (1, 2)}  # the real width
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


def test_a_model_folder_with_its_config_alone_plans(tmp_path, tiny_llama_dir):
    """A plan reads config.json alone (plan before downloading the weights); a run refuses it."""
    import shutil

    from rlhf_torchrl.config.model_checks import check_models
    from rlhf_torchrl.errors import ConfigError

    (tmp_path / "shape").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(tiny_llama_dir) / name).exists():
            shutil.copy(Path(tiny_llama_dir) / name, tmp_path / "shape" / name)
    cfg = _cfg(tmp_path, str(tmp_path / "shape"))
    assert make_plan(cfg, times=False).peak_gb > 0
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        check_models(cfg)


def test_fsdp2_divides_the_states_by_the_processes(tmp_path):
    cfg = _cfg(tmp_path, "qwen2.5-7b", "distributed.strategy=fsdp2", "model.autocast=bfloat16",
               "ppo.micro_batch_tokens=4096")
    h100 = DeviceProfile("H100", 79.6, 8e14, 5e13, 3e12)
    one = make_plan(cfg, world=1, profile=h100).phases["update"]["held"]
    eight = make_plan(cfg, world=8, profile=h100).phases["update"]["held"]
    assert eight["policy AdamW state"] == pytest.approx(one["policy AdamW state"] / 8)
    assert "FSDP2 gathered layers" in eight and "FSDP2 gathered layers" not in one


def test_the_bf16x3_head_is_planned_on_a_gpu_alone(tmp_path):
    """On a GPU profile the split head's forward is three bf16 products and its backward one, at
    the profile's bf16 rate, where fp32's run at its fp32 rate (Qwen2.5's 152k vocabulary: a
    quarter of the update); its operands are held while it runs, not both at once. A decoding
    step's few rows keep the fp32 product (generation unchanged). On this CPU (no bf16 -> fp32
    matmul) the head stays fp32: the same plan."""
    from rlhf_torchrl.functional.matmul import SPLIT_MIN_ROWS

    args = ("model.autocast=bfloat16", "ppo.micro_batch_tokens=8192", "ppo.batch_size=64",
            "ppo.forward_batch_size=32", "generation.max_new_tokens=128")
    h100 = DeviceProfile("H100", 79.6, 8e14, 5e13, 3e12)
    fp32, split = (make_plan(_cfg(tmp_path, "qwen2.5-0.5b", *args, f"model.lm_head_matmul={m}"),
                             profile=h100, prompt_tokens=128) for m in ("fp32", "bf16x3"))
    s = split.settings
    assert s["lm_head_matmul"] == {"generation": "fp32", "old_quantities": "bf16x3",
                                   "update": "bf16x3"}
    assert s["rows_per_process"] < SPLIT_MIN_ROWS
    head = 2 * 896 * 151936 * s["rows_per_process"] * s["response_tokens"]  # one forward's FLOPs
    assert fp32.phases["update"]["seconds"] - split.phases["update"]["seconds"] == pytest.approx(
        3 * head / 5e13 - 5 * head / 8e14, rel=1e-6)
    assert fp32.phases["old_quantities"]["seconds"] - split.phases["old_quantities"]["seconds"] \
        == pytest.approx(2 * head / 5e13 - 6 * head / 8e14, rel=1e-6)
    assert split.phases["generation"] == fp32.phases["generation"]
    operands = 3 * 151936 * 896 * 2 / 2**30
    assert split.phases["old_quantities"]["held"]["bf16x3 head operands"] == pytest.approx(operands)
    gradient = (s["micro_batch_tokens"] // (128 + s["response_tokens"]) * s["response_tokens"]
                + 896) * 151936 * 2 / 2**30  # the logits' gradient and the weight, in bf16
    assert split.phases["update"]["held"]["bf16x3 head operands"] == pytest.approx(
        max(operands, gradient))
    assert "bf16x3 head operands" not in fp32.components
    assert "the LM head bf16x3" in split.table() and "bf16x3" not in fp32.table()
    cpu = make_plan(_cfg(tmp_path, "qwen2.5-0.5b", *args, "model.lm_head_matmul=bf16x3",
                         "ppo.num_iterations=1"), prompt_tokens=128, times=False)
    assert set(cpu.settings["lm_head_matmul"].values()) == {"fp32"}
    assert "bf16x3 head operands" not in cpu.components


def test_the_check_refuses_a_run_that_cannot_fit_before_loading(tmp_path):
    """A 7B-shaped policy (a config.json alone: no weights to load) on this CPU: one line naming
    the phase, the largest component and settings that would lower it."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text((SHAPES_DIR / "qwen2.5-7b.json").read_text())
    cfg = _cfg(tmp_path / "run", str(model))
    with pytest.raises(Exception, match=r"needs about .* GiB .* largest part is policy AdamW") as e:
        check_fits(cfg)
    line = str(e.value)
    needed = float(re.search(r"needs about ([\d.]+) GiB", line)[1])
    offered = re.findall(r"([\w.]+=\w+) \(([\d.]+) GiB", line)
    assert "lora.r=16" in dict(offered)
    assert offered and all(float(gib) < needed for _, gib in offered), line
    assert [float(gib) for _, gib in offered] == sorted(float(gib) for _, gib in offered)


def test_the_fixes_offered_each_lower_the_peak_and_none_is_set_already(tmp_path, tiny_llama_dir):
    """Each setting the refusal offers was planned again and lowers the peak; a setting the run
    has already (the reference offloaded, checkpointing) is not offered, nor a micro-batch that is
    not smaller than the one planned (4 rows of ~30 tokens under a 4096-token budget: 120)."""
    from rlhf_torchrl.plan import fixes

    cfg = _cfg(tmp_path, tiny_llama_dir, "ppo.batch_size=4", "ppo.num_mini_batches=1",
               "ppo.micro_batch_tokens=4096", "model.offload_reference=true",
               "model.gradient_checkpointing=true")
    plan = make_plan(cfg, times=False, prompt_tokens=24)
    assert plan.settings["micro_batch_tokens"] == 4 * (24 + plan.settings["response_tokens"])
    small = DeviceProfile("cpu", plan.peak_gb * 0.9, 1e11, 1e11, 1e10)  # this host, less memory
    plan = make_plan(cfg, times=False, prompt_tokens=24, profile=small)
    assert not plan.fits()
    offered = fixes(cfg, plan)
    keys = [f.split("=")[0] for f in offered]
    assert "lora.r" in keys, offered
    micro = [int(f.split("=")[1].split()[0]) for f in offered if f.startswith("ppo.micro_batch")]
    assert all(m < plan.settings["micro_batch_tokens"] for m in micro)
    assert "model.offload_reference" not in keys and "model.gradient_checkpointing" not in keys
    for fix in offered:
        key, value = fix.split(" ")[0].split("=")
        again = make_plan(_cfg(tmp_path, tiny_llama_dir, "ppo.batch_size=4",
                               "ppo.num_mini_batches=1", "ppo.micro_batch_tokens=4096",
                               "model.offload_reference=true",
                               "model.gradient_checkpointing=true", f"{key}={value}"),
                          times=False, prompt_tokens=24, profile=small)
        assert again.peak_gb < plan.peak_gb
        assert f"({again.peak_gb:.1f} GiB" in fix


def test_gradient_checkpointing_plans_the_layers_forward_again():
    """Checkpointing recomputes each layer's forward in the backward: the update's FLOPs gain one
    forward of the layers (not of the head), per epoch."""
    from transformers import AutoConfig

    from rlhf_torchrl.modules.shapes import training_flops

    shape = ModelShape.from_config(AutoConfig.from_pretrained(SHAPES_DIR / "qwen2.5-0.5b.json"))
    assert training_flops(shape, 4, 300, 100, recompute=True) - training_flops(shape, 4, 300, 100) \
        == pytest.approx(shape.forward_flops(4, 300, 0))


def test_the_ppo_command_stops_under_a_memory_limit(tmp_path, tiny_llama_dir):
    """A run whose plan (~11 GiB: 64 rows x 128 response tokens of 49k-token logits, 7 copies of
    them in the update with the entropy bonus) fits this machine is refused under a 6 GiB
    address-space limit (ulimit -v), one line, before any weight loads; the same plan with the
    machine's memory fits."""
    heavy = ["ppo.batch_size=64", "ppo.forward_batch_size=64", "ppo.num_mini_batches=1",
             "data.limit=128",
             "generation.max_new_tokens=128", "value_model.init=policy"]
    plan = make_plan(_cfg(tmp_path, tiny_llama_dir, *heavy), times=False)
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
    assert plan["fits"] is True and plan["fixes"] == []
    # a plan that does not fit: still JSON alone on stdout, with the settings that lower it, and
    # exit status 1 (a script can check a run before it launches it)
    with pytest.raises(SystemExit) as stop:
        main(["model.policy=qwen2.5-7b", "--gpu", "H100", "--json", "model.autocast=bfloat16"])
    assert stop.value.code == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["fixes"] and all("GiB" in f for f in plan["fixes"])
    # the components are each at their largest over the phases
    for name, gib in plan["components"].items():
        assert gib == pytest.approx(max(ph["held"].get(name, 0.0) for ph in plan["phases"].values()))


@pytest.mark.parametrize("args,said", [
    (["ppo.batchsize=4"], "ppo.batchsize is not a setting: did you mean ppo.batch_size?"),
    (["ppo.batch_size=abc"], "ppo.batch_size"),
    (["task=nosuch"], "task=nosuch is not a task preset"),
    (["ppo.batch_size=0"], "ppo.batch_size"),
    (["task=custom", "advantage.estimator=nope"], "advantage.estimator='nope'"),
])
def test_the_plan_command_says_what_was_wrong_in_one_line(args, said):
    out = subprocess.run([sys.executable, "-m", "rlhf_torchrl.cli", "plan", *args],
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert out.returncode == 1 and len(errors) == 1 and said in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_the_plan_command_needs_no_data(capsys):
    """The plan reads no prompts: a task whose data is the user's to give plans without it."""
    from rlhf_torchrl.plan import main

    main(["task=custom", "--gpu", "H100", "model.policy=qwen2.5-0.5b"])
    assert "Plan for qwen2.5-0.5b" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--world-size=0", "--world-size=-2", "--prompt-tokens=-5",
                                  "--mean-prompt-tokens=0"])
def test_the_plan_command_refuses_numbers_below_one(flag, capsys):
    from rlhf_torchrl.plan import main

    with pytest.raises(SystemExit) as stop:
        main([flag])
    assert stop.value.code == 2 and "below 1" in capsys.readouterr().err


def test_on_a_cpu_the_plan_counts_the_process_itself(tmp_path, tiny_llama_dir):
    """On this CPU every phase holds ``runtime``, what the planning process holds (its resident
    set, the model's class imported); each phase's total is the sum of what it holds. A plan
    for a GPU has no runtime (the process is on the host, not on the device)."""
    from rlhf_torchrl.plan import GIB, PROFILES, runtime_bytes

    with open("/proc/self/status") as f:
        resident = int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) * 1024
    assert abs(runtime_bytes() - resident) < 64 * 2**20
    cfg = _cfg(tmp_path, tiny_llama_dir, "value_model.init=policy")
    before = runtime_bytes()
    plan = make_plan(cfg, times=False)
    runtime = plan.components["runtime"] * GIB
    assert before * 0.9 < runtime < runtime_bytes() * 1.1
    for phase in plan.phases.values():
        assert phase["held"]["runtime"] == plan.components["runtime"]
        assert phase["memory_gb"] == pytest.approx(sum(phase["held"].values()))
        assert "seconds" not in phase and "flops" not in phase  # times=False: memory alone
    assert plan.peak_gb > runtime / GIB
    assert "runtime" not in make_plan(cfg, profile=PROFILES["H100"], times=False).components


def test_the_old_quantities_count_the_policy_only_where_it_recomputes(tmp_path):
    """FLOPs of the old quantities: the reference's forward, the policy's too where the old
    log-probs are recomputed (bf16 autocast), not where the sampler recorded them (fp32), and a
    separate critic's trunk; counted by hand from the shape."""
    from transformers import AutoConfig

    from rlhf_torchrl.plan import PROFILES

    shape = ModelShape.from_config(AutoConfig.from_pretrained(SHAPES_DIR / "qwen2.5-0.5b.json"))
    rows, P, R = 8, 100, 6  # _cfg: ppo.batch_size=4 ... overridden here
    base = ["ppo.batch_size=8", "ppo.forward_batch_size=8", "value_model.init=policy",
            "generation.max_new_tokens=6"]
    critic = rows * (2 * shape.layers * shape.layer_matmul_params * (P + R)
                     + 2 * shape.layers * shape.heads * shape.head_dim * (P + R) ** 2)
    one = shape.forward_flops(rows, P + R, R)
    for autocast, forwards in (("null", 1), ("bfloat16", 2)):
        cfg = _cfg(tmp_path, "qwen2.5-0.5b", *base, f"model.autocast={autocast}")
        plan = make_plan(cfg, profile=PROFILES["H100"], prompt_tokens=P)
        assert plan.phases["old_quantities"]["flops"] == pytest.approx(forwards * one + critic)


def _work(**changes):
    from rlhf_torchrl.plan import PhaseWork

    settings = dict(rows=4, prompt=6, response=3, forward_rows=2, micro_rows=1, minibatches=2,
                    epochs=2, temperature=0.7, autocast=None, dtype="float32",
                    checkpointing=False, recompute=True, sampled_entropy=False,
                    critic="separate", exact_entropy=True, threads=1)
    return PhaseWork(**{**settings, **changes})


def test_timed_phases_add_the_missing_layers_to_the_one_layer_copy(tmp_path, monkeypatch):
    """Each phase's seconds from the one-layer copy's and one layer's, against a clock whose
    readings are set by hand (every timed call still runs once): generation, a prefill and 16
    steps timed, scaled to the response's 32 steps, and for 40 rows from 16 and 8; the old
    quantities, a forward batch times the batches; the update, a micro-batch times the
    micro-batches and a step per minibatch, times the epochs; a separate critic of 3 layers its
    own. The second plan of the same shapes reads them from the cache; --fresh times them
    again."""
    from transformers import LlamaConfig

    import rlhf_torchrl.plan as plan

    monkeypatch.setenv("RLHF_TORCHRL_CACHE", str(tmp_path))
    readings = iter([(0.5, [0.02]), (2.1, [0.34]),  # 16 rows: prefill; prefill + 16 steps
                     (0.3, [0.01]), (1.1, [0.17]),  # 8 rows
                     (2.0, [0.2, 0.1, 0.3]),  # old quantities: the copies; the layer of the
                     # policy's, the reference's, the critic's copy
                     (3.0, []), (0.4, []),  # the update: a micro-batch on the copies; a step
                     (0.05, []), (0.01, []),  # the policy's layer: forward + backward, its step
                     (0.07, []), (0.02, [])])  # the critic's
    calls = []

    def clock(fn, clocks, repeats):
        fn()
        calls.append(getattr(fn, "__name__", None) or fn.func.__name__)
        return next(readings)

    monkeypatch.setattr(plan, "_best_of", clock)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    critic = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 3})
    # 40 rows of 6 + 32 tokens; forward batches of 8 (5), micro-batches of 4 (10 an epoch)
    work = _work(rows=40, response=32, forward_rows=8, micro_rows=4, minibatches=5, epochs=2)
    timed = plan.timed_phases(config, work, critic)
    assert calls == ["prefill", "generation", "prefill", "generation", "old_quantities",
                     "micro_batch", "step", "forward_backward", "layer_step", "forward_backward",
                     "layer_step"]
    at = {16: (0.5 + 3 * 0.02) + 32 * ((2.1 - 0.5) + 3 * (0.34 - 0.02)) / 16,
          8: (0.3 + 3 * 0.01) + 32 * ((1.1 - 0.3) + 3 * (0.17 - 0.01)) / 16}
    assert timed["generation"] == pytest.approx(at[16] + 24 * (at[16] - at[8]) / 8)
    assert timed["old_quantities"] == pytest.approx(5 * (2.0 + 3 * (0.2 + 0.1) + 2 * 0.3))
    assert timed["update"] == pytest.approx(2 * (10 * (3.0 + 3 * 0.05 + 2 * 0.07)
                                                 + 5 * (0.4 + 3 * 0.01 + 2 * 0.02)))
    monkeypatch.setattr(plan, "_one_layer_copy", lambda *a: pytest.fail("not from the cache"))
    assert plan.timed_phases(config, work, critic) == timed
    monkeypatch.setattr(plan, "_FRESH", True)
    with pytest.raises(pytest.fail.Exception, match="not from the cache"):
        plan.timed_phases(config, work, critic)


def test_timed_phases_run_the_copies_for_real(tmp_path, monkeypatch):
    """Unclocked: the copies sample, run the old quantities and an update (bf16 autocast, a
    shared critic, gradient checkpointing); every phase takes time."""
    from transformers import LlamaConfig

    import rlhf_torchrl.plan as plan

    monkeypatch.setenv("RLHF_TORCHRL_CACHE", str(tmp_path))
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    for work in (_work(), _work(autocast="bfloat16", critic="shared", checkpointing=True,
                                recompute=False, sampled_entropy=True)):
        timed = plan.timed_phases(config, work, repeats=1)
        assert all(timed[p] > 0 for p in ("generation", "old_quantities", "update"))
        assert timed["timed"]["update"]["layer_micro_batch"][0] > 0


def test_the_start_up_check_times_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    """check_fits plans the memory alone (the seconds cost a timed copy): the PPO command's
    start-up never times anything."""
    import rlhf_torchrl.plan as plan

    monkeypatch.setattr(plan, "timed_phases", lambda *a, **k: pytest.fail("timed at start-up"))
    checked = check_fits(_cfg(tmp_path, tiny_llama_dir, "value_model.init=policy"))
    assert checked is not None and "seconds" not in checked.phases["update"]
    assert "peak" in checked.table() and "seconds" not in checked.table()


_COPIES = '''
import re, sys, torch
from rlhf_torchrl.collectors.sampling import InverseCDFSampler
from rlhf_torchrl.functional import entropy_from_logits, log_probs_from_logits

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024

B, R, V = 4, 64, 49152  # a copy: 48 MiB, above glibc's largest mmap threshold (32 MiB): the
one = B * R * V * 4     # resident set's high-water mark then follows the tensors alive
tokens, hidden, head = torch.randint(0, V, (B, R)), torch.randn(B, R, 32), torch.randn(V, 32)

def sampler(entropy):
    s = InverseCDFSampler(0.7, record=True, record_entropy=entropy)
    s.set_streams(list(range(B * R)))
    s(None, torch.randn(B * R, V))

def old_quantities(entropy):  # the policy (where it recomputes), then the reference
    with torch.no_grad():
        if entropy:
            logits = hidden @ head.T
            log_probs_from_logits(logits, tokens, 0.7)
            entropy_from_logits(logits.float() / 0.7)
            del logits
        log_probs_from_logits(hidden @ head.T, tokens, 0.7)

def update(entropy):
    h = hidden.clone().requires_grad_()
    logits = h @ head.T
    loss = log_probs_from_logits(logits, tokens, 0.7).sum()
    if entropy:  # the entropy bonus: ResponseTokenDistribution.entropy
        loss = loss + entropy_from_logits(logits.float() / 0.7).sum()
    loss.backward()

for name in ("sampler", "old_quantities", "update"):
    for flag in (False, True):
        globals()[name](flag)
        base = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")
        globals()[name](flag)
        print(name, flag, (status("VmHWM") - base) / one)
'''


def test_logit_copies_are_those_the_library_allocates():
    """The plan's vocabulary-sized copies per phase (LOGIT_COPIES) against a fresh process
    running the library's sampler, log-probs and entropies on logits large enough to be mapped
    one by one: its resident set's high-water mark, in copies of the logits."""
    from rlhf_torchrl.plan import LOGIT_COPIES

    out = subprocess.run([sys.executable, "-c", _COPIES], text=True, capture_output=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = {(phase, flag == "True"): float(copies)
                for phase, flag, copies in (line.split() for line in out.stdout.splitlines())}
    assert set(measured) == set(LOGIT_COPIES)
    for key, copies in measured.items():
        assert abs(copies - LOGIT_COPIES[key]) < 0.5, (key, copies)


def test_on_a_cpu_each_phase_holds_the_logits_the_others_freed(tmp_path, tiny_llama_dir):
    """With reuse_freed_memory (glibc keeps freed memory) each phase also holds the others'
    vocabulary-sized buffers, counted by hand here: 4 rows, 6 response tokens, forward batches
    and micro-batches of 2 rows, fp32 (the sampler's log-probs and entropies are kept: the
    reference alone in the old quantities), the sentiment task's entropy bonus."""
    from rlhf_torchrl.plan import GIB

    V, key = 49152, "logits kept by glibc"
    sampler, old, update = 6 * 4 * V * 4, 2 * 2 * 6 * V * 4, 7 * 2 * 6 * V * 4
    plan = make_plan(_cfg(tmp_path, tiny_llama_dir, "reuse_freed_memory=true"), times=False)
    held = {p: plan.phases[p]["held"] for p in plan.phases}
    assert held["generation"]["logits and sampler"] * GIB == pytest.approx(sampler)
    assert held["old_quantities"]["logits (forward batch)"] * GIB == pytest.approx(old)
    assert held["update"]["logits (micro-batch)"] * GIB == pytest.approx(update)
    assert held["generation"][key] * GIB == pytest.approx(old + update)
    assert held["old_quantities"][key] * GIB == pytest.approx(sampler + update)
    assert held["update"][key] * GIB == pytest.approx(sampler + old)
    alone = make_plan(_cfg(tmp_path, tiny_llama_dir, "reuse_freed_memory=false"), times=False)
    assert key not in alone.components


@pytest.mark.parametrize("model_type,targets", [
    ("llama", "all-linear"), ("gpt2", "all-linear"), ("gpt_neox", "all-linear"),
    ("qwen2_moe", "all-linear"), ("qwen3_moe", "all-linear"), ("mixtral", "all-linear"),
    ("llama", ["q_proj", "v_proj"]), ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
    ("mixtral", r".*\.self_attn\.(q|k)_proj")])
@pytest.mark.parametrize("peft", [True, False], ids=["peft", "without-peft"])
def test_the_plan_counts_the_adapters_peft_places(model_type, targets, peft):
    """LoRA's trained parameters as the plan counts them (PEFT itself on a meta-device copy)
    equal those PEFT adds to the real model: every linear layer but the head (GPT-2's Conv1D
    included), a mixture's fused experts where PEFT adapts them, a list of names, a regular
    expression. Without PEFT (a plan for a run elsewhere), its rule for linear layers: the same
    count wherever the targets are linear layers."""
    pytest.importorskip("peft", reason="LoRA needs the [peft] extra")
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.modules.lora import add_lora
    from rlhf_torchrl.modules.shapes import lora_params, meta_model
    from rlhf_torchrl.plan import _lora_params

    fused = model_type in ("qwen3_moe", "mixtral") and targets != r".*\.self_attn\.(q|k)_proj"
    if not peft and fused:
        pytest.skip("PEFT adapts the fused experts: only PEFT itself counts them")

    config = _small(model_type, n_embd=64, n_layer=3, n_head=4, num_experts=4,
                    num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    shared_expert_intermediate_size=96)
    model = add_lora(AutoModelForCausalLM.from_config(config), r=4, alpha=8, dropout=0.0,
                     target_modules=targets)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counted = (_lora_params(config, 4, targets) if peft
               else lora_params(meta_model(config), 4, targets, peft=False))
    assert trained > 0 and counted == trained


@pytest.mark.parametrize("model_type,layout", [
    ("llama", {}),
    ("gemma3_text", dict(sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                       "full_attention"])),
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(sliding_window=8, use_sliding_window=False)),
    ("qwen3_next", dict(layer_types=["linear_attention", "linear_attention", "full_attention"],
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)),
    ("deepseek_v3", dict(num_key_value_heads=4, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                         n_group=1, topk_group=1, moe_intermediate_size=32, q_lora_rank=32,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         first_k_dense_replace=1))])
def test_the_kv_cache_is_planned_as_transformers_lays_it_out(model_type, layout):
    """The plan's KV cache equals the bytes of the keys and values the model's own cache holds
    after a forward of 2 rows of 40 tokens: every layer's where they all attend to everything,
    the window less one in sliding layers (Gemma 3's 2 of 3, Mistral's all; Qwen2's setting off),
    none in linear-attention layers (Qwen3-Next's recurrent states are left out), DeepSeek's
    latent attention its compressed keys and values."""
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.plan import kv_cache_bytes, kv_cache_positions

    config = _small(model_type, **layout)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 500, (2, 40)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))
    assert kv_cache_bytes(config, rows=2, length=40, key_bytes=4, value_bytes=4) == held
    full = kv_cache_positions(_small("llama"), 40)
    assert (kv_cache_positions(config, 40) < full) == (model_type in ("gemma3_text", "mistral",
                                                                      "qwen3_next"))
    if model_type == "gemma3_text":  # a static cache (generation.compile) holds the whole window
        assert kv_cache_positions(config, 40, static=True) == 8 + 8 + 40


@pytest.mark.parametrize("model_type,layout,spans", [
    ("llama", {}, [("full", 0)] * 3),
    ("gemma3_text", dict(sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                       "full_attention"]),
     [("window", 8), ("window", 8), ("full", 0)]),
    ("mistral", dict(sliding_window=8), [("window", 8)] * 3),
    ("qwen2", dict(sliding_window=8, use_sliding_window=False), [("full", 0)] * 3),
    ("llama4_text", dict(attention_chunk_size=8, num_hidden_layers=4),
     [("chunk", 8)] * 3 + [("full", 0)]),
    ("qwen3_next", dict(layer_types=["linear_attention", "linear_attention", "full_attention"]),
     [("none", 0), ("none", 0), ("full", 0)]),
    # Gemma 3n: the last two layers read others' KV caches and still attend, over their windows
    ("gemma3n_text", dict(num_hidden_layers=5, num_kv_shared_layers=2, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * 2
                          + ["sliding_attention"], hidden_size_per_layer_input=8,
                          laurel_rank=8, altup_num_inputs=2, vocab_size_per_layer_input=500),
     [("window", 8), ("full", 0), ("window", 8), ("full", 0), ("window", 8)])])
def test_attention_flops_count_each_layers_span(model_type, layout, spans):
    """Each layer's attention as transformers masks it (sliding windows, chunks, linear attention:
    :func:`~rlhf_torchrl.modules.shapes.attention_spans`), and the FLOPs of its two matmuls over
    the pairs that span keeps, against a full-attention model of the same widths."""
    from rlhf_torchrl.modules.shapes import attended_pairs, attention_spans, decode_keys

    config = _small(model_type, **layout)
    assert list(attention_spans(config)) == spans
    shape = ModelShape.counted(config)
    full = dataclasses.replace(shape, spans=None)
    per_pair = 4 * shape.heads * shape.head_dim  # the scores and their values, 2 FLOPs a product
    assert shape.attention_flops_per_pair == per_pair
    for length in (5, 8, 40):
        saved = sum(attended_pairs(length, "full", 0) - attended_pairs(length, *span)
                    for span in spans)
        assert full.forward_flops(2, length, 1) - shape.forward_flops(2, length, 1) \
            == pytest.approx(2 * per_pair * saved)
    saved = sum(attended_pairs(30, "full", 0) - attended_pairs(30, *span)  # the prefill
                + decode_keys(30, 20, "full", 0) - decode_keys(30, 20, *span) for span in spans)
    assert full.decode_flops(2, 30, 20) - shape.decode_flops(2, 30, 20) == pytest.approx(
        2 * per_pair * saved)


@pytest.mark.parametrize("model_type,layout", [
    ("llama", {}), ("qwen2", {}), ("gemma3_text", dict(sliding_window=4)), ("gpt_neox", {}),
    ("phi", {}), ("opt", dict(ffn_dim=160, word_embed_proj_dim=64)),
    ("deepseek_v3", dict(num_key_value_heads=4, head_dim=8, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                         q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16))])
def test_forward_flops_equal_torchs_count_of_the_models_own_forward(model_type, layout):
    """The FLOPs of a forward, the LM head at every position, against torch's FlopCounterMode over
    the model's own forward (eager attention: the whole score matrix, of which the plan counts
    the causal half): equal for dense models of several families; DeepSeek's latent attention,
    its scores 24 wide and its values 16 (its ``head_dim`` is 8), by its attention's products
    (torch does not count its routed experts' grouped products)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    config = _small(model_type, n_embd=64, n_layer=3, n_head=4, **layout)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    rows, length = 2, 10
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(3, 500, (rows, length)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    shape = dataclasses.replace(ModelShape.counted(config), spans=None)  # as eager computes it
    attention = shape.forward_flops(rows, length, 0) - 2 * rows * length * shape.layers \
        * shape.layer_matmul_params
    assert counts["aten.bmm"] == 2 * attention  # the whole score matrix, the causal half twice
    if model_type != "deepseek_v3":
        assert shape.forward_flops(rows, length, length) == sum(counts.values()) - attention


def test_attended_pairs_and_decoding_keys_against_transformers_masks():
    """The query-key pairs counted per span against a plain loop over transformers' own mask
    functions (causal, with the sliding-window or the chunk overlay): at or under the mask's
    count, by no more than its diagonal (the FLOPs' count of full attention, the causal half);
    and by hand."""
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_overlay,
        sliding_window_overlay,
    )

    from rlhf_torchrl.modules.shapes import attended_pairs, decode_keys

    def kept(kind, size):
        overlay = {"full": lambda *a: True, "window": sliding_window_overlay(size or 1),
                   "chunk": chunked_overlay(size or 1, torch.zeros(1, dtype=torch.long))}[kind]
        return lambda q, k: causal_mask_function(0, 0, q, k) and bool(overlay(0, 0, q, k))

    for kind, size in (("full", 0), ("window", 4), ("window", 16), ("chunk", 3), ("chunk", 8)):
        mask = kept(kind, size)
        for length in (1, 3, 4, 7, 8, 12, 30):
            exact = sum(mask(q, k) for q in range(length) for k in range(length))
            assert exact - length / 2 <= attended_pairs(length, kind, size) <= exact
        for prompt, new in ((0, 6), (2, 5), (3, 20), (10, 9)):
            exact = sum(mask(q, k) for q in range(prompt, prompt + new) for k in range(q + 1))
            assert exact - new / 2 <= decode_keys(prompt, new, kind, size) <= exact
    assert attended_pairs(10, "window", 4) == 4 * 4 / 2 + 6 * 4
    assert attended_pairs(10, "chunk", 4) == 2 * 4 * 4 / 2 + 2 * 2 / 2
    assert attended_pairs(10, "none", 0) == 0 and decode_keys(5, 5, "none", 0) == 0
    # the keys before step t, t = 0..4, and half the step's own (the area under them): full
    # attention's 2 + t + 1/2, a window's min(2 + t + 1/2, 4), a chunk's (2 + t) % 4 + 1/2
    assert decode_keys(2, 5, "full", 0) == 2 + 3 + 4 + 5 + 6 + 5 / 2
    assert decode_keys(2, 5, "window", 4) == 2 + 3 + 4 + 4 + 4 + 2 / 2
    assert decode_keys(2, 5, "chunk", 4) == 2 + 3 + 0 + 1 + 2 + 5 / 2


def test_lora_settings_are_read_only_with_lora_on(tmp_path, tiny_llama_dir):
    """With LoRA off its other settings are not the plan's business: a null target list plans."""
    cfg = _cfg(tmp_path, tiny_llama_dir, "lora.r=0", "lora.target_modules=null")
    assert make_plan(cfg, times=False).peak_gb > 0


@pytest.mark.parametrize("model_type,dense", [
    ("deepseek_v3", dict(first_k_dense_replace=1)), ("qwen3_moe", dict(mlp_only_layers=[0])),
    ("deepseek_v3", dict(first_k_dense_replace=3))])
def test_the_copies_take_a_mixtures_typical_layer(model_type, dense):
    """A mixture of experts whose first layer is dense (DeepSeek's first_k_dense_replace,
    Qwen-MoE's mlp_only_layers): the one-layer copy that is timed and the copies whose
    activations are counted have expert layers, as most of the model's layers are; where most
    are dense (3 of 4), a dense one."""
    from rlhf_torchrl.plan import _one_layer_copy, _proxy

    config = _small(model_type, num_hidden_layers=4, n_routed_experts=4, num_experts=4,
                    num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                    head_dim=16 if model_type == "qwen3_moe" else 8, **dense)
    typical = max(dense.get("first_k_dense_replace", 0), len(dense.get("mlp_only_layers", []))) < 2
    for model in (_one_layer_copy(config, torch.float32, None, False), _proxy(config, 2, 8)):
        names = [n for n, _ in model.named_parameters()]
        assert any(".experts." in n for n in names) == typical


def test_a_model_whose_copies_fail_gets_one_line(tmp_path, tiny_llama_dir, monkeypatch, caplog):
    """Where the narrow copies of a model's class fail, the plan says so in one line (the PPO
    command's check then warns and the run goes on unchecked), not with the copies' traceback."""
    import rlhf_torchrl.plan as plan
    from rlhf_torchrl.errors import ConfigError

    def fail(*args):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    monkeypatch.setenv("RLHF_TORCHRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan, "_count_layer_activations", fail)
    cfg = _cfg(tmp_path, tiny_llama_dir)
    with pytest.raises(ConfigError, match="cannot count the activations of LlamaConfig's model: "
                                          "its copies at narrow widths failed"):
        make_plan(cfg, times=False)
    assert check_fits(cfg) is None and "goes on unchecked" in caplog.text


@pytest.mark.parametrize("model_type", ["bloom", "falcon", "codegen", "gpt_oss", "deepseek_v3",
                                        "gemma3", "qwen3_next"])
def test_published_layouts_plan(tmp_path, model_type):
    """Classes the narrow copies once failed on, at their default (published-size) widths cut to
    2 layers: no SDPA (BLOOM; the copies take the class's own attention), a derived head width
    and a differently named MLP width (Falcon), a partial rotary width (CodeGen), 32 or 256
    experts (gpt-oss, DeepSeek-V3: the copies keep 8), a multimodal model (Gemma 3: its language
    model's layers), linear-attention first layers (Qwen3-Next). Each plans, its activations
    counted, from its config.json alone."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config()
    text.num_hidden_layers = 2
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:2]
    config.save_pretrained(tmp_path / model_type)
    plan = make_plan(_cfg(tmp_path, tmp_path / model_type, "model.autocast=bfloat16"),
                     profile=PROFILES["H100"], times=False)
    assert plan.phases["update"]["held"]["policy activations"] > 0


@pytest.mark.parametrize("lora", ["lora.r=0", "lora.r=4"])
def test_the_start_up_check_leaves_the_runs_random_stream_alone(tmp_path, tiny_llama_dir,
                                                                  monkeypatch, lora):
    """The check runs after the run is seeded and builds copies of the model (a cold cache: the
    activations counted; LoRA: PEFT on a meta copy): the run's random stream is the seeded one
    after it all the same, whether the plan's caches were warm or not (a resumed run matches the
    uninterrupted one)."""
    if lora != "lora.r=0":
        pytest.importorskip("peft", reason="LoRA needs the [peft] extra")
    import rlhf_torchrl.plan as plan

    monkeypatch.setenv("RLHF_TORCHRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan, "_SHAPES", {})
    monkeypatch.setattr(plan, "_ADAPTERS", {})
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert check_fits(_cfg(tmp_path, tiny_llama_dir, lora)) is not None
    assert torch.equal(torch.rand(4), expected)
