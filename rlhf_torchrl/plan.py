"""``rlhf-torchrl plan``: a PPO run's memory per device and time per phase, before any weight loads.

The plan reads each model's ``config.json`` and the run's settings, and adds up what each phase
holds on one device:

- the policy's weights (``model.dtype``), gradients and AdamW's two moments (fp32 master weights:
  4 + 4 + 8 bytes a trained parameter; LoRA: the adapters' alone), a separate critic's the same,
  a shared critic's value head; FSDP2 divides them by the processes and adds the gathered layers;
- the reference (none with LoRA: the adapters off; none resident with ``offload_reference``) and
  the reward model;
- generation: the KV cache of the batch (a static one of ``data.max_prompt_length`` +
  ``max_new_tokens`` with ``generation.compile``, kept between batches: every phase holds it) and
  one step's fp32 logits; with vLLM, the
  engine's ``vllm.gpu_memory_utilization`` share of the device, in every phase unless it sleeps;
- the old quantities: ``forward_batch_size`` rows' fp32 logits at the response positions;
- the update: the activations autograd keeps for the largest micro-batch, counted on a 1- and
  2-layer copy of the model's own class at two widths (``torch.autograd.graph.saved_tensors_hooks``
  on tiny random weights, in the run's precision and gradient checkpointing), and the fp32 logits,
  their saved softmax and gradient at the response positions; under autocast, the bf16 copies of
  the weights a forward keeps;
- after the first update, the gradients stay allocated (``zero_grad`` runs as a minibatch starts).

Times come from FLOPs (:mod:`~rlhf_torchrl.modules.shapes`) over a device profile: the matmul
FLOP/s and copy bandwidth measured once (``rlhf-torchrl plan --profile-device``, cached in
``~/.cache/rlhf_torchrl/device_profile.json``), the share of that peak training matmuls reach,
and generation's cost per decoding step beyond its FLOPs (the per-layer kernel launches of eager
decoding; one graph replay when compiled). :data:`PROFILES` holds the figures measured on the
GPUs this project was lent; ``docs/scaling.md`` compares the plan with measured runs.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rlhf_torchrl.modules.shapes import ModelShape, training_flops

GIB = 2**30
PHASES = ("generation", "old_quantities", "update")
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: packaged model shapes (``rlhf_torchrl/benchmarks/model_configs``) a plan may name in place of
#: a model directory: Qwen2.5's published configs, no weights
SHAPES_DIR = Path(__file__).parent / "benchmarks" / "model_configs"


@dataclass
class DeviceProfile:
    """What the time estimates divide by.

    Args:
        name: the device.
        memory_gb: its memory (GiB).
        bf16_flops: measured bf16 matmul FLOP/s (8192^3 products on a GPU).
        fp32_flops: measured fp32 matmul FLOP/s.
        bandwidth: measured copy bandwidth, bytes/s read + written.
        train_efficiency: the share of ``bf16_flops`` (``fp32_flops`` without autocast) a training
            forward and backward of these models reaches.
        decode_step_s: eager decoding's cost per step and layer beyond its FLOPs (kernel launches,
            the sampler); ``decode_step_compiled_s`` the same per step of a compiled decode.
        source: where the figures come from.
    """

    name: str
    memory_gb: float
    bf16_flops: float
    fp32_flops: float
    bandwidth: float
    train_efficiency: float = 0.3
    decode_step_s: float = 1e-3
    decode_step_compiled_s: float = 8e-3
    source: str = ""


#: measured here (docs/scaling.md, "Real sizes"): the H200 by ``bench real_sizes`` on 2026-11-28
#: (its efficiencies fitted on Qwen2.5-0.5B, checked on 1.5B); the H100 matmul and copy figures
#: from the lent machine's 2026-11-13 reading, the rest taken as the H200's (the same chip)
PROFILES = {
    "H200": DeviceProfile("NVIDIA H200", 139.8, 7.8e14, 5.0e13, 4.1e12, train_efficiency=0.17,
                          decode_step_s=1.0e-3, decode_step_compiled_s=8.0e-3,
                          source="measured on a lent H200, 2026-11-28"),
    "H100": DeviceProfile("NVIDIA H100 80GB HBM3", 79.6, 7.98e14, 5.0e13, 3.0e12,
                          train_efficiency=0.17, decode_step_s=1.0e-3,
                          decode_step_compiled_s=8.0e-3,
                          source="matmul and copy measured on a lent H100, 2026-11-13; the rest "
                                 "the H200's"),
}


def profile_path() -> Path:
    root = Path(os.environ.get("RLHF_TORCHRL_CACHE", Path.home() / ".cache" / "rlhf_torchrl"))
    return root / "device_profile.json"


def measure_device(device: torch.device) -> DeviceProfile:
    """The device's matmul FLOP/s (bf16 and fp32) and copy bandwidth, best of 5 each (a few
    seconds), and its memory; the efficiencies of the nearest profile in :data:`PROFILES` (a GPU)
    or of a CPU."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    flops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        flops[dtype] = 2 * n**3 / best(lambda a=a: a @ a)
    big = torch.empty(2**28 if cuda else 2**26, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    bandwidth = 2 * big.numel() / best(lambda: other.copy_(big))
    if cuda:
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory / GIB
        known = next((p for key, p in PROFILES.items() if key in name), PROFILES["H100"])
        rest = {"train_efficiency": known.train_efficiency, "decode_step_s": known.decode_step_s,
                "decode_step_compiled_s": known.decode_step_compiled_s}
    else:
        name, memory = "cpu", _host_memory_gb()
        rest = {"train_efficiency": 0.5, "decode_step_s": 2e-4, "decode_step_compiled_s": 2e-3}
    return DeviceProfile(name, memory, flops[torch.bfloat16], flops[torch.float32], bandwidth,
                         source="measured by rlhf-torchrl plan --profile-device", **rest)


def device_profile(device: torch.device, gpu: str | None = None) -> DeviceProfile:
    """The profile the plan uses: ``gpu`` (a key of :data:`PROFILES`) when given, else the cached
    measurement of this device, else for a CUDA device the :data:`PROFILES` entry its name
    matches, else a CPU's memory with nominal rates (``--profile-device`` measures them)."""
    if gpu is not None:
        return PROFILES[gpu]
    cached = _read_profiles().get(_device_key(device))
    if cached is not None:
        return DeviceProfile(**cached)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((p for key, p in PROFILES.items() if key in name), PROFILES["H100"])
    return DeviceProfile("cpu", _host_memory_gb(), 1e11, 1e11, 1e10, 0.5, 2e-4, 2e-3,
                         source="nominal: run rlhf-torchrl plan --profile-device to measure")


def save_profile(device: torch.device, profile: DeviceProfile) -> Path:
    profiles = _read_profiles()
    profiles[_device_key(device)] = asdict(profile)
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profiles, indent=1))
    return path


