"""Response tokens per second: our TorchRL collector vs a raw ``generate`` on the same prompts.

For each batch size and response length, the collector (``ChatEnv`` + ``TransformersWrapper`` +
``LLMCollector`` + truncation into a dense rollout) and a bare ``model.generate`` on the very
prompt tokens the collector produced are timed alternately; EOS is suppressed on both sides so
that every response has exactly the requested length. Medians over ``--repeats``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/collectors.py --model tiny-gpt2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import MODELS, build_models, machine, table, write_json  # noqa: E402

from rlhf_torchrl import keys as K  # noqa: E402
from rlhf_torchrl.collectors import (  # noqa: E402
    RolloutCollector,
    make_generation_env,
    make_generation_policy,
)
from rlhf_torchrl.data import load_prompts  # noqa: E402


def measure(policy, tokenizer, prompts, batch_size, length, repeats, temperature):
    env = make_generation_env(prompts, tokenizer, batch_size=batch_size)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=length, temperature=temperature)
    # no early stop on either side: exactly `length` tokens per response
    gen.generate_kwargs["min_new_tokens"] = length
    collector = RolloutCollector(env, gen, tokenizer=tokenizer, batch_size=batch_size)
    batches = iter(collector)
    next(batches)  # warm-up
    ours, raw = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = next(batches)
        ours.append(time.perf_counter() - start)
        prompt, mask = rollout.get(K.PROMPT_TOKENS), rollout.get(K.PROMPT_MASK).long()
        start = time.perf_counter()
        with torch.no_grad():
            policy.generate(prompt, attention_mask=mask, do_sample=True, temperature=temperature,
                            top_k=None, max_new_tokens=length, min_new_tokens=length,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        raw.append(time.perf_counter() - start)
    collector.shutdown()
    tokens = batch_size * length
    return tokens / statistics.median(ours), tokens / statistics.median(raw)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="tiny-gpt2")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/collectors.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, policy, _ = build_models(args.model)
    prompts = load_prompts("polarity", template="Continue this movie review: {prompt}", max_words=8)
    rows, results = [], []
    for batch_size in args.batch_sizes:
        for length in args.lengths:
            ours, raw = measure(policy, tokenizer, prompts, batch_size, length, args.repeats,
                                args.temperature)
            results.append({"batch_size": batch_size, "length": length,
                            "collector_tokens_per_s": ours, "generate_tokens_per_s": raw})
            rows.append([batch_size, length, f"{ours:.0f}", f"{raw:.0f}", f"{raw / ours:.2f}x"])
            print(table(rows[-1:], ["batch", "length", "collector tok/s", "generate tok/s",
                                    "generate/collector"]).splitlines()[-1], flush=True)
    print(f"\nCollector vs raw generate, {args.model}, {args.threads} threads, "
          f"median of {args.repeats}")
    print(table(rows, ["batch", "length", "collector tok/s", "generate tok/s", "generate/collector"]))
    payload = {"args": vars(args), "machine": machine(), "results": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
