"""``rlhf-torchrl plan``: a PPO run's memory per device and time per phase, before any weight loads.

The plan reads each model's ``config.json`` and the run's settings, and adds up what each phase
holds on one device:

- the policy's weights (``model.dtype``; its parameters counted on the ``meta`` device,
  :meth:`~rlhf_torchrl.modules.shapes.ModelShape.counted`: every expert of a mixture), gradients
  and AdamW's two moments (fp32 master weights: 4 + 4 + 8 bytes a trained parameter; LoRA: the
  adapters' alone, on the modules ``lora.target_modules`` names, as PEFT places them), a separate
  critic's the same, a shared critic's value head; FSDP2 divides them by the processes and adds
  the gathered layers;
- the reference (none with LoRA: the adapters off; none resident with ``offload_reference``),
  the reward model and on-policy distillation's teacher (``reward.teacher``; visiting the old
  quantities alone with ``reward.teacher_offload``);
- generation: the KV cache of the batch, laid out as transformers lays it out for the model
  (sliding and linear-attention layers, latent attention: :func:`kv_cache_bytes`; a static one of
  ``data.max_prompt_length`` + ``max_new_tokens`` with ``generation.compile``, kept between
  batches: every phase holds it) and one step's fp32 logits; with vLLM, the
  engine's ``vllm.gpu_memory_utilization`` share of the device, in every phase unless it sleeps;
- the old quantities: ``forward_batch_size`` rows' fp32 logits at the response positions;
- the update: the activations autograd keeps for the largest micro-batch, counted on a 1- and
  2-layer copy of the model's own class at two widths (``torch.autograd.graph.saved_tensors_hooks``
  on tiny random weights, in the run's precision, gradient checkpointing and attention
  implementation; a multimodal model's language model, a mixture's typical layer with 8 of its
  routed experts), and the fp32 logits, their saved softmax and gradient at the response
  positions; under autocast, the bf16 copies of the weights a forward keeps;
- with ``model.lm_head_matmul=bf16x3`` on a GPU, where a head call has 1,024 rows or more, the
  LM head's weight in three bf16 parts while its forward runs, or in the backward the logits'
  gradient and the weight in bf16, whichever is larger; its forward's seconds are three bf16
  products, its backward's bf16 ones, where fp32's run at the profile's fp32 rate;
- after the first update, the gradients stay allocated (``zero_grad`` runs as a minibatch starts);
- on a CPU, ``runtime``: the process itself before any weight loads (Python, torch,
  transformers and the model's class, this library), read from the planning process's resident
  set (:func:`runtime_bytes`): in the PPO command's start-up check that is the run's own process,
  its tokenizer and prompts included; ``rlhf-torchrl plan``'s process has neither (tens of MB).

On the machine's own device (its CPU, or a CUDA GPU it plans for with that GPU's profile) the
seconds are timed on one-layer copies of the models at their real widths and vocabularies,
doing each phase's work (on a CPU a bounded share of it) with the run's sampler, precision,
LM head and optimiser, one layer timed alone and counted ``layers - 1`` more times
(:func:`timed_phases`; a second or two the first time a shape is planned, then read from
``~/.cache/rlhf_torchrl/plan_cache.json``). Elsewhere (another GPU's profile, LoRA, several
processes, vLLM, a compiled decode step, packing, several turns) they come from FLOPs
(:mod:`~rlhf_torchrl.modules.shapes`) over a device profile: the matmul FLOP/s and copy
bandwidth measured once (``rlhf-torchrl plan --profile-device``, cached in
``~/.cache/rlhf_torchrl/device_profile.json``), the share of that peak training matmuls reach,
and generation's cost per decoding step beyond its FLOPs (the per-layer kernel launches of eager
decoding; one graph replay when compiled). :data:`PROFILES` holds the figures measured on the
GPUs this project was lent; ``docs/scaling.md`` compares the plan with measured runs, on those
GPUs and on a 2-core CPU (``rlhf-torchrl bench plan_check``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rlhf_torchrl.functional.matmul import SPLIT_MIN_ROWS
from rlhf_torchrl.modules.shapes import (
    EXPERT_COUNTS,
    ModelShape,
    attention_spans,
    decoder_layers,
    language_model_config,
    lora_params,
    meta_model,
    routed_experts,
    training_flops,
)

GIB = 2**30
PHASES = ("generation", "old_quantities", "update")
#: (phase, with entropies) -> the vocabulary-sized fp32 tensors alive at once, as multiples of
#: the logits: the sampler's per decoding step (the step's logits and its temporaries; recording
#: exact entropies: more); the old quantities' per forward batch (the policy's logits, their
#: temperature-scaled copy, softmax and product for the exact entropy where the policy
#: recomputes; else the reference's logits and exponentials); the update's per micro-batch
#: (logits, the exponentials kept for the backward and the gradient; with the entropy bonus
#: also its saved softmax and scaled logits and their gradients). Measured as the resident
#: memory of a process running the library's functions on logits above glibc's mmap threshold
#: (tests/test_plan.py checks them).
LOGIT_COPIES = {("sampler", False): 5, ("sampler", True): 6,
                ("old_quantities", False): 2, ("old_quantities", True): 4,
                ("update", False): 3, ("update", True): 7}
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
        profile = DeviceProfile(**cached)
        if device.type == "cpu":  # the limits are this process's (ulimit -v, the cgroup's), now
            profile.memory_gb = _host_memory_gb()
        return profile
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((p for key, p in PROFILES.items() if key in name), PROFILES["H100"])
    return DeviceProfile("cpu", _host_memory_gb(), 1e11, 1e11, 1e10, 0.5, 2e-4, 2e-3,
                         source="nominal: run rlhf-torchrl plan --profile-device to measure")


def save_profile(device: torch.device, profile: DeviceProfile) -> Path:
    """Cache ``profile`` as ``device``'s, and forget the phases timed on it before (the next plan
    of each shape times its copies again)."""
    profiles = _read_profiles()
    profiles[_device_key(device)] = asdict(profile)
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profiles, indent=1))
    _forget_timings(_device_key(device))
    return path


def _forget_timings(device_key: str) -> None:
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return
    stale = [k for k in cache if k.startswith(_cache_key("timed", device_key, ""))]
    if stale:
        for key in stale:
            del cache[key]
        tmp = cache_path().with_name(f"{cache_path().name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_path())


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


def runtime_bytes() -> int:
    """What this process holds now (its resident set, ``VmRSS``): on a CPU the run's memory that
    no model accounts for (Python, torch, transformers and the model's class, this library; in
    the PPO command's own check, the tokenizer and the prompts as well). 0 where
    ``/proc/self/status`` cannot be read."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process on this machine has used since boot (``/proc/stat``: all but idle
    and I/O wait; None where it cannot be read): minus a process's own, what others used."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _import_model_class(config) -> None:
    """Import the module of ``config``'s causal-LM class (what loading it will import anyway; the
    import's memory is the run's too)."""
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - a class transformers does not map: counted when built
        pass


# ---- what the plan measured once, kept on disk ------------------------------------------------


def cache_path() -> Path:
    """The plan's measurements by shape and settings (activation counts, timed copies)."""
    return profile_path().parent / "plan_cache.json"


def _config_key(config) -> str:
    import hashlib

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype",
                           "architectures", "_commit_hash")}
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


_SHAPES: dict[str, tuple] = {}


def _counted(config) -> tuple:
    """(``config``'s shape with its parameters counted on the ``meta`` device, that meta model or
    None), built once per config in this process."""
    key = _config_key(config)
    if key not in _SHAPES:
        model = meta_model(config)
        _SHAPES[key] = ModelShape.counted(config, model), model
    return _SHAPES[key]


def _shape(config) -> ModelShape:
    """``config``'s shape, its parameters counted (:meth:`ModelShape.counted`)."""
    return _counted(config)[0]


def _cache_key(*parts) -> str:
    return "|".join(str(p) for p in parts)