def _read_profiles() -> dict:
    try:
        return json.loads(profile_path().read_text())
    except (OSError, ValueError):
        return {}


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()}"


def _host_memory_gb() -> float:
    """The memory this process may use on the host: the least of the RAM, the address-space
    limit (``ulimit -v``) and the cgroup's ``memory.max``."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        limits.append(int(fields["MemTotal"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cgroup.isdigit():
            limits.append(int(cgroup))
    except OSError:
        pass
    return min(limits) / GIB if limits else float("inf")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- activations, counted on a tiny copy of the model's class ----------------------------------


def _proxy(config, layers: int, head_dim: int):
    """A random ``layers``-layer model of ``config``'s class whose widths are ``config``'s scaled
    so that a head is ``head_dim`` wide (the same heads, the MLP scaled alike), a 64-token vocab."""
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    shape = ModelShape.from_config(config)
    scale = head_dim / shape.head_dim
    for name, value in (("num_hidden_layers", layers), ("n_layer", layers),
                        ("hidden_size", shape.heads * head_dim), ("n_embd", shape.heads * head_dim),
                        ("head_dim", head_dim),
                        ("intermediate_size", max(2, round(shape.intermediate * scale))),
                        ("n_inner", max(2, round(shape.intermediate * scale))),
                        ("vocab_size", 64), ("tie_word_embeddings", False)):
        if hasattr(small, name) and getattr(small, name) is not None:
            setattr(small, name, value)
    for name in ("layer_types", "max_window_layers"):  # per-layer lists follow the layer count
        if isinstance(getattr(small, name, None), list):
            setattr(small, name, getattr(small, name)[:layers])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(small, attn_implementation="sdpa").train()


def _saved_bytes(model, tokens: int, autocast: torch.dtype | None) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward over ``tokens`` (each
    storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 64, (1, tokens))
    context = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else torch.autocast("cpu", enabled=False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        model.base_model(ids)  # the trunk: the LM head's logits are counted apart
    return sum(seen.values())


def layer_activation_bytes(config, autocast: torch.dtype | None,
                           gradient_checkpointing: bool) -> tuple[float, float]:
    """(bytes a decoder layer keeps per token for the backward, bytes a forward keeps whatever the
    tokens: the weights' cast copies under autocast), at ``config``'s widths.

    Counted on 1- and 2-layer copies at head widths 8 and 16 and 32 and 64 tokens: the difference
    between the layer counts is one layer, between the token counts its per-token part, and both
    grow linearly with the width, which gives them at the real width.
    """
    shape = ModelShape.from_config(config)
    per_token, fixed = {}, {}
    for width in (8, 16):
        saved = {}
        for layers in (1, 2):
            model = _proxy(config, layers, width)
            if gradient_checkpointing:
                model.config.use_cache = False
                enable = (getattr(model, "activation_checkpointing_enable", None)
                          or model.gradient_checkpointing_enable)  # (transformers < 5.2x)
                enable({"use_reentrant": False})
            for tokens in (32, 64):
                saved[layers, tokens] = _saved_bytes(model, tokens, autocast)
        layer = {t: saved[2, t] - saved[1, t] for t in (32, 64)}
        per_token[width] = (layer[64] - layer[32]) / 32
        fixed[width] = layer[32] - 32 * per_token[width]
    # bytes(width) = slope * width + intercept, at the real head width
    def at(values: dict) -> float:
        slope = (values[16] - values[8]) / 8
        return max(0.0, values[8] + slope * (shape.head_dim - 8))

    # under autocast a forward keeps the bf16 copy of each fp32 weight (none with checkpointing:
    # recomputed); this grows with the width squared, so it is counted, not extrapolated
    weight_copies = 2 * shape.layer_matmul_params if autocast is not None else 0
    return at(per_token), 0.0 if gradient_checkpointing else weight_copies


# ---- the plan ----------------------------------------------------------------------------------


@dataclass
class Plan:
    """A run's memory per device by component and phase, and its time per phase.

    Args:
        components: name -> GiB on one device.
        phases: phase -> {"memory_gb", "flops", "seconds", "peak": the components it holds}.
        device: the profile the times come from.
        settings: what the plan read from the config.
    """

    components: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    device: DeviceProfile | None = None
    settings: dict = field(default_factory=dict)

    @property
    def peak_gb(self) -> float:
        return max(p["memory_gb"] for p in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["memory_gb"])

    def fits(self, headroom: float = 0.95) -> bool:
        return self.peak_gb <= headroom * self.device.memory_gb

    def table(self) -> str:
        lines = [f"Plan for {self.settings['policy']} on {self.device.name} "
                 f"({self.device.memory_gb:.1f} GiB; {self.settings['world']} process(es), "
                 f"{self.settings['strategy']}, {self.settings['precision']})", "",
                 "memory per device (GiB)    " + "".join(f"{p:>16}" for p in PHASES)]
        for name in self.components:
            row = [self.phases[p]["held"].get(name) for p in PHASES]
            if any(row):
                lines.append(f"  {name:<25}" + "".join(
                    f"{v:>16.2f}" if v else f"{'-':>16}" for v in row))
        lines.append(f"  {'total':<25}" + "".join(f"{self.phases[p]['memory_gb']:>16.2f}"
                                                   for p in PHASES))
        lines += ["", f"peak {self.peak_gb:.1f} GiB in {self.peak_phase} "
                  f"({100 * self.peak_gb / self.device.memory_gb:.0f}% of the device)", "",
                  "time per iteration        " + "".join(f"{p:>16}" for p in PHASES)]
        lines.append(f"  {'TFLOPs':<25}" + "".join(f"{self.phases[p]['flops'] / 1e12:>16.1f}"
                                                    for p in PHASES))
        lines.append(f"  {'seconds':<25}" + "".join(f"{self.phases[p]['seconds']:>16.2f}"
                                                     for p in PHASES))
        total = sum(self.phases[p]["seconds"] for p in PHASES)
        lines += [f"  about {total:.1f} s an iteration ({self.device.source})"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"components": self.components, "phases": self.phases,
                "device": asdict(self.device), "settings": self.settings,
                "peak_gb": self.peak_gb, "peak_phase": self.peak_phase}


def _config_of(name: str):
    from rlhf_torchrl.config.model_checks import _model_config

    packaged = SHAPES_DIR / f"{name}.json"
    if packaged.exists():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(packaged)
    return _model_config("model.policy", name)


def _lora_params(shape: ModelShape, r: int) -> int:
    per_layer = (shape.hidden + shape.heads * shape.head_dim  # q
                 + 2 * (shape.hidden + shape.kv_heads * shape.head_dim)  # k, v
                 + shape.heads * shape.head_dim + shape.hidden  # o
                 + (3 if shape.gated_mlp else 2) * (shape.hidden + shape.intermediate))
    return r * per_layer * shape.layers


def make_plan(cfg, *, world: int | None = None, profile: DeviceProfile | None = None,
              prompt_tokens: int | None = None, mean_prompt_tokens: float | None = None) -> Plan:
    """The plan of the composed PPO config ``cfg``.

    Args:
        cfg: the composed PPO config (``rlhf_torchrl.config.compose``).
        world: the processes (None: torchrun's ``WORLD_SIZE``, else 1).
        profile: the device's profile (None: :func:`device_profile` of ``cfg.device``).
        prompt_tokens: the longest prompt in tokens (None: ``data.max_prompt_length``, the bound
            every prompt is checked against): the memory's.
        mean_prompt_tokens: the mean prompt in tokens, the FLOPs' (None: ``prompt_tokens``).
    """
    from rlhf_torchrl.config.derived import precision
    from rlhf_torchrl.modules.models import torch_dtype
    from rlhf_torchrl.runtime import resolve_device

    m, p, g = cfg.model, cfg.ppo, cfg.generation
    world = world or int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(cfg.device)
    profile = profile or device_profile(device)
    config = _config_of(m.policy)
    shape = ModelShape.from_config(config)
    if m.autocast == "auto" and profile.name != "cpu":  # planned for a GPU: bf16 there
        amp = torch.bfloat16 if m.dtype == "float32" else None
    else:
        name = precision(cfg)[0]
        amp = torch_dtype(name) if name else None
    fsdp = cfg.distributed.strategy == "fsdp2" and world > 1
    shard = world if fsdp else 1
    wb = _BYTES[m.dtype]
    P = prompt_tokens or cfg.data.max_prompt_length
    R = g.max_new_tokens * max(1, cfg.env.max_turns)
    T = P + R
    rows = p.batch_size // world
    from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS

    needs_critic = ADVANTAGE_ESTIMATORS.get(cfg.advantage.estimator).needs_critic
    critic_kind = cfg.value_model.init if needs_critic else None

    held: dict[str, float] = {}
    trained = _lora_params(shape, cfg.lora.r) if cfg.lora.r else shape.params
    held["policy weights"] = shape.params * wb / shard
    if cfg.lora.r:
        held["policy weights"] += trained * 4
    held["policy gradients"] = trained * 4 / shard
    held["policy AdamW state"] = trained * 8 / shard
    if critic_kind is not None and critic_kind != "shared":
        critic_name = cfg.value_model.name_or_path or (
            cfg.reward.model if critic_kind == "reward_model" else m.policy)
        cconfig = _config_of(critic_name)
        cshape = ModelShape.from_config(cconfig)
        ctrained = _lora_params(cshape, cfg.lora.r) if cfg.lora.critic and cfg.lora.r else cshape.trunk_params
        held["critic weights"] = cshape.trunk_params * wb / shard
        held["critic gradients"] = ctrained * 4 / shard
        held["critic AdamW state"] = ctrained * 8 / shard
    else:
        cshape = None
        if critic_kind == "shared":
            held["critic weights"] = shape.hidden * wb
    if not cfg.lora.r:  # (an offloaded reference visits the device for the old quantities)
        ref = _config_of(m.reference) if m.reference else config
        reference = ModelShape.from_config(ref).params * wb / shard
        if not m.offload_reference:
            held["reference"] = reference
    if cfg.reward.model:
        rm = ModelShape.from_config(_config_of(cfg.reward.model))
        held["reward model"] = rm.trunk_params * _BYTES[cfg.reward.model_dtype]

    # generation: the KV cache (keys fp32 after the rotary embedding under autocast, values in
    # the matmul's dtype; a static cache both in the autocast dtype) and a step's logits
    act_bytes = 2 if amp is not None else wb
    kv_len = (cfg.data.max_prompt_length + g.max_new_tokens) if g.compile else T
    kv_dim = shape.kv_heads * shape.head_dim
    key_bytes = act_bytes if g.compile else (4 if amp is not None else wb)
    kv = rows * kv_len * shape.layers * kv_dim * (key_bytes + act_bytes)
    # autocast's bf16 copies of fp32 weights, kept while a forward runs (FSDP2 gathers bf16
    # layers instead: its mixed precision)
    casts = shape.params * 2 if amp is not None and wb == 4 and not fsdp else 0
    generation = {"KV cache": kv, "logits and sampler": 3 * rows * shape.vocab * 4,
                  "bf16 weight copies": casts}
    if g.compile:  # the static cache is kept for the next batch: every phase holds it
        held["static KV cache"] = generation.pop("KV cache")
    engine_awake = 0.0
    from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS

    backend = GENERATION_BACKENDS.get(g.backend)
    engine = backend.engine_memory(cfg, profile.memory_gb * GIB, cuda=profile.name != "cpu")
    if engine is not None:  # the engine takes its share of the device: weights and KV cache
        generation = {f"{backend.label} engine": engine[0]}
        engine_awake = engine[1]  # what it keeps while the trainer runs (sleep mode: nothing)
    # the old quantities: a forward batch's fp32 logits at the response positions, ~3 copies
    # (logits, their exponentials, the entropies)
    fb = min(p.forward_batch_size, rows)
    old = {"logits (forward batch)": 3 * fb * R * shape.vocab * 4,
           "bf16 weight copies": casts}
    if not cfg.lora.r and m.offload_reference:
        old["reference (offloaded, visiting)"] = reference
    # the update's largest micro-batch
    if p.micro_batch_tokens:
        micro_tokens = p.micro_batch_tokens
        micro_rows = max(1, p.micro_batch_tokens // T)
    else:
        micro_rows = max(1, rows // p.num_mini_batches // p.gradient_accumulation_steps)
        micro_tokens = micro_rows * T
    per_token, fixed = layer_activation_bytes(config, amp, m.gradient_checkpointing)
    fixed = 0.0 if fsdp else fixed
    acts = shape.layers * (per_token * micro_tokens + fixed)
    update = {"policy activations": acts,
              "policy logits (fp32, 3 copies)": 3 * micro_rows * R * shape.vocab * 4}
    if cshape is not None:
        c_token, c_fixed = ((per_token, fixed) if critic_name == m.policy else  # the policy's
                            layer_activation_bytes(cconfig, amp, m.gradient_checkpointing))
        update["critic activations"] = cshape.layers * (c_token * micro_tokens
                                                        + (0.0 if fsdp else c_fixed))
    if fsdp:  # the layers FSDP2 gathers whole: the running one and the one prefetched
        gathered = 2 * shape.layer_matmul_params * act_bytes
        for phase in (generation, old, update):
            phase["FSDP2 gathered layers"] = gathered

    if engine_awake:
        old[f"{backend.label} engine"] = update[f"{backend.label} engine"] = engine_awake
    # from the second iteration on every phase holds the moments and the gradients
    phases = {}
    for name, transient in (("generation", generation), ("old_quantities", old),
                            ("update", update)):
        parts = {**held, **transient}
        phases[name] = {"held": {k: v / GIB for k, v in parts.items()},
                        "memory_gb": sum(parts.values()) / GIB}
    components = {k: v / GIB for k, v in {**held, **generation, **old, **update}.items()}

    # FLOPs and seconds
    critic_flops = (lambda n, L, heads: 0.0) if cshape is None else (
        lambda n, L, heads: cshape.forward_flops(n, L, heads))
    Pm = mean_prompt_tokens or P  # FLOPs: micro-batches of similar lengths pad little
    T = Pm + R
    gen_flops = shape.decode_flops(rows, int(Pm), g.max_new_tokens)
    old_flops = (shape.forward_flops(rows, T, R) * (1 if cfg.lora.r else 2)
                 + critic_flops(rows, T, 0))
    epochs = p.num_ppo_epochs
    upd_flops = epochs * (training_flops(shape, rows, T, R)
                          + (0 if cshape is None else training_flops(cshape, rows, T, 0)))
    head_flops = 2 * shape.hidden * shape.vocab * rows * R  # fp32 under autocast
    peak = profile.bf16_flops if amp is not None else profile.fp32_flops
    eff = profile.train_efficiency

    def compute_s(flops: float, head: float) -> float:
        return (flops - head) / (eff * peak) + head / profile.fp32_flops

    step = profile.decode_step_compiled_s if g.compile else profile.decode_step_s * shape.layers
    gen_s = g.max_new_tokens * step + compute_s(gen_flops, 0) + g.max_new_tokens * (
        shape.params * act_bytes + kv / 2) / profile.bandwidth
    phases["generation"].update(flops=gen_flops, seconds=gen_s)
    phases["old_quantities"].update(flops=old_flops,
                                    seconds=compute_s(old_flops, 2 * head_flops))
    phases["update"].update(flops=upd_flops, seconds=compute_s(upd_flops, 3 * epochs * head_flops))
    settings = {"policy": m.policy, "params": shape.params, "world": world,
                "strategy": "fsdp2" if fsdp else ("ddp" if world > 1 else "one process"),
                "precision": f"{'bf16 autocast' if amp is not None else m.dtype} over {m.dtype} weights",
                "rows_per_process": rows, "prompt_tokens": P, "response_tokens": R,
                "micro_batch_tokens": micro_tokens, "activation_bytes_per_token_layer": per_token,
                "critic": critic_kind, "lora_r": cfg.lora.r,
                "gradient_checkpointing": bool(m.gradient_checkpointing)}
    return Plan(components=components, phases=phases, device=profile, settings=settings)


def fixes(plan: Plan) -> list[str]:
    """Settings that would lower the peak, for the refusal's line."""
    s = plan.settings
    out = []
    if not s["gradient_checkpointing"]:
        out.append("model.gradient_checkpointing=true")
    out.append(f"ppo.micro_batch_tokens={max(256, s['micro_batch_tokens'] // 2)}")
    if s["world"] > 1 and s["strategy"] != "fsdp2":
        out.append("distributed.strategy=fsdp2")
    if not s["lora_r"]:
        out.append("lora.r=16")
    out.append("model.offload_reference=true")
    return out


def check_fits(cfg, prompt_tokens: int | None = None) -> Plan | None:
    """The PPO command's start-up check: stop before any weight loads when the plan's peak
    passes the device's memory (a CUDA GPU's; on a CPU the least of the RAM, ``ulimit -v`` and the
    cgroup's limit), with one line naming the largest component and settings that lower it.
    Returns the plan; None where none could be made (a model whose class the plan cannot copy:
    the run goes on, a warning says why).

    Args:
        cfg: the composed PPO config.
        prompt_tokens: the prompt set's longest prompt (None: ``data.max_prompt_length``).
    """
    import logging

    from rlhf_torchrl.errors import ConfigError

    try:
        plan = make_plan(cfg, prompt_tokens=prompt_tokens)
    except Exception as error:  # noqa: BLE001 - a plan is advice; the run does not need one
        logging.getLogger(__name__).warning("No memory plan for this run (%s: %s); it goes on "
                                            "unchecked.", type(error).__name__, error)
        return None
    phase = plan.phases[plan.peak_phase]
    if not plan.fits():
        largest = max(phase["held"], key=phase["held"].get)
        raise ConfigError(
            f"This run needs about {plan.peak_gb:.1f} GiB on one device in its {plan.peak_phase} "
            f"phase, more than the {plan.device.memory_gb:.1f} GiB {plan.device.name} has for it; "
            f"the largest part is {largest} ({phase['held'][largest]:.1f} GiB). Try "
            f"{', '.join(fixes(plan))} (rlhf-torchrl plan <overrides> shows the whole plan).")
    return plan


def main(argv: list[str]) -> None:
    """``rlhf-torchrl plan [--profile-device] [--gpu H100] [--world-size N] [--json] overrides``."""
    import argparse

    from rlhf_torchrl.config import compose
    from rlhf_torchrl.runtime import resolve_device

    parser = argparse.ArgumentParser(
        prog="rlhf-torchrl plan",
        description="A PPO run's memory per device and time per phase, from the config and each "
                    "model's config.json, before any weight loads. model.policy may also name a "
                    f"packaged shape ({', '.join(sorted(p.stem for p in SHAPES_DIR.glob('*.json')))}).")
    parser.add_argument("--profile-device", action="store_true",
                        help="measure this device's matmul FLOP/s and bandwidth (a few seconds) "
                             "and cache them for later plans")
    parser.add_argument("--gpu", choices=sorted(PROFILES), default=None,
                        help="plan for this GPU's profile instead of this machine's device")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes (GPUs) the run will use (default: WORLD_SIZE or 1)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="the longest prompt in tokens (default: data.max_prompt_length, the "
                             "bound; the PPO command's own check uses the prompt set's longest)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", help="the PPO run's overrides")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.gpu and not any(o.startswith("device=") for o in overrides):
        overrides.append("device=cpu")  # planned for, not used
    cfg = compose([*overrides, "output_dir=outputs/plan"])
    device = resolve_device(cfg.device)
    if args.profile_device:
        profile = measure_device(device)
        print(f"profiled {profile.name}: bf16 {profile.bf16_flops / 1e12:.1f} TFLOP/s, fp32 "
              f"{profile.fp32_flops / 1e12:.1f} TFLOP/s, {profile.bandwidth / 1e9:.0f} GB/s; "
              f"saved to {save_profile(device, profile)}")
    profile = device_profile(device, args.gpu)
    plan = make_plan(cfg, world=args.world_size, profile=profile, prompt_tokens=args.prompt_tokens)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, default=float))
    else:
        print(plan.table())
    if not plan.fits():
        print(f"\nDoes not fit: try {', '.join(fixes(plan))}.")
