"""Shared helpers for the benchmarks: models built offline, timers, medians, JSON output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from contextlib import contextmanager

import torch

#: Model presets: a 2-layer 128-wide GPT-2 (the size TRL was measured at in issue 3) and the
#: packaged SmolLM2-135M-Instruct. Both use SmolLM2's tokenizer.
MODELS = ("tiny-gpt2", "tiny-llama", "smollm2", "qwen2-0.5b-shape")


def build_models(name: str, seed: int = 0):
    """(tokenizer, policy, reference) for a preset, offline."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rlhf_torchrl.modules import disable_dropout, load_causal_lm, load_tokenizer
    from rlhf_torchrl.modules.models import smollm2_path

    tokenizer = load_tokenizer(smollm2_path())
    torch.manual_seed(seed)
    if name == "smollm2":
        policy = load_causal_lm(smollm2_path(), tokenizer)
    elif name == "tiny-gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=2, n_head=4,
                            n_positions=1024, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        policy = disable_dropout(GPT2LMHeadModel(config))
    elif name == "tiny-llama":
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        policy = disable_dropout(LlamaForCausalLM(config))
    elif name == "qwen2-0.5b-shape":  # Qwen2.5-0.5B's shape, random weights (throughput only)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             max_position_embeddings=4096, tie_word_embeddings=True,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        policy = disable_dropout(Qwen2ForCausalLM(config))
    else:
        raise ValueError(f"Unknown model {name!r}: choose one of {MODELS}.")
    reference = type(policy)(policy.config)
    reference.load_state_dict(policy.state_dict())
    return tokenizer, policy.eval(), disable_dropout(reference).eval().requires_grad_(False)


def add_runtime_args(parser) -> None:
    """``--threads`` and ``--no-reuse-freed-memory``, shared by the benchmarks."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-reuse-freed-memory", action="store_true",
                        help="leave glibc's malloc as it is (see rlhf_torchrl.runtime)")


def apply_runtime_args(args) -> None:
    from rlhf_torchrl.runtime import reuse_freed_memory

    torch.set_num_threads(args.threads)
    if not args.no_reuse_freed_memory:
        reuse_freed_memory()


@contextmanager
def timer(out: dict, name: str):
    start = time.perf_counter()
    yield
    out[name] = out.get(name, 0.0) + time.perf_counter() - start


def medians(rows: list[dict]) -> dict:
    keys = rows[0].keys()
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
