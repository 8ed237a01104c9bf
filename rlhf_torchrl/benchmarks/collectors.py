"""Response tokens per second: our TorchRL collector vs a raw ``generate`` on the same prompts.

For each batch size and response length, four are timed alternately on the very prompt tokens
the collector produced: the collector as the recipe runs it (its dense one-turn path: the env's
prompt batches rendered and sampled by the ``TransformersWrapper``'s ``generate``, laid out as a
dense rollout), the same collector through TorchRL's loop (``dense=False``: ``ChatEnv`` reset +
``TransformersWrapper`` + ``LLMCollector`` + truncation into a dense rollout), each sampling with
``InverseCDFSampler`` and recording log-probs, a
bare ``model.generate`` with the same sampler (the floor: what the collector adds is the rest), and
a bare ``model.generate(do_sample=True)`` (HF's multinomial sampler). EOS is suppressed
everywhere so that every response has exactly the requested length. Medians over ``--repeats``.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench collectors --model tiny-gpt2 --tokenizer smollm2
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LogitsProcessorList

from rlhf_torchrl import keys as K
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
)
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.collectors.sampling import InverseCDFSampler
from rlhf_torchrl.data import load_prompts


def _batches(policy, tokenizer, prompts, batch_size, length, temperature, dense):
    env = make_generation_env(prompts, tokenizer, batch_size=batch_size)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=length, temperature=temperature,
                                 record_log_probs=True)
    # no early stop on either side: exactly `length` tokens per response
    gen.generate_kwargs["min_new_tokens"] = length
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, dense=dense)  # the env's batch size
    batches = iter(collector)
    next(batches)  # warm-up
    return collector, batches


def measure(policy, tokenizer, prompts, batch_size, length, repeats, temperature):
    collector, batches = _batches(policy, tokenizer, prompts, batch_size, length, temperature, None)
    through_env, env_batches = _batches(policy, tokenizer, prompts, batch_size, length,
                                        temperature, False)
    common = {"max_new_tokens": length, "min_new_tokens": length,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    times = {"collector": [], "collector_env": [], "generate": [], "hf_generate": []}
    for _ in range(repeats):
        start = time.perf_counter()
        next(env_batches)
        times["collector_env"].append(time.perf_counter() - start)
        start = time.perf_counter()
        rollout = next(batches)
        times["collector"].append(time.perf_counter() - start)
        prompt, mask = rollout.get(K.PROMPT_TOKENS), rollout.get(K.PROMPT_MASK).long()
        with torch.no_grad():
            start = time.perf_counter()
            sampler = InverseCDFSampler(temperature, record=True)
            policy.generate(prompt, attention_mask=mask, do_sample=False,
                            logits_processor=LogitsProcessorList([sampler]), **common)
            sampler.pop()
            times["generate"].append(time.perf_counter() - start)
            start = time.perf_counter()
            policy.generate(prompt, attention_mask=mask, do_sample=True, temperature=temperature,
                            top_k=None, **common)
            times["hf_generate"].append(time.perf_counter() - start)
    collector.shutdown()
    through_env.shutdown()
    tokens = batch_size * length
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="responses per batch, one row each")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256],
                        help="response lengths (tokens), one row each")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per cell (median)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    add_runtime_args(parser)
    add_out_arg(parser)
    args = parser.parse_args(argv)
    apply_runtime_args(args)
    tokenizer, policy, _ = build_models(args.model, tokenizer=args.tokenizer)
    prompts = load_prompts("polarity", template="Continue this movie review: {prompt}", max_words=8)
    print(f"Response tokens/s: the collector (its dense one-turn path, and TorchRL's env loop), "
          f"a bare generate with the same sampler, and HF's multinomial generate; {args.model} "
          f"(vocabulary {len(tokenizer)}), {args.threads} threads, median of {args.repeats}")
    printer = RowPrinter(["batch", "length", "collector tok/s", "env loop tok/s",
                          "generate tok/s", "generate/collector", "generate/env loop",
                          "HF multinomial tok/s", "collector/HF"])
    results = []
    for batch_size in args.batch_sizes:
        for length in args.lengths:
            tps = measure(policy, tokenizer, prompts, batch_size, length, args.repeats,
                          args.temperature)
            results.append({"batch_size": batch_size, "length": length,
                            **{f"{name}_tokens_per_s": v for name, v in tps.items()}})
            ours, loop = tps["collector"], tps["collector_env"]
            raw, hf = tps["generate"], tps["hf_generate"]
            printer.row([batch_size, length, f"{ours:.0f}", f"{loop:.0f}", f"{raw:.0f}",
                         f"{raw / ours:.2f}x", f"{raw / loop:.2f}x", f"{hf:.0f}", f"{ours / hf:.2f}x"])
    payload = {"args": vars(args), "machine": machine(), "vocabulary": len(tokenizer),
               "results": results}
    return finish(args, payload, "collectors")


if __name__ == "__main__":
    main()
