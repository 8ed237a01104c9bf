"""Partial rollouts against whole responses, on responses whose lengths vary widely.

The PPO recipe runs in this process with ``collection.partial_rollout`` off and on, alternately
(``--repeats`` times each, the same seed), so both see the same machine. For each: the median
seconds per iteration (whole, and its generation phase), the response tokens trained on per second
of generation and per second of the iteration (sums over the iterations after each run's first),
the lengths of the responses trained on, and for partial rollouts the price: each token's
staleness in policy versions and the share of responses sampled by more than one version.

The built ``tiny-llama`` (byte tokenizer) is given lengths that vary widely: its LM head ends a
response at each step with probability about ``1 / --mean-length`` (at the recipe's temperature),
so lengths are geometric, most short, a few running to ``--response-length``; a batch of whole
responses then decodes as long as its longest. Any other ``--model`` keeps its own lengths (the
sentiment task: SmolLM2 stops after a sentence or runs on).

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench partial_rollout --batch-size 16 \\
        --response-length 128 --segment 32 --iterations 6
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.benchmarks.common import (
    add_model_args,
    add_out_arg,
    finish,
    machine,
    make_parser,
    table,
)

#: the recipe's sampling temperature (the sentiment preset's)
TEMPERATURE = 0.7


def varied_lengths(model, tokenizer, mean_length: float, temperature: float = TEMPERATURE):
    """``model`` (a built Llama) made to end each response at every step with probability about
    ``1 / mean_length``: one hidden unit made large and constant, the LM head reading it alone,
    the space and the 26 lowercase letters likely, EOS as likely as the ratio needs, the rest
    about never (conftest's stopping Llama, calibrated)."""
    words = tokenizer(" abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        prompt = tokenizer(["A review of the film:"], return_tensors="pt")
        unit = float(model.model(**prompt).last_hidden_state[0, :, 0].mean())  # after the final norm
        word_logit = 8.0  # (scaled by the temperature): the other tokens weigh ~e^-8 each
        others = len(words) * math.exp(word_logit) + model.config.vocab_size - len(words) - 1
        p = 1.0 / mean_length
        eos_logit = math.log(p / (1 - p) * others)
        model.lm_head.weight.zero_()
        model.lm_head.weight[words, 0] = word_logit * temperature / unit
        model.lm_head.weight[tokenizer.eos_token_id, 0] = eos_logit * temperature / unit
    return model


def run(args, mode: str, model_overrides: list[str], out_dir: str) -> dict:
    """One recipe run (``mode``: ``whole`` or ``partial``); its iterations' figures."""
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.builders import build_trainer

    overrides = [
        *model_overrides, f"output_dir={out_dir}", f"threads={args.threads}",
        f"ppo.num_iterations={args.iterations}", f"ppo.batch_size={args.batch_size}",
        f"generation.max_new_tokens={args.response_length}", f"generation.temperature={TEMPERATURE}",
        "logging.progress_bar=false", "logging.logger=null", "logging.save_model=false",
        "eval.every=0", "checkpoint.every=0", "optim.critic_warmup=0", "model.autocast=null",
        "reuse_freed_memory=false", "resume=never",
        *(["collection.partial_rollout=true", f"collection.partial_rollout_tokens={args.segment}"]
          if mode == "partial" else []),
        *args.overrides]
    trainer = build_trainer(compose(overrides))
    lengths: list[list[int]] = []
    trainer.register_op("batch_process", lambda r: lengths.append(
        r.get(K.RESPONSE_MASK).sum(-1).tolist()))
    rows: list[dict] = []
    trainer.register_op("log", rows.append)
    trainer.fit()
    steady = slice(1, None) if len(rows) > 1 else slice(None)  # the first iteration warms up
    kept, trained = rows[steady], [n for batch in lengths[steady] for n in batch]
    tokens = sum(trained)
    out = {"seconds_per_iteration": statistics.median(r["time/total"] for r in kept),
           "generation_seconds": statistics.median(r["time/generation"] for r in kept),
           "tokens_per_second_generation": tokens / sum(r["time/generation"] for r in kept),
           "tokens_per_second_iteration": tokens / sum(r["time/total"] for r in kept),
           "mean_length": statistics.fmean(trained), "max_length": max(trained),
           "p90_length": sorted(trained)[int(0.9 * (len(trained) - 1))],
           "iterations": len(kept)}
    if mode == "partial":
        out["token_staleness"] = statistics.fmean(r["partial/token_staleness"] for r in kept)
        out["mixed_version_frac"] = statistics.fmean(r["partial/mixed_version_frac"] for r in kept)
        out["segments"] = statistics.fmean(r["partial/segments"] for r in kept)
    return out


def merge(runs: list[dict]) -> dict:
    """One mode's figures over its repeats: medians of the per-run figures."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_model_args(parser, default="tiny-llama")
    parser.add_argument("--batch-size", type=int, default=16, help="ppo.batch_size")
    parser.add_argument("--response-length", type=int, default=128,
                        help="generation.max_new_tokens")
    parser.add_argument("--segment", type=int, default=32,
                        help="collection.partial_rollout_tokens: tokens a response grows per round")
    parser.add_argument("--mean-length", type=float, default=24.0,
                        help="the built model's mean response length (geometric)")
    parser.add_argument("--iterations", type=int, default=6,
                        help="PPO iterations per run (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each mode, alternately (whole, partial, whole, ...)")
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[],
                        help="more recipe overrides, e.g. ppo.num_mini_batches=2")
    args = parser.parse_args(argv)
    from rlhf_torchrl.benchmarks.common import BUILT, load_policy, tokenizer_choice

    runs: dict[str, list[dict]] = {"whole": [], "partial": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model in BUILT:
            tokenizer, policy = load_policy(args.model, args.tokenizer)
            folder = os.path.join(tmp, "model")
            varied_lengths(policy, tokenizer, args.mean_length).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            bytes_ = tokenizer_choice(args.model, args.tokenizer) == "bytes"
            model = [f"model.policy={folder}", *(["data.max_prompt_length=512"] if bytes_ else [])]
        else:
            from rlhf_torchrl.benchmarks.common import recipe_model

            model = recipe_model(args.model, os.path.join(tmp, "model"), args.tokenizer)
        for repeat in range(args.repeats):
            for mode in runs:
                runs[mode].append(run(args, mode, model, os.path.join(tmp, f"{mode}-{repeat}")))
                print(f"{mode} #{repeat + 1}: {runs[mode][-1]['seconds_per_iteration']:.2f} "
                      "s/iteration", flush=True)
    modes = {mode: merge(r) for mode, r in runs.items()}
    whole = modes["whole"]
    rows = [[mode, f"{m['seconds_per_iteration']:.2f}", f"{m['generation_seconds']:.2f}",
             f"{m['tokens_per_second_generation']:.0f}", f"{m['tokens_per_second_iteration']:.0f}",
             f"{whole['seconds_per_iteration'] / m['seconds_per_iteration']:.2f}x",
             f"{m['mean_length']:.1f} / {m['p90_length']} / {m['max_length']}",
             f"{m.get('token_staleness', 0):.2f}", f"{m.get('mixed_version_frac', 0):.2f}"]
            for mode, m in modes.items()]
    print(f"\nPPO recipe, {args.model}, batch {args.batch_size}, responses up to "
          f"{args.response_length} tokens, partial rounds of {args.segment}; medians of "
          f"{args.repeats} run(s) per mode, iterations 2..{args.iterations}")
    print(table(rows, ["mode", "s/iteration", "generation s", "tokens/s (generation)",
                       "tokens/s (iteration)", "speed-up", "length mean / p90 / max",
                       "token staleness", "mixed-version frac"]))
    payload = {"args": vars(args), "machine": machine(), "modes": modes, "runs": runs}
    return finish(args, payload, "partial_rollout")


if __name__ == "__main__":
    main()
