"""Every CUDA path in one command, one table: a few minutes on one GPU (the 2-GPU rows need two).

Rows, each the PPO recipe in its own process (``scaling``'s variants with
``device=cuda``; medians over the iterations after the first):

- the transformers backend in fp32 (old log-probs and values read off the sampling pass) and
  with bf16 autocast;
- the floor's own rows (issue 33): packed sequences (``model.packing=true``: sdpa's masks on
  packed rows, or flash-attn's variable-length kernel where flash-attn is installed), compiled
  decoder layers (``model.compile=true``: inductor on CUDA) and both in bf16;
- the vLLM backend with sleep mode (the engine frees its memory while the trainer runs), and
  awake with ``collection.overlap=1``: seconds per weight push after each update, and the share of
  sampling hidden behind the update (1 - the trainer's wait / the sampler's own time);
- the transformers backend with ``collection.overlap=1`` (a copy samples);
- with 2 GPUs, ``torchrun`` DDP and FSDP2 over NCCL on the same global batch: their final score
  and KL next to the 1-GPU run's (``pytest -m gpu`` checks every metric).

Then response tokens per second of vLLM and transformers ``generate`` behind the same collector,
on a model of Qwen2.5-0.5B's shape (random weights, fixed-length responses) at batch 64.

    rlhf-torchrl bench gpu_suite                    # all rows
    python -m pytest -m gpu                         # the same paths as tests (a clone)

Without a CUDA GPU it prints that and exits 0: nothing here runs on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

import torch

from rlhf_torchrl.benchmarks import backends, scaling
from rlhf_torchrl.benchmarks.common import (
    add_out_arg,
    finish,
    machine,
    make_parser,
    recipe_model,
    table,
)

ROWS = {  # row label -> scaling.py variant
    "transformers fp32": "fp32",
    "transformers bf16 autocast": "bf16",
    "transformers fp32, packed": "packed",
    "transformers fp32, compiled": "compiled",
    "transformers bf16, packed + compiled": "bf16-packed-compiled",
    "transformers bf16, packed, flash-attn varlen": "bf16-packed-flash",
    "transformers, overlap 1 (a copy samples)": "async",
    "vLLM, sleep mode": "vllm-sleep",
    "vLLM awake, overlap 1": "async-vllm-awake",
    "2 GPUs, DDP (NCCL)": "two-processes",
    "2 GPUs, FSDP2 (NCCL)": "two-processes-fsdp2",
}


def vllm_on_cuda() -> str | None:
    """None if a CUDA build of vLLM is importable, else why not."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install vllm)"
    from vllm.platforms import current_platform

    return None if current_platform.is_cuda() else "the installed vLLM is not a CUDA build"


def recipe_rows(args) -> tuple[list, dict]:
    skip = {}
    if (reason := vllm_on_cuda()) is not None:
        skip.update({label: reason for label, v in ROWS.items() if "vllm" in v})
    if importlib.util.find_spec("flash_attn") is None:
        skip.update({label: "flash-attn is not installed (pip install flash-attn)"
                     for label, v in ROWS.items() if v.endswith("flash")})
    if torch.cuda.device_count() < 2:
        skip.update({label: "needs 2 GPUs" for label, v in ROWS.items() if v.startswith("two")})
    run_args = argparse.Namespace(
        model=args.model, iterations=args.iterations, batch_size=args.batch_size,
        response_length=args.response_length, micro_batch_tokens=256, threads=args.threads,
        device="cuda", overrides=list(args.overrides))
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        model = recipe_model(args.model, os.path.join(tmp, "model"))
        for label, variant in ROWS.items():
            if label in skip:
                rows.append([label, *["-"] * 8, f"skipped: {skip[label]}"])
                continue
            r = results[label] = scaling.run_variant(variant, run_args, os.path.join(tmp, variant),
                                                     model)
            hidden = (1 - r["generation"] / r["sampling"]) if r.get("sampling") else None
            base = results.get("transformers fp32")
            note = ""
            if variant.startswith("two") and base is not None:
                note = (f"score {r['final_score']:+.4f} vs {base['final_score']:+.4f}, "
                        f"KL {r['final_kl']:.4f} vs {base['final_kl']:.4f} on 1 GPU")
            rows.append([label, f"{r['total']:.2f}", f"{r['generation']:.2f}",
                         f"{r['old_quantities']:.2f}", f"{r['update']:.2f}",
                         f"{r['weight_sync']:.3f}" if "weight_sync" in r else "-",
                         "-" if hidden is None else f"{100 * hidden:.0f}%",
                         f"{r['tokens_per_second']:.0f}" if "tokens_per_second" in r else "-",
                         f"{r['peak_rss_mb']:.0f}", note])
            print(f"{label}: {r['total']:.2f} s/iteration", flush=True)
    return rows, results


def throughput(args) -> dict | None:
    names = ["transformers"] + (["vllm"] if vllm_on_cuda() is None else [])
    return backends.main([
        "--model", args.throughput_model, "--backends", *names, "--device", "cuda",
        "--batch-sizes", "64", "--lengths", str(args.throughput_length), "--repeats", "3",
        "--vllm-dtype", "bfloat16", "--threads", str(args.threads)])


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="smollm2",
                        help="the recipe's policy: a preset (tiny-gpt2, tiny-llama, smollm2, "
                             "qwen2-0.5b-shape), a local model directory or a hub id")
    parser.add_argument("--iterations", type=int, default=4,
                        help="PPO iterations per row (the first is warm-up)")
    parser.add_argument("--batch-size", type=int, default=32, help="ppo.batch_size")
    parser.add_argument("--response-length", type=int, default=64, help="generation.max_new_tokens")
    parser.add_argument("--throughput-model", default="qwen2-0.5b-shape",
                        help="the tokens/s table's model (a preset, directory or hub id)")
    parser.add_argument("--throughput-length", type=int, default=128,
                        help="the tokens/s table's response length")
    parser.add_argument("--threads", type=int, default=4, help="torch's CPU threads")
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[], help="more recipe overrides")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU is visible: the GPU suite has nothing to run here. On a machine with "
              "one (two for the DDP/FSDP2 rows): rlhf-torchrl bench gpu_suite")
        return {"skipped": "no CUDA GPU"}
    rows, results = recipe_rows(args)
    print(f"\nPPO recipe on {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, "
          f"{args.model}, batch {args.batch_size}, response {args.response_length}, median of "
          f"iterations 2..{args.iterations} (s)")
    print(table(rows, ["run", "s/iteration", "generation", "old quantities", "update",
                       "weight push", "sampling hidden", "tokens/s", "peak RSS (MB)", "note"]))
    speed = throughput(args)
    result = {"args": vars(args), "machine": machine(), "gpu": torch.cuda.get_device_name(),
              "gpus": torch.cuda.device_count(), "recipe": results, "throughput": speed}
    return finish(args, result, "gpu_suite")


if __name__ == "__main__":
    main()