#: measure again whatever is asked for, ignoring the cache (``rlhf-torchrl plan --fresh``)
_FRESH = False


def _cache_get(key: str):
    if _FRESH:
        return None
    try:
        return json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def _cache_put(key: str, value):
    """Store ``value`` under ``key`` (a file replaced whole: a reader never sees half of it);
    returns ``value``. Nothing is stored where the cache cannot be written."""
    path = cache_path()
    try:
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


# ---- activations, counted on a tiny copy of the model's class ----------------------------------


def _proxy(config, layers: int, head_dim: int, attention: str | None = None):
    """A random ``layers``-layer model of ``config``'s class whose widths are ``config``'s scaled
    so that a head is ``head_dim`` wide (the same heads, the MLP scaled alike), a 64-token vocab,
    with the run's attention implementation ``attention`` (None: transformers' default for the
    class: SDPA where it has it)."""
    from transformers import AutoModelForCausalLM

    config = language_model_config(config)
    small = copy.deepcopy(config)
    shape = ModelShape.from_config(config)
    scale = head_dim / shape.head_dim
    # a mixture of experts' grouped matmuls need rows of a multiple of 16 bytes: its inner
    # widths are scaled to a multiple of 8 (the published ones are: there this changes nothing)
    align = 8 if routed_experts(config)[0] else 1

    def inner(width: int) -> int:
        return max(2, align, align * round(width * scale / align))

    for name, value in (("num_hidden_layers", layers), ("n_layer", layers),
                        ("hidden_size", shape.heads * head_dim), ("n_embd", shape.heads * head_dim),
                        ("head_dim", head_dim),
                        ("intermediate_size", inner(shape.intermediate)),
                        ("n_inner", inner(shape.intermediate)),
                        # a mixture of experts': each expert's and the shared experts' alike;
                        # latent attention's (DeepSeek's) ranks and head parts alike; the MLP
                        # widths some classes name otherwise (Falcon's, OPT's)
                        *((name, inner(getattr(config, name)))
                          for name in ("moe_intermediate_size", "shared_expert_intermediate_size",
                                       "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                       "v_head_dim", "ffn_hidden_size", "ffn_dim", "d_ff")
                          if isinstance(getattr(config, name, None), int)),
                        ("qk_rope_head_dim", head_dim),  # (the head_dim latent attention reads)
                        # the rotary part of a head (GPT-J's, CodeGen's) alike
                        *((name, max(2, 2 * round(getattr(config, name) * scale / 2)))
                          for name in ("rotary_dim", "rotary_emb_base_dim")
                          if isinstance(getattr(config, name, None), int)),
                        ("vocab_size", 64), ("tie_word_embeddings", False)):
        if hasattr(small, name) and getattr(small, name) is not None:
            try:
                setattr(small, name, value)
            except AttributeError:  # a width derived from the others (Falcon's head_dim)
                pass
    if isinstance(getattr(small, "qk_head_dim", None), int):  # (a sum its config keeps)
        small.qk_head_dim = small.qk_nope_head_dim + small.qk_rope_head_dim
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the 64-token vocab
        if isinstance(getattr(small, name, None), int) and getattr(small, name) >= 64:
            setattr(small, name, None)
    experts, routed = routed_experts(config)
    if experts > _PROXY_EXPERTS:  # a token's activations are its routed experts', however many
        for name in EXPERT_COUNTS:
            if isinstance(getattr(small, name, None), int):
                setattr(small, name, max(_PROXY_EXPERTS, 2 * routed))
        for name in ("n_group", "topk_group"):  # (group routing: one group of them)
            if isinstance(getattr(small, name, None), int):
                setattr(small, name, 1)
    _first_layers(small, layers, shape.layers)
    meta = meta_model(small)  # (a width the scaling missed would make a big copy: refused)
    held = 0 if meta is None else sum(p.numel() for p in meta.parameters())
    if held > _PROXY_PARAMS:
        raise ValueError(f"a narrow copy of {type(config).__name__}'s model would hold "
                         f"{held:,} parameters: some of its widths are not scaled with its heads")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(small, attn_implementation=attention).train()


#: the most parameters a narrow copy may hold (a 64-token vocabulary, heads 8 or 16 wide), and the
#: most routed experts it keeps (or twice those a token visits)
_PROXY_PARAMS, _PROXY_EXPERTS = 100_000_000, 8


def _first_layers(small, layers: int, total: int) -> None:
    """Make ``small`` (a copy of a config of ``total`` layers, its layer count set to ``layers``)
    describe its model's typical layers: the per-layer lists cut to ``layers``, and a mixture of
    experts' few dense layers (DeepSeek's and GLM-MoE's ``first_k_dense_replace``, Qwen-MoE's
    ``mlp_only_layers``, fewer than half the layers) made expert layers like the rest."""
    for name in ("layer_types", "max_window_layers"):  # per-layer lists follow the layer count
        if isinstance(getattr(small, name, None), list):
            setattr(small, name, getattr(small, name)[:layers])
    dense = getattr(small, "first_k_dense_replace", None)
    if isinstance(dense, int) and 0 < dense < total / 2:
        small.first_k_dense_replace = 0
    only = getattr(small, "mlp_only_layers", None)
    if isinstance(only, list) and 0 < len(only) < total / 2:
        small.mlp_only_layers = []


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
        model.base_model(ids, use_cache=False)  # the trunk (the LM head's logits: apart)
    return sum(seen.values())


def layer_activation_bytes(config, autocast: torch.dtype | None, gradient_checkpointing: bool,
                           attention: str | None = None) -> tuple[float, float]:
    """(bytes a decoder layer keeps per token for the backward, bytes a forward keeps whatever the
    tokens: the weights' cast copies under autocast), at ``config``'s widths.

    Counted on 1- and 2-layer copies at head widths 8 and 16 and 32 and 64 tokens: the difference
    between the layer counts is one layer, between the token counts its per-token part, and both
    grow linearly with the width, which gives them at the real width. The count is kept in
    :func:`cache_path` per model shape, precision, checkpointing and attention implementation
    (``model.attn_implementation``; None: the class's default), and the next plan of the same
    shape reads it: no copy is built.
    """
    key = _cache_key("activations", _config_key(config), str(autocast), bool(gradient_checkpointing),
                     *([attention] if attention else []))
    cached = _cache_get(key)
    if cached is None:
        try:
            counted = _count_layer_activations(config, autocast, gradient_checkpointing,
                                               attention)
        except Exception as error:  # noqa: BLE001 - a class whose narrow copies do not run
            from rlhf_torchrl.errors import ConfigError

            raise ConfigError(
                f"The plan cannot count the activations of {type(config).__name__}'s model: "
                f"its copies at narrow widths failed ({type(error).__name__}: {error}). The "
                "PPO command runs such a model without its memory check; "
                "RLHF_TORCHRL_TRACEBACK=1 shows where the copies failed.") from error
        cached = _cache_put(key, list(counted))
    return tuple(cached)


def _count_layer_activations(config, autocast, gradient_checkpointing,
                             attention=None) -> tuple[float, float]:
    shape = ModelShape.from_config(config)
    per_token, fixed = {}, {}
    for width in (8, 16):
        saved = {}
        for layers in (1, 2):
            model = _proxy(config, layers, width, attention)
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
    weight_copies = 2 * _shape(config).layer_params if autocast is not None else 0
    return at(per_token), 0.0 if gradient_checkpointing else weight_copies


# ---- seconds on this device: each phase's work timed on a one-layer copy ----------------------

#: what a timed copy runs at most, whatever the run's sizes (the rest is scaled): decoding
#: steps, and on a CPU rows sampled (more: a second, halved batch gives the cost of a row) and
#: tokens of a forward batch or micro-batch (a CPU's matmuls run at their full rate from a few
#: hundred; a GPU's copies sample every row and run the run's batches whole)
_TIMED_STEPS, _TIMED_ROWS, _TIMED_TOKENS = 16, 16, 512


@dataclass(frozen=True)
class PhaseWork:
    """The shapes of one process's work per iteration, what :func:`timed_phases` times.

    Args:
        rows: responses sampled per iteration.
        prompt: prompt tokens per row (padded).
        response: response tokens per row.
        forward_rows: rows per no-grad forward (``ppo.forward_batch_size``).
        micro_rows: rows per micro-batch of the update.
        minibatches: minibatches per epoch (an optimiser step each).
        epochs: passes over the rollout.
        temperature: the sampling temperature.
        autocast: the autocast dtype's name (None: the weights' dtype).
        dtype: the weights' dtype.
        checkpointing: gradient checkpointing in the update.
        recompute: the policy recomputes the old log-probs (its forward in ``old_quantities``).
        sampled_entropy: the sampler records exact entropies.
        critic: ``separate`` (its own trunk), ``shared`` (a head on the policy's) or None.
        exact_entropy: the old entropies from the softmax (else the sample estimate).
        threads: torch's CPU threads.
        attention: ``model.attn_implementation`` (None: sdpa).
        reuse_freed_memory: the run keeps freed memory in glibc's heap (``reuse_freed_memory``):
            the timing process does too (it is then this process's setting for good), or every
            large tensor is mapped and faulted in anew.
        lm_head_matmul: ``model.lm_head_matmul`` (``bf16x3``: on a GPU under autocast, the LM
            head's fp32 logits from bf16 products).
    """

    rows: int
    prompt: int
    response: int
    forward_rows: int
    micro_rows: int
    minibatches: int
    epochs: int
    temperature: float
    autocast: str | None
    dtype: str
    checkpointing: bool
    recompute: bool
    sampled_entropy: bool
    critic: str | None
    exact_entropy: bool
    threads: int
    attention: str | None = None
    reuse_freed_memory: bool = False
    lm_head_matmul: str = "fp32"


def _one_layer_copy(config, dtype: torch.dtype, attention: str | None, amp: bool,
                    device: torch.device | str = "cpu", head: str = "fp32"):
    """A random one-layer model of ``config``'s class at its own widths and vocabulary, made on
    ``device`` (its LM head computing in fp32 under autocast, as ``head`` says: the run's
    ``model.lm_head_matmul``)."""
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.modules.models import lm_head_in_fp32

    config = language_model_config(config)
    small = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer"):
        if getattr(small, name, None) is not None:
            setattr(small, name, 1)
    _first_layers(small, 1, ModelShape.from_config(config).layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(small, attn_implementation=attention,
                                                 dtype=dtype)
    return lm_head_in_fp32(model, head) if amp else model


def _decoder_layers(model) -> torch.nn.ModuleList:
    layers = decoder_layers(model, model.config.num_hidden_layers
                            if isinstance(getattr(model.config, "num_hidden_layers", None), int)
                            else None)
    if layers is None:
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    return layers


def _decoder_layer(model) -> torch.nn.Module:
    return _decoder_layers(model)[0]


def _last_level_cache(device: torch.device | None = None) -> int:
    """Bytes of ``device``'s largest cache: a CUDA GPU's L2, this CPU's last level (32 MiB where
    it cannot be read)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return max(sizes, default=32 * 2**20)


def _weight_sets(layers: int, layer_bytes: float, device: torch.device | None = None) -> int:
    """How many copies of a layer's weights a timed layer takes in turn so that, as in the run,
    each call finds its weights gone from the caches: the model's layers, or as many as fill
    twice ``device``'s last-level cache."""
    return max(1, min(layers, math.ceil(2 * _last_level_cache(device) / max(layer_bytes, 1.0))))


class _LayerClock:
    """Seconds spent inside the forward calls of ``modules`` (hooks before and after each); on a
    CUDA device, between CUDA events recorded there, read once the device has synchronised
    (:func:`_synced`): a layer's kernels run after its call returns. Setting ``seconds`` (to 0)
    starts the count again."""

    def __init__(self, *modules: torch.nn.Module, cuda: bool = False):
        self._seconds, self._start, self._cuda, self._spans = 0.0, None, cuda, []
        self._events, self._used = [], 0  # CUDA events, made once and recorded again
        self._hooks = [hook for module in modules
                       for hook in (module.register_forward_pre_hook(self._enter),
                                    module.register_forward_hook(self._leave))]

    @property
    def seconds(self) -> float:
        return self._seconds + sum(a.elapsed_time(b) for a, b in self._spans) / 1e3

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._seconds, self._spans, self._used = value, [], 0

    def _now(self):
        if self._cuda:  # (on the current device's stream: timed_phases makes it the copies')
            if self._used == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            event = self._events[self._used]
            self._used += 1
            event.record()
            return event
        return time.perf_counter()

    def _enter(self, *_):
        self._start = self._now()

    def _leave(self, *_):
        if self._cuda:
            self._spans.append((self._start, self._now()))
        else:
            self._seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _synced(fn, device: torch.device):
    """``fn``, then on a CUDA device a wait for its kernels (what the timed call costs): ``fn``
    itself on a CPU."""
    if device.type != "cuda":
        return fn

    @functools.wraps(fn)
    def synced():
        fn()
        torch.cuda.synchronize(device)
    return synced


def _best_of(fn, clocks: list, repeats: int) -> tuple[float, list[float]]:
    """(seconds, each clock's seconds) of the median of ``repeats`` calls of ``fn`` (more, up to
    9, while they have taken under half a second together: a short call is noisier) after one
    more to warm up (kernel selection, the allocator): a phase of the run is one call, typical
    rather than best."""
    fn()
    runs, spent = [], 0.0
    while len(runs) < repeats or (spent < 0.5 and len(runs) < 9):
        for clock in clocks:
            clock.seconds = 0.0
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        spent += seconds
        runs.append((seconds, [clock.seconds for clock in clocks]))
    runs.sort(key=lambda run: run[0])
    return runs[(len(runs) - 1) // 2]


def timed_phases(config, work: PhaseWork, critic_config=None, repeats: int = 3,
                 device: torch.device | str = "cpu") -> dict:
    """Each phase's seconds on ``device`` (this CPU, or a CUDA GPU of this machine), timed on
    one-layer copies of the models (their real widths and vocabularies, random weights) doing
    one process's work of an iteration at the run's shapes, precision, sampler and optimiser,
    and scaled to the whole:

    - ``generation``: a prefill of the prompts and ``generate`` of up to 16 tokens with the run's
      sampler (it records the log-probs), for up to 16 rows on a CPU, every row on a GPU; the
      response's ``response`` steps at that pace, and more rows from a second, halved batch (the
      cost of a row);
    - ``old_quantities``: a forward batch (on a CPU up to 512 tokens) of the policy where it
      recomputes, the critic and the reference, with their log-probs and entropies, times the
      batches;
    - ``update``: a micro-batch (on a CPU up to 512 tokens) of the policy's and critic's forwards
      and backwards, times the micro-batches, and an optimiser step (clipping, AdamW, zeroing)
      per minibatch, times the epochs.

    A GPU reaches its matmuls' rate only at the run's own sizes, so there the copies run the
    run's forward batches and micro-batches whole, and each timed call ends when its kernels
    have (the layers' times are read from CUDA events).

    Each is the copy's time plus (layers - 1) times one layer's: the layer is timed inside the
    copy's calls (hooks around it: generation, old quantities) and, for the update, alone on the
    inputs the copy gave it (forward and backward; its own step). Returns ``{phase: seconds,
    "layer": ..., "timed": what was measured}``, kept in :func:`cache_path` per shape, settings
    and device: only the first plan of a shape times anything (a second or two at SmolLM2-360M's
    size; the copy's embedding and LM head are the real ones).

    Args:
        config (transformers.PretrainedConfig): the policy's (and reference's) config.
        work: the shapes and settings.
        critic_config: a separate critic's config (None: the policy's).
        repeats: timed calls per measurement (their median counts), after one to warm up.
        device: where the copies run.
    """
    device = torch.device(device)
    critic_config = critic_config if critic_config is not None else config
    key = _cache_key("timed", _device_key(device), _config_key(config),
                     _config_key(critic_config), *asdict(work).values())
    cached = _cache_get(key)
    if cached is not None:
        return cached
    cpu = device.type == "cpu"
    threads = torch.get_num_threads()
    torch.set_num_threads(work.threads)
    if work.reuse_freed_memory and cpu:
        from rlhf_torchrl.runtime import reuse_freed_memory

        reuse_freed_memory()
    machine, own, start = machine_cpu_seconds(), sum(os.times()[:2]), time.perf_counter()
    try:  # (a CUDA device made current: the events and streams are its own)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            out = _time_phases(config, critic_config, work, repeats, device)
    finally:
        torch.set_num_threads(threads)
        if device.type == "cuda":  # (the copies' memory back to the device)
            torch.cuda.empty_cache()
    if machine is not None and cpu:  # the share of the CPUs other processes took while this timed
        others = machine_cpu_seconds() - machine - (sum(os.times()[:2]) - own)
        out["others_cpu_share"] = max(0.0, others / ((time.perf_counter() - start)
                                                     * (os.cpu_count() or 1)))
    return _cache_put(key, out)


def _time_phases(config, critic_config, work: PhaseWork, repeats: int,
                 device: torch.device) -> dict:
    from rlhf_torchrl.functional import entropy_from_logits, log_probs_from_logits

    amp = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(work.autocast)
    wdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[work.dtype]
    cuda = device.type == "cuda"
    # what a timed call runs at most (the rest is scaled): a CPU's matmuls reach their rate from
    # a few hundred tokens, a GPU's only at the run's sizes
    timed_rows = work.rows if cuda else _TIMED_ROWS

    def capped(rows: int) -> int:  # rows of T tokens
        return rows if cuda else min(rows, max(1, math.ceil(_TIMED_TOKENS / T)))

    def autocast():
        return (torch.autocast(device.type, dtype=amp) if amp is not None
                else contextlib.nullcontext())

    shape = _shape(config)
    cshape = _shape(critic_config)
    policy = _one_layer_copy(config, wdtype, work.attention, amp is not None, device,
                             work.lm_head_matmul)
    critic = None
    if work.critic == "separate":
        critic = (copy.deepcopy(policy) if _config_key(critic_config) == _config_key(config)
                  else _one_layer_copy(critic_config, wdtype, work.attention, amp is not None,
                                       device, work.lm_head_matmul))
    reference = copy.deepcopy(policy).requires_grad_(False)  # the run's: frozen, its own weights
    value_head = torch.nn.Linear(cshape.hidden if critic is not None else shape.hidden, 1,
                                 dtype=wdtype, device=device)
    P, R, T, V = work.prompt, work.response, work.prompt + work.response, shape.vocab
    gen = torch.Generator().manual_seed(0)

    def rows_of(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows and their attention mask, every other row's first token padding (the
        run's batches are left-padded: attention runs masked)."""
        ids = torch.randint(3, V, (rows, length), generator=gen)
        mask = torch.ones_like(ids)
        if length > 1:
            mask[1::2, 0] = 0
        return ids.to(device), mask.to(device)

    def timed(fn, clocks, repeats):
        return _best_of(_synced(fn, device), clocks, repeats)

    out: dict = {"timed": {}}
    extra = lambda seconds, layer_s, critic_s=0.0: (  # noqa: E731 - the layers the copies lack
        seconds + (shape.layers - 1) * layer_s + (cshape.layers - 1) * critic_s)

    # generation: a prefill, then decoding steps drawn by the run's sampler
    from transformers import GenerationConfig, LogitsProcessorList

    steps = min(R, _TIMED_STEPS)
    try:
        from rlhf_torchrl.collectors.sampling import InverseCDFSampler

        sampler = InverseCDFSampler(work.temperature, record=True,
                                    record_entropy=work.sampled_entropy)
        processors, sample = LogitsProcessorList([sampler]), False
    except (ImportError, TypeError):  # (a sampler of another form: transformers' own)
        sampler, processors, sample = None, None, True
    # no EOS: every row runs the steps (no min_new_tokens: its processor costs a pass over the
    # vocabulary a step, which the run does not pay)
    settings = GenerationConfig(max_new_tokens=steps, do_sample=sample,
                                temperature=work.temperature if sample else None,
                                top_k=0 if sample else None, eos_token_id=None, pad_token_id=0)
    policy.eval()
    # decoding reads every weight at each step: past the last-level cache, from memory. The
    # copy's layer takes turns with copies of itself (one per step, as many as the run's layers
    # or as fill the cache twice), so that its weights are as cold as the run's
    cast = _BYTES[work.dtype] + (2 if amp is not None else 0)
    container = _decoder_layers(policy)
    turns = [container[0]] + [copy.deepcopy(container[0]) for _ in range(
        _weight_sets(shape.layers, shape.layer_params * cast, device) - 1)]
    cycle = itertools.cycle(turns)

    def next_turn(*_):
        container[0] = next(cycle)

    rotation = policy.base_model.register_forward_pre_hook(next_turn)
    clock = _LayerClock(*turns, cuda=cuda)

    def sampled(rows: int) -> float:
        """The generation of ``rows`` rows: its prefill, then ``R`` steps at the timed steps'
        pace, each with (layers - 1) more layers."""
        ids, mask = rows_of(rows, P)

        def prefill():
            with torch.no_grad(), autocast():
                policy(input_ids=ids, attention_mask=mask, logits_to_keep=1)

        def generation():
            if sampler is not None:
                sampler.set_streams(list(range(rows)))  # the run's: a stream per row
            with torch.no_grad(), autocast():
                policy.generate(input_ids=ids, attention_mask=mask, generation_config=settings,
                                logits_processor=processors)
            if sampler is not None:
                sampler.pop()

        with autocast():  # (the casts of the weights kept from the warm-up on: counted apart)
            generation()  # every copy of the layer takes a turn (and is cast) before the clock
            first, (first_layer,) = timed(prefill, [clock], repeats)
            whole, (whole_layer,) = timed(generation, [clock], repeats)
        step, step_layer = (whole - first) / steps, (whole_layer - first_layer) / steps
        out["timed"][f"generation_{rows}_rows"] = {"prefill": first, "step": step,
                                                   "layer_prefill": first_layer,
                                                   "layer_step": step_layer}
        return extra(first, first_layer) + R * extra(step, step_layer) + cast_s * shape.layers

    # under autocast a generation casts each layer's weights once (then kept while it runs)
    casting = itertools.cycle(turns)

    def cast():
        for weight in next(casting).parameters():
            if weight.dim() == 2:
                weight.to(amp)

    cast_s = timed(cast, [], repeats)[0] if amp is not None else 0.0
    out["timed"]["generation_layer_cast"] = cast_s
    rows = min(work.rows, timed_rows)
    seconds = sampled(rows)
    if work.rows > rows:  # linear in the rows beyond: from two batch sizes
        half = sampled(rows // 2)
        seconds += (work.rows - rows) * (seconds - half) / (rows - rows // 2)
    out["generation"] = seconds
    out["timed"]["generation_weight_sets"] = len(turns)
    clock.remove()
    rotation.remove()
    container[0] = turns[0]
    turns.clear()

    # old quantities: one forward batch of each model that runs (each in its own autocast, as
    # the run's modules are), times the batches
    runs = [m for m in (policy, reference, critic) if m is not None]
    clocks = [_LayerClock(_decoder_layer(m), cuda=cuda) for m in runs]
    fb = capped(min(work.forward_rows, work.rows))
    batch, mask = rows_of(fb, T)

    # those predicting the response (the run's)
    positions = torch.arange(P - 1, P - 1 + R, device=device)

    def log_probs(model, batch=batch, mask=mask):
        with autocast():
            logits = model(input_ids=batch, attention_mask=mask, logits_to_keep=positions,
                           use_cache=False).logits
        return log_probs_from_logits(logits, batch[:, P:], work.temperature), logits

    def values(trunk, batch=batch, mask=mask):
        with autocast():
            hidden = trunk(input_ids=batch, attention_mask=mask,
                           use_cache=False).last_hidden_state
            return value_head(hidden[:, P - 1:-1].to(value_head.weight.dtype))

    def old_quantities():
        with torch.no_grad():
            if work.recompute:
                _, logits = log_probs(policy)
                if work.exact_entropy:
                    entropy_from_logits(logits.float() / work.temperature)
                del logits
            if critic is not None:  # (a shared trunk's critic reads the policy's forward)
                values(critic.base_model)
            log_probs(reference)

    seconds, layer_s = timed(old_quantities, clocks, repeats)
    out["old_quantities"] = work.rows / fb * extra(seconds, layer_s[0] + layer_s[1],
                                                   *layer_s[2:])
    out["timed"]["old_quantities"] = {"rows": fb, "seconds": seconds, "layers": layer_s}
    for clock in clocks:
        clock.remove()

    # the update: a micro-batch's forwards and backwards, the optimiser's step (clipping,
    # AdamW, zeroing), each timed on the copies; a layer's alone
    from rlhf_torchrl.trainers.optim import adamw

    models = [m for m in (policy, critic) if m is not None]
    for model in models:
        model.train()
        if work.checkpointing:
            model.config.use_cache = False
            enable = (getattr(model, "activation_checkpointing_enable", None)
                      or model.gradient_checkpointing_enable)
            enable({"use_reentrant": False})
    params = [p for m in (*models, value_head) for p in m.parameters()]
    optimizer = adamw(params, lr=0.0)
    micro = capped(min(work.micro_rows, work.rows))
    batch, mask = rows_of(micro, T)
    captured: dict = {}

    def capture(module, args, kwargs):
        captured.setdefault(module, (args, kwargs))

    hooks = [_decoder_layer(m).register_forward_pre_hook(capture, with_kwargs=True)
             for m in models]

    def micro_batch():
        lp, logits = log_probs(policy, batch, mask)
        loss = lp.sum() + entropy_from_logits(logits.float() / work.temperature).sum()
        if critic is not None:  # (a shared trunk's head reads the policy's forward)
            loss = loss + values(critic.base_model, batch, mask).float().sum()
        loss.backward()

    def step(params=params, optimizer=optimizer):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # (the gradients stay for the next step)

    micro_s, _ = timed(micro_batch, [], repeats)
    step_s, _ = timed(step, [], repeats)
    for hook in hooks:
        hook.remove()
    layer_micro, layer_steps = [], []
    for model, its in zip(models, (shape, cshape)):  # a layer's forward and backward alone,
        layer = _decoder_layer(model)                  # then its step
        if layer_micro and _config_key(critic_config) == _config_key(config):
            layer_micro.append(layer_micro[0])  # (the critic's layers are the policy's)
            layer_steps.append(layer_steps[0])
            continue
        args, kwargs = captured[layer]
        hidden = args[0].detach().requires_grad_(True)
        grad = torch.randn(hidden.shape, generator=gen, dtype=hidden.dtype).to(device)

        def forward_backward(layer=layer, args=args, kwargs=kwargs, hidden=hidden, grad=grad):
            with autocast():
                result = layer(hidden, *args[1:], **kwargs)
            (result[0] if isinstance(result, tuple) else result).backward(grad)

        layer_micro.append(timed(forward_backward, [], max(repeats, 5))[0])
        # the step reads and writes weights, gradients and moments: past the last-level cache,
        # from memory; the layer takes turns with copies of itself, as cold as the run's
        copies = [layer] + [copy.deepcopy(layer) for _ in range(
            _weight_sets(its.layers, its.layer_params * 16, device) - 1)]
        for param in (q for c in copies for q in c.parameters()):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        steppers = [functools.partial(step, list(c.parameters()), adamw(list(c.parameters()),
                                                                       lr=0.0))
                    for c in copies]
        for stepper in steppers:  # each optimiser's first step allocates its moments
            stepper()
        stepping = itertools.cycle(steppers)

        def layer_step(stepping=stepping):
            next(stepping)()

        layer_steps.append(timed(layer_step, [], max(repeats, 5))[0])
        copies.clear()
    out["update"] = work.epochs * (work.rows / micro * extra(micro_s, *layer_micro)
                                   + work.minibatches * extra(step_s, *layer_steps))
    out["timed"]["update"] = {"rows": micro, "micro_batch": micro_s, "step": step_s,
                              "layer_micro_batch": layer_micro, "layer_step": layer_steps}
    return out


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
        width = max(25, *(len(name) + 1 for name in self.components))
        lines = [f"Plan for {self.settings['policy']} on {self.device.name} "
                 f"({self.device.memory_gb:.1f} GiB; {self.settings['world']} process(es), "
                 f"{self.settings['strategy']}, {self.settings['precision']})", "",
                 f"{'memory per device (GiB)':<{width + 2}}" + "".join(f"{p:>16}" for p in PHASES)]
        for name in self.components:
            row = [self.phases[p]["held"].get(name) for p in PHASES]
            if any(row):
                lines.append(f"  {name:<{width}}" + "".join(
                    f"{v:>16.2f}" if v else f"{'-':>16}" for v in row))
        lines.append(f"  {'total':<{width}}" + "".join(f"{self.phases[p]['memory_gb']:>16.2f}"
                                                       for p in PHASES))
        lines += ["", f"peak {self.peak_gb:.1f} GiB in {self.peak_phase} "
                  f"({100 * self.peak_gb / self.device.memory_gb:.0f}% of the device)"]
        if "seconds" not in self.phases[PHASES[0]]:
            return "\n".join(lines)
        lines += ["", f"{'time per iteration':<{width + 2}}" + "".join(f"{p:>16}" for p in PHASES)]
        lines.append(f"  {'TFLOPs':<{width}}" + "".join(f"{self.phases[p]['flops'] / 1e12:>16.1f}"
                                                        for p in PHASES))
        lines.append(f"  {'seconds':<{width}}" + "".join(f"{self.phases[p]['seconds']:>16.2f}"
                                                         for p in PHASES))
        total = sum(self.phases[p]["seconds"] for p in PHASES)
        how = self.settings.get("times", "FLOPs over the device profile")
        if not how.startswith("timed"):  # (timed seconds owe nothing to the profile's rates)
            how = f"{how}; {self.device.source}"
        lines += [f"  about {total:.1f} s an iteration ({how})"]
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
    return _model_config("model.policy", name, weights=False)  # (a config.json alone plans)


def kv_cache_positions(config, length: int, static: bool = False) -> int:
    """Positions a KV cache holds over all of ``config``'s layers after ``length`` tokens, as
    transformers lays the cache out (``cache_utils.get_layer_types_and_kwargs``): every position in
    a full-attention layer, in a sliding or chunked one at most the window less one (a static
    cache: the window), none in a recurrent, convolutional or linear-attention layer (their fixed
    states are left out) or one that reads another's cache.

    Args:
        config (transformers.PretrainedConfig): the model's config.
        length: tokens seen (prompt and response).
        static: a static cache (``generation.compile``).
    """
    spans = attention_spans(config, cache=True)
    if spans is None:
        return _shape(config).layers * length
    return sum(0 if kind == "none" else length if kind == "full"
               else min(length, size - (0 if static else 1)) for kind, size in spans)


def kv_cache_bytes(config, rows: int, length: int, key_bytes: int, value_bytes: int,
                   static: bool = False) -> float:
    """Bytes of the KV cache of ``rows`` rows after ``length`` tokens (:func:`kv_cache_positions`
    of the config's key/value heads), keys of ``key_bytes`` and values of ``value_bytes`` each.

    Args:
        config (transformers.PretrainedConfig): the model's config.
        rows: rows sampled together.
        length: tokens per row.
        key_bytes: bytes of a key element (fp32 after the rotary embedding under autocast).
        value_bytes: bytes of a value element.
        static: a static cache (``generation.compile``).
    """
    positions = rows * kv_cache_positions(config, length, static)
    if isinstance(getattr(config, "kv_lora_rank", None), int):  # latent attention (DeepSeek's):
        # the compressed keys and values, and the rotary part of the keys, once for all heads
        return positions * (config.kv_lora_rank * key_bytes
                            + config.qk_rope_head_dim * value_bytes)
    shape = _shape(config)
    return positions * shape.kv_heads * shape.head_dim * (key_bytes + value_bytes)


_ADAPTERS: dict[tuple, int] = {}


def _lora_params(config, r: int, targets="all-linear") -> int:
    """The adapters' parameters as PEFT places them on ``config``'s model
    (:func:`~rlhf_torchrl.modules.shapes.lora_params`, once per config and settings in this
    process); a gated decoder's q, k, v, o and MLP where its class cannot be built."""
    shape, model = _counted(config)
    if model is not None:
        key = (_config_key(config), r, targets if isinstance(targets, str) else tuple(targets))
        if key not in _ADAPTERS:
            _ADAPTERS[key] = lora_params(model, r, targets)
        return _ADAPTERS[key]
    per_layer = (shape.hidden + shape.heads * shape.head_dim  # q
                 + 2 * (shape.hidden + shape.kv_heads * shape.head_dim)  # k, v
                 + shape.heads * shape.head_dim + shape.hidden  # o
                 + (3 if shape.gated_mlp else 2) * (shape.hidden + shape.intermediate))
    return r * per_layer * shape.layers


def _planned_threads(cfg) -> int:
    """The run's torch threads: ``threads``, else the cores this process may use (what the
    run's thread tuner gives on a machine with nothing else running)."""
    if cfg.get("threads"):
        return int(cfg.threads)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def make_plan(cfg, *, world: int | None = None, profile: DeviceProfile | None = None,
              prompt_tokens: int | None = None, mean_prompt_tokens: float | None = None,
              times: bool = True) -> Plan:
    """The plan of the composed PPO config ``cfg``.

    On a CPU (the plan's device is this host) the memory also counts ``runtime``: what the
    planning process holds already (:func:`runtime_bytes`; the PPO command's own process in its
    start-up check). On this machine's CPU, or a CUDA GPU of its own planned with that GPU's
    profile, the seconds are timed on one-layer copies of the models (:func:`timed_phases`)
    where the run is one process sampling with transformers; elsewhere (another GPU's profile,
    LoRA, several processes, vLLM, a compiled decode step, packing, several turns) they come
    from FLOPs over the device's profile.

    Args:
        cfg: the composed PPO config (``rlhf_torchrl.config.compose``).
        world: the processes (None: torchrun's ``WORLD_SIZE``, else 1).
        profile: the device's profile (None: :func:`device_profile` of ``cfg.device``).
        prompt_tokens: the longest prompt in tokens (None: ``data.max_prompt_length``, the bound
            every prompt is checked against): the memory's.
        mean_prompt_tokens: the mean prompt in tokens, the FLOPs' and the timed copies'
            (None: ``prompt_tokens``).
        times: estimate each phase's FLOPs and seconds (False: the memory alone, what the
            start-up check needs; ``flops`` and ``seconds`` are then absent).
    """
    from rlhf_torchrl.config.derived import log_probs_from_sampling, precision
    from rlhf_torchrl.modules.models import torch_dtype
    from rlhf_torchrl.runtime import resolve_device

    m, p, g = cfg.model, cfg.ppo, cfg.generation
    world = world or int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(cfg.device)
    own_profile = profile is None  # this machine's device's, not one given for another device
    profile = profile or device_profile(device)
    config = _config_of(m.policy)
    shape = _shape(config)
    host = profile.name == "cpu"  # planned for this host's CPU: its process's memory counts
    if m.autocast == "auto" and not host:  # planned for a GPU: bf16 there
        amp_name = "bfloat16" if m.dtype == "float32" else None
    else:
        amp_name = precision(cfg)[0]
    amp = torch_dtype(amp_name) if amp_name else None
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
    if host:  # the process itself, before any weight: the model's class imported as loading will
        _import_model_class(config)
        held["runtime"] = runtime_bytes()
    targets = cfg.lora.target_modules if cfg.lora.r else None
    targets = targets if isinstance(targets, str) or targets is None else list(targets)
    trained = _lora_params(config, cfg.lora.r, targets) if cfg.lora.r else shape.params
    held["policy weights"] = shape.params * wb / shard
    if cfg.lora.r:
        held["policy weights"] += trained * 4
    held["policy gradients"] = trained * 4 / shard
    held["policy AdamW state"] = trained * 8 / shard
    if critic_kind is not None and critic_kind != "shared":
        critic_name = cfg.value_model.name_or_path or (
            cfg.reward.model if critic_kind == "reward_model" else m.policy)
        cconfig = _config_of(critic_name)
        cshape = _shape(cconfig)
        ctrained = (_lora_params(cconfig, cfg.lora.r, targets) if cfg.lora.critic and cfg.lora.r
                    else cshape.trunk_params)
        held["critic weights"] = cshape.trunk_params * wb / shard
        held["critic gradients"] = ctrained * 4 / shard
        held["critic AdamW state"] = ctrained * 8 / shard
    else:
        cshape = None
        if critic_kind == "shared":
            held["critic weights"] = shape.hidden * wb
    if not cfg.lora.r:  # (an offloaded reference visits the device for the old quantities)
        ref = _config_of(m.reference) if m.reference else config
        reference = _shape(ref).params * wb / shard
        if not m.offload_reference:
            held["reference"] = reference
    if cfg.reward.model:
        rm = _shape(_config_of(cfg.reward.model))
        held["reward model"] = rm.trunk_params * _BYTES[cfg.reward.model_dtype]
    teacher = 0.0  # on-policy distillation's teacher: frozen, resident or visiting as the reference
    if cfg.reward.get("teacher"):
        teacher = (_shape(_config_of(cfg.reward.teacher)).params
                   * _BYTES[cfg.reward.teacher_dtype])
        if not cfg.reward.teacher_offload:
            held["teacher"] = teacher

    # generation: the KV cache (keys fp32 after the rotary embedding under autocast, values in
    # the matmul's dtype; a static cache both in the autocast dtype) and a step's logits
    act_bytes = 2 if amp is not None else wb
    kv_len = (cfg.data.max_prompt_length + g.max_new_tokens) if g.compile else T
    key_bytes = act_bytes if g.compile else (4 if amp is not None else wb)
    kv = kv_cache_bytes(config, rows, kv_len, key_bytes, act_bytes, static=bool(g.compile))
    # autocast's bf16 copies of fp32 weights, kept while a forward runs (FSDP2 gathers bf16
    # layers instead: its mixed precision)
    casts = shape.params * 2 if amp is not None and wb == 4 and not fsdp else 0
    # the old log-probs: recomputed by the policy's forward, or the sampler's (recorded)
    recompute = not log_probs_from_sampling(cfg, autocast=amp_name)
    exact = bool(cfg.logging.exact_entropy)
    generation = {"KV cache": kv,
                  "logits and sampler": LOGIT_COPIES["sampler", not recompute and exact]
                  * rows * shape.vocab * 4,
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
    # the old quantities: a forward batch's fp32 logits at the response positions, and the
    # copies the log-probs (and exact entropies, where the policy recomputes) make of them
    fb = min(p.forward_batch_size, rows)
    old = {"logits (forward batch)": LOGIT_COPIES["old_quantities", recompute and exact]
           * fb * R * shape.vocab * 4,
           "bf16 weight copies": casts}
    if not cfg.lora.r and m.offload_reference:
        old["reference (offloaded, visiting)"] = reference
    if teacher and cfg.reward.teacher_offload:
        old["teacher (offloaded, visiting)"] = teacher
    # the update's largest micro-batch
    if p.micro_batch_tokens:  # (never more rows than a minibatch holds)
        micro_rows = min(max(1, p.micro_batch_tokens // T), max(1, rows // p.num_mini_batches))
        micro_tokens = min(p.micro_batch_tokens, micro_rows * T)
    else:
        micro_rows = max(1, rows // p.num_mini_batches // p.gradient_accumulation_steps)
        micro_tokens = micro_rows * T
    per_token, fixed = layer_activation_bytes(config, amp, m.gradient_checkpointing,
                                              m.attn_implementation)
    fixed = 0.0 if fsdp else fixed
    acts = shape.layers * (per_token * micro_tokens + fixed)
    update = {"policy activations": acts,
              "logits (micro-batch)": LOGIT_COPIES["update", p.entropy_coef > 0]
              * micro_rows * R * shape.vocab * 4}
    # model.lm_head_matmul=bf16x3 on a GPU, where a head call has SPLIT_MIN_ROWS rows or more:
    # the weight in three bf16 parts while the forward runs; in the backward the logits' gradient
    # and the weight in bf16
    split_head = (m.get("lm_head_matmul", "fp32") == "bf16x3" and amp is not None
                  and not host)
    split = {phase: split_head and positions >= SPLIT_MIN_ROWS for phase, positions in
             (("generation", rows if engine is None else 0),  # (an engine has its own head)
              ("old_quantities", min(p.forward_batch_size, rows) * R),
              ("update", micro_rows * R))}
    operands = 3 * shape.vocab * shape.hidden * 2
    for phase, part in (("generation", generation), ("old_quantities", old)):
        if split[phase]:
            part["bf16x3 head operands"] = operands
    if split["update"]:
        update["bf16x3 head operands"] = max(
            operands, (micro_rows * R + shape.hidden) * shape.vocab * 2)
    if cshape is not None:
        c_token, c_fixed = ((per_token, fixed) if critic_name == m.policy else  # the policy's
                            layer_activation_bytes(cconfig, amp, m.gradient_checkpointing,
                                                   m.attn_implementation))
        update["critic activations"] = cshape.layers * (c_token * micro_tokens
                                                        + (0.0 if fsdp else c_fixed))
    if fsdp:  # the layers FSDP2 gathers whole: the running one and the one prefetched
        gathered = 2 * shape.layer_params * act_bytes
        for phase in (generation, old, update):
            phase["FSDP2 gathered layers"] = gathered

    if engine_awake:
        old[f"{backend.label} engine"] = update[f"{backend.label} engine"] = engine_awake
    # on a CPU glibc keeps what a phase frees for reuse (reuse_freed_memory), but the large
    # vocabulary-sized buffers of one phase were measured not to fit where another's were
    # (docs/scaling.md, the plan against runs on a CPU): each phase holds the others' too
    logits = {"generation": generation.get("logits and sampler", 0.0),
              "old_quantities": old["logits (forward batch)"],
              "update": update["logits (micro-batch)"]}
    keep_freed = host and bool(cfg.get("reuse_freed_memory", False))
    # from the second iteration on every phase holds the moments and the gradients
    phases = {}
    for name, transient in (("generation", generation), ("old_quantities", old),
                            ("update", update)):
        if keep_freed:
            transient["logits kept by glibc"] = sum(
                v for phase, v in logits.items() if phase != name)
        parts = {**held, **transient}
        phases[name] = {"held": {k: v / GIB for k, v in parts.items()},
                        "memory_gb": sum(parts.values()) / GIB}
    components = {}  # each component at its largest over the phases
    for part in (held, generation, old, update):
        for k, v in part.items():
            components[k] = max(components.get(k, 0.0), v / GIB)

    settings = {"policy": m.policy, "params": shape.params, "world": world,
                "strategy": "fsdp2" if fsdp else ("ddp" if world > 1 else "one process"),
                "precision": (f"{'bf16 autocast' if amp is not None else m.dtype} over {m.dtype} "
                              f"weights{', the LM head bf16x3' if any(split.values()) else ''}"),
                "rows_per_process": rows, "prompt_tokens": P, "response_tokens": R,
                "micro_batch_tokens": micro_tokens, "activation_bytes_per_token_layer": per_token,
                "critic": critic_kind, "lora_r": cfg.lora.r,
                "gradient_checkpointing": bool(m.gradient_checkpointing),
                "lm_head_matmul": {ph: "bf16x3" if on else "fp32" for ph, on in split.items()}}
    if not times:
        return Plan(components=components, phases=phases, device=profile, settings=settings)

    # FLOPs and seconds
    critic_flops = (lambda n, L, heads: 0.0) if cshape is None else (
        lambda n, L, heads: cshape.forward_flops(n, L, heads))
    Pm = mean_prompt_tokens or P  # FLOPs: micro-batches of similar lengths pad little
    T = Pm + R
    gen_flops = shape.decode_flops(rows, int(Pm), g.max_new_tokens)
    # the reference's forward, the policy's where it recomputes the old log-probs
    old_flops = (shape.forward_flops(rows, T, R) * (2 if recompute else 1)
                 + critic_flops(rows, T, 0))
    epochs = p.num_ppo_epochs
    ckpt = bool(m.gradient_checkpointing)  # the layers' forward again in the backward
    upd_flops = epochs * (training_flops(shape, rows, T, R, ckpt)
                          + (0 if cshape is None else training_flops(cshape, rows, T, 0, ckpt)))
    head_flops = 2 * shape.hidden * shape.vocab * rows * R  # fp32 under autocast
    peak = profile.bf16_flops if amp is not None else profile.fp32_flops
    eff = profile.train_efficiency

    def compute_s(flops: float, head: float, head_forward: float | None = None,
                  split: bool = False) -> float:
        """Seconds of ``flops`` of which ``head`` are the LM head's product, one large matmul at
        the profile's measured rate: fp32's, or with the bf16x3 head (``split``) bf16's for three
        products in the forward (``head_forward`` of ``head``; None: all of it) and one in the
        backward."""
        rest = (flops - head) / (eff * peak)
        if split:
            forward = head if head_forward is None else head_forward
            return rest + (3 * forward + head - forward) / profile.bf16_flops
        return rest + head / profile.fp32_flops

    step = profile.decode_step_compiled_s if g.compile else profile.decode_step_s * shape.layers
    gen_s = g.max_new_tokens * step + compute_s(gen_flops, 0) + g.max_new_tokens * (
        shape.params * act_bytes + kv / 2) / profile.bandwidth
    phases["generation"].update(flops=gen_flops, seconds=gen_s)
    phases["old_quantities"].update(flops=old_flops, seconds=compute_s(
        old_flops, 2 * head_flops, split=split["old_quantities"]))
    phases["update"].update(flops=upd_flops, seconds=compute_s(
        upd_flops, 3 * epochs * head_flops, epochs * head_flops, split=split["update"]))
    settings["times"] = "FLOPs over the device profile"
    # timed where the plan's device is this machine's: its CPU, or a CUDA GPU planned with its
    # own profile (not another GPU's)
    here = host if device.type == "cpu" else device.type == "cuda" and own_profile
    timeable = (here and world == 1 and not cfg.lora.r
                and GENERATION_BACKENDS.get(g.backend).samples_with_trained_model
                and not g.compile and not m.packing
                and not m.compile and cfg.env.max_turns <= 1 and not cfg.collection.overlap
                and not cfg.collection.ray_workers and not cfg.collection.partial_rollout
                # (a run that cannot fit is not timed: its copies may not fit either)
                and max(ph["memory_gb"] for ph in phases.values()) <= 0.95 * profile.memory_gb)
    if timeable:
        work = PhaseWork(
            rows=rows, prompt=max(1, round(Pm)), response=R, forward_rows=p.forward_batch_size,
            micro_rows=micro_rows, minibatches=p.num_mini_batches, epochs=epochs,
            temperature=float(g.temperature),
            autocast=amp_name, dtype=m.dtype, checkpointing=bool(m.gradient_checkpointing),
            recompute=recompute, sampled_entropy=not recompute and bool(cfg.logging.exact_entropy),
            critic=None if critic_kind is None else ("shared" if cshape is None else "separate"),
            exact_entropy=bool(cfg.logging.exact_entropy), threads=_planned_threads(cfg),
            attention=m.attn_implementation, reuse_freed_memory=keep_freed,
            lm_head_matmul=m.get("lm_head_matmul", "fp32"))
        try:
            timed = timed_phases(config, work, cconfig if cshape is not None else None,
                                 device=device)
        except Exception as error:  # noqa: BLE001 - a class the copies cannot run: FLOPs then
            settings["times"] += f" (timing the copies failed: {type(error).__name__}: {error})"
        else:
            for phase in PHASES:
                phases[phase]["seconds"] = timed[phase]
            settings["times"] = (f"timed on one-layer copies on this "
                                 f"{'CPU' if device.type == 'cpu' else 'GPU'}")
            busy = timed.get("others_cpu_share", 0.0)
            settings["timed_while_others_used"] = busy
            if busy > 0.2:
                settings["times"] += (f", while other processes took {busy:.0%} of it: plan "
                                      "again with --fresh on a quiet machine")
    return Plan(components=components, phases=phases, device=profile, settings=settings)


def fixes(cfg, plan: Plan) -> list[str]:
    """Settings that lower ``plan``'s peak, for the refusal's line: each candidate planned again
    (memory alone) and kept where it lowers the peak, the lowest first, as ``"key=value (N GiB)"``
    (``"(N GiB: fits)"`` where it alone fits).

    Args:
        cfg: the composed PPO config ``plan`` was made from.
        plan: its plan.
    """
    from omegaconf import OmegaConf

    s = plan.settings
    candidates = []
    if not s["gradient_checkpointing"]:
        candidates.append(("model.gradient_checkpointing", True))
    half = s["micro_batch_tokens"] // 2
    if half >= s["prompt_tokens"] + s["response_tokens"]:  # (a micro-batch holds a row at least)
        candidates.append(("ppo.micro_batch_tokens", half))
    if cfg.ppo.forward_batch_size > 1:
        candidates.append(("ppo.forward_batch_size", max(1, cfg.ppo.forward_batch_size // 2)))
    if s["world"] > 1 and s["strategy"] != "fsdp2":
        candidates.append(("distributed.strategy", "fsdp2"))
    if not s["lora_r"]:
        candidates.append(("lora.r", 16))
        if not cfg.model.offload_reference:
            candidates.append(("model.offload_reference", True))
    lowered = []
    for key, value in candidates:
        changed = copy.deepcopy(cfg)
        try:
            OmegaConf.set_readonly(changed, False)
            OmegaConf.update(changed, key, value, merge=False)
            other = make_plan(changed, world=s["world"], profile=plan.device,
                              prompt_tokens=s["prompt_tokens"], times=False)
        except Exception:  # noqa: BLE001 - a candidate that cannot be planned is not offered
            continue
        if other.peak_gb < 0.99 * plan.peak_gb:
            text = str(value).lower() if isinstance(value, bool) else value
            lowered.append((other.peak_gb, f"{key}={text} ({other.peak_gb:.1f} GiB"
                                           f"{': fits' if other.fits() else ''})"))
    return [text for _, text in sorted(lowered)]


def _fix_line(cfg, plan: Plan) -> str:
    found = fixes(cfg, plan)
    if not found:
        return ("no one setting here lowers it: plan for more devices (--world-size), a device "
                "with more memory or a smaller model")
    return f"try {', '.join(found)}"


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

    try:  # (the run's random stream as seeded: building copies of the model draws from it)
        with torch.random.fork_rng(devices=[]):
            plan = make_plan(cfg, prompt_tokens=prompt_tokens, times=False)
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
            f"the largest part is {largest} ({phase['held'][largest]:.1f} GiB): "
            f"{_fix_line(cfg, plan)} (rlhf-torchrl plan <overrides> shows the whole plan).")
    return plan


def main(argv: list[str]) -> None:
    """``rlhf-torchrl plan [--profile-device] [--gpu H100] [--world-size N] [--json] overrides``."""
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.validation import validate
    from rlhf_torchrl.runtime import resolve_device

    parser = argparse.ArgumentParser(
        prog="rlhf-torchrl plan",
        description="A PPO run's memory per device and time per phase, from the config and each "
                    "model's config.json, before any weight loads. model.policy may also name a "
                    f"packaged shape ({', '.join(sorted(p.stem for p in SHAPES_DIR.glob('*.json')))}). "
                    "Exits with status 1 when the run would not fit, naming the settings that "
                    "lower its peak.")
    parser.add_argument("--profile-device", action="store_true",
                        help="measure this device's matmul FLOP/s and bandwidth (a few seconds) "
                             "and cache them for later plans (on a CPU the phases are timed "
                             "again too)")
    parser.add_argument("--gpu", choices=sorted(PROFILES), default=None,
                        help="plan for this GPU's profile instead of this machine's device")
    parser.add_argument("--world-size", type=_at_least(1, int), default=None,
                        help="processes (GPUs) the run will use (default: WORLD_SIZE or 1)")
    parser.add_argument("--prompt-tokens", type=_at_least(1, int), default=None,
                        help="the longest prompt in tokens (default: data.max_prompt_length, the "
                             "bound; the PPO command's own check uses the prompt set's longest)")
    parser.add_argument("--mean-prompt-tokens", type=_at_least(1, float), default=None,
                        help="the mean prompt in tokens, the time estimate's (default: "
                             "--prompt-tokens)")
    parser.add_argument("--fresh", action="store_true",
                        help="measure the activation counts and the timed copies (on this "
                             "machine's CPU or GPU) again instead of reading them from the "
                             "plan's cache")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", help="the PPO run's overrides")
    args = parser.parse_intermixed_args(argv)
    global _FRESH
    _FRESH = args.fresh
    overrides = list(args.overrides)
    if args.gpu and not any(o.startswith("device=") for o in overrides):
        overrides.append("device=cpu")  # planned for, not used
    cfg = compose([*overrides, "output_dir=outputs/plan"])
    validate(cfg, require_set=False)  # choices and ranges, as the PPO command checks them
    device = resolve_device(cfg.device)
    if args.profile_device:
        profile = measure_device(device)
        print(f"profiled {profile.name}: bf16 {profile.bf16_flops / 1e12:.1f} TFLOP/s, fp32 "
              f"{profile.fp32_flops / 1e12:.1f} TFLOP/s, {profile.bandwidth / 1e9:.0f} GB/s; "
              f"saved to {save_profile(device, profile)}")
    profile = PROFILES[args.gpu] if args.gpu else None  # (None: this device's)
    plan = make_plan(cfg, world=args.world_size, profile=profile, prompt_tokens=args.prompt_tokens,
                     mean_prompt_tokens=args.mean_prompt_tokens)
    fits = plan.fits()
    if args.json:
        found = [] if fits else fixes(cfg, plan)
        print(json.dumps({**plan.to_dict(), "fits": fits, "fixes": found}, indent=1,
                         default=float))
    else:
        print(plan.table())
        if not fits:
            print(f"\nDoes not fit: {_fix_line(cfg, plan)}.")
    if not fits:  # exit status 1: a script can check a run before it launches it
        sys.exit(1)


def _at_least(low, kind):
    """An argparse type: ``kind`` of the text, ``low`` or more."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}")
        return value
    return parse
