"""Seconds per PPO iteration by phase, next to the compute floor of the same shapes.

Ours: the library's pieces exactly as the recipe runs them (the collector over the TorchRL env,
scoring, old/ref log-probs and values, KL shaping + GAE, ClipPPOLoss update through the replay
buffer).
Floor: the same shapes as bare model calls with nothing else (one ``generate`` with the same
sampler; no-grad forwards of the reference with the sampled tokens' log-probs (the old log-probs
and the shared trunk's values come off the sampling pass, as in the recipe), and with
``--recompute-log-probs`` of the whole policy too; forward/backward/AdamW step per minibatch; the
LM head only on response positions and the library's log-prob function throughout, so the ratio is
what the framework around the model calls costs). Also timed: plain ``generate(do_sample=True)``
(HF's multinomial sampler), what generation costs without ours. The three are measured
alternately, iteration by iteration, and reported as medians after warm-up.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench ppo_iteration --model tiny-gpt2 --batch-size 16

``--autocast bfloat16`` runs every model call of both sides under bf16 autocast (the old log-probs
then recomputed, as the recipe does in bf16). ``--packing`` and ``--compile`` set ours as
``model.packing`` and ``model.compile`` do; ``--variants`` also times the old-quantities and update
phases in other layouts (padded or packed, eager or compiled) on the same rollout, in rotating
order, each with its own first iteration (a compiled one's includes compiling). The floor stays
padded and eager: the floor table's rows (benchmarks/README.md) are these against it.

    rlhf-torchrl bench ppo_iteration --model smollm2 --variants packed padded+compiled packed+compiled
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import LogitsProcessorList

from rlhf_torchrl import keys as K
from rlhf_torchrl.benchmarks.common import (
    add_model_args,
    add_out_arg,
    add_runtime_args,
    apply_runtime_args,
    build_models,
    finish,
    machine,
    make_parser,
    medians,
    peak_rss_mb,
    table,
    timer,
)
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.collectors.sampling import InverseCDFSampler
from rlhf_torchrl.data import load_prompts
from rlhf_torchrl.functional import log_probs_from_logits
from rlhf_torchrl.modules import TokenLevelActor, compute_old_quantities, make_critic
from rlhf_torchrl.modules.compiled import compile_layers
from rlhf_torchrl.objectives.advantages import ResponseGAE
from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
from rlhf_torchrl.objectives.ppo import make_ppo_loss
from rlhf_torchrl.rewards.functions import vader_sentiment
from rlhf_torchrl.rewards.scoring import Scorer
from rlhf_torchrl.trainers.update import make_minibatch_buffer, ppo_update

PHASES = ("generation", "scoring", "old_quantities", "advantages", "update")
PACKING = {"false": False, "true": True, "auto": "auto"}
#: ``--variants``: name -> (model.packing, compiled)
VARIANTS = {f"{layout}{'+compiled' if compiled else ''}": (PACKING[flag], compiled)
            for layout, flag in (("padded", "false"), ("packed", "true"), ("auto", "auto"))
            for compiled in (False, True)}


def _learner(policy, reference, args, packing, compiled: bool) -> dict:
    """Actor, reference, shared-trunk critic and loss laid out as ``packing`` says; ``compiled``:
    whether their calls run the compiled layers (:func:`_stance`)."""
    bf16 = torch.bfloat16 if args.autocast == "bfloat16" else None
    critic = make_critic(policy=policy, tokenizer=None, init="shared", autocast_dtype=bf16,
                         packing=packing)
    actor = TokenLevelActor(policy, temperature=args.temperature, autocast_dtype=bf16,
                            trunk_critic=None if args.no_trunk_handoff else critic, packing=packing)
    loss = make_ppo_loss(actor, critic)
    return {"actor": actor, "critic": critic, "loss": loss, "compiled": compiled,
            "ref": TokenLevelActor(reference, temperature=args.temperature, out_key=K.REF_LOG_PROB,
                                   autocast_dtype=bf16, packing=packing)}


def _stance(compiled: bool):
    """Compiled layers run eagerly for a way that is not compiled (one process times both)."""
    return nullcontext() if compiled else torch.compiler.set_stance("force_eager")


def run_variants(parts, rollout, args, times: dict) -> None:
    """The old-quantities and update phases of each ``--variants`` way on ``rollout``, in an order
    that rotates from iteration to iteration."""
    names = list(parts["variants"])
    shift = parts.setdefault("variant_calls", 0) % max(len(names), 1)
    parts["variant_calls"] += 1
    for name in names[shift:] + names[:shift]:
        way, copy = parts["variants"][name], rollout.clone()
        with timer(times, f"old_quantities, {name}"), _stance(way["compiled"]):
            compute_old_quantities(copy, actor=way["actor"], reference=way["ref"], critic=way["critic"],
                             chunk_size=args.forward_batch_size,
                             exact_entropy=not args.sample_entropy,
                             recompute_log_probs=args.recompute_log_probs)
        with timer(times, f"update, {name}"), _stance(way["compiled"]):
            ppo_update(rollout, way["loss"], parts["optimizer"], num_ppo_epochs=args.epochs,
                       num_mini_batches=args.minibatches, replay_buffer=parts["buffer"],
                       micro_batch_tokens=args.micro_batch_tokens)


def _autocast(args):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bfloat16")


def run_ours(parts, rollouts, args) -> tuple[dict, object]:
    times: dict[str, float] = {}
    parts["policy"].eval()
    with timer(times, "generation"):
        rollout = next(rollouts)
    with timer(times, "scoring"):
        parts["scorer"](rollout)
    with timer(times, "old_quantities"), _stance(args.compile):
        compute_old_quantities(rollout, actor=parts["actor"], reference=parts["ref"],
                         critic=parts["critic"], chunk_size=args.forward_batch_size,
                         exact_entropy=not args.sample_entropy,
                         recompute_log_probs=args.recompute_log_probs)
    with timer(times, "advantages"):
        parts["gae"](parts["shaper"](rollout))
    # with --micro-batch-tokens the update runs both ways on the same rollout, in alternating order
    ways = [("update", None)]
    if args.micro_batch_tokens:
        ways.append(("update_token_budget", args.micro_batch_tokens))
        if parts.setdefault("calls", 0) % 2:
            ways.reverse()
        parts["calls"] += 1
    for name, budget in ways:
        with timer(times, name), _stance(args.compile):
            ppo_update(rollout, parts["loss"], parts["optimizer"], num_ppo_epochs=args.epochs,
                       num_mini_batches=args.minibatches, replay_buffer=parts["buffer"],
                       micro_batch_tokens=budget)
    run_variants(parts, rollout, args, times)
    mask = torch.cat([rollout.get(K.PROMPT_MASK), rollout.get(K.RESPONSE_MASK)], 1)
    times["padded_share"] = 1.0 - float(mask.float().mean())  # of the padded minibatch's positions
    times["total"] = sum(times[p] for p in PHASES)
    times["response_tokens"] = float(rollout.get(K.RESPONSE_MASK).sum())
    times["tokens_per_second"] = times["response_tokens"] / times["generation"]
    return times, rollout


def run_floor(parts, rollout, args) -> dict:
    """Bare model calls on the shapes of ``rollout`` (same prompts, same response length)."""
    policy, reference, tok = parts["policy"], parts["reference"], parts["tokenizer"]
    prompts = rollout.get(K.PROMPT_TOKENS)
    prompt_mask = rollout.get(K.PROMPT_MASK).long()
    times: dict[str, float] = {}
    sampling = {"max_new_tokens": args.response_length, "pad_token_id": tok.pad_token_id,
                "eos_token_id": tok.eos_token_id}
    with timer(times, "generation"), torch.no_grad(), _autocast(args):
        sampler = InverseCDFSampler(args.temperature)  # records, as the recipe always does
        out = policy.generate(prompts, attention_mask=prompt_mask, do_sample=False,
                              logits_processor=LogitsProcessorList([sampler]), **sampling)
        sampler.pop()
    generated = out[:, prompts.shape[1]:]
    times["response_tokens"] = float((generated != tok.pad_token_id).sum())
    times["tokens_per_second"] = times["response_tokens"] / times["generation"]
    with timer(times, "hf_generate"), torch.no_grad(), _autocast(args):
        out = policy.generate(prompts, attention_mask=prompt_mask, do_sample=True,
                              temperature=args.temperature, top_k=None, **sampling)
    times["hf_tokens_per_second"] = float((out[:, prompts.shape[1]:] != tok.pad_token_id).sum()) \
        / times["hf_generate"]
    # same token shapes as ours for the forward passes
    ids = torch.cat([prompts, rollout.get(K.RESPONSE_TOKENS)], 1)
    mask = torch.cat([prompt_mask, rollout.get(K.RESPONSE_MASK).long()], 1)
    # the LM head only where it is needed (response positions), as any careful implementation does
    keep = torch.arange(prompts.shape[1] - 1, ids.shape[1] - 1)
    response = rollout.get(K.RESPONSE_TOKENS)
    with timer(times, "old_quantities"), torch.no_grad(), _autocast(args):
        for i in range(0, ids.shape[0], args.forward_batch_size):
            rows = slice(i, i + args.forward_batch_size)
            # the required outputs: the sampled tokens' log-probs under the reference, and, unless
            # recorded while sampling, the policy's and the values (its hidden states, one pass)
            for model in (policy, reference) if args.recompute_log_probs else (reference,):
                logits = model(ids[rows], attention_mask=mask[rows], logits_to_keep=keep).logits
                log_probs_from_logits(logits, response[rows], args.temperature)
    optimizer = parts["floor_optimizer"]
    mini = ids.shape[0] // args.minibatches
    with timer(times, "update"):
        for _ in range(args.epochs):
            for i in range(0, ids.shape[0], mini):
                with _autocast(args):
                    logits = policy(ids[i:i + mini], attention_mask=mask[i:i + mini],
                                    logits_to_keep=keep).logits
                loss = -log_probs_from_logits(logits, response[i:i + mini], args.temperature).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    times["scoring"] = times["advantages"] = 0.0
    times["total"] = sum(times[p] for p in PHASES)
    return times


def variant_rows(args, ours: dict, floor: dict, first: dict) -> list[list[str]]:
    """One row per layout, ours (this command's) first: old quantities and update against the floor."""
    mine = f"ours (packing {args.packing}{', compiled' if args.compile else ''})"
    rows = []
    for label, suffix in [(mine, ""), *((name, f", {name}") for name in args.variants)]:
        old, update = ours[f"old_quantities{suffix}"], ours[f"update{suffix}"]
        rows.append([label, f"{old:.3f}", f"{old / floor['old_quantities']:.2f}x",
                     f"{update:.3f}", f"{update / floor['update']:.2f}x",
                     f"{first[f'old_quantities{suffix}'] + first[f'update{suffix}']:.3f}"])
    return rows


def build(args):
    tokenizer, policy, reference = build_models(args.model, args.seed, args.tokenizer)
    prompts = load_prompts("polarity", template="Continue this movie review: {prompt}",
                           max_words=args.max_words or None)
    bf16 = torch.bfloat16 if args.autocast == "bfloat16" else None
    if args.compile or any(VARIANTS[name][1] for name in args.variants):
        compile_layers(policy)
        compile_layers(reference)
    ours = _learner(policy, reference, args, PACKING[args.packing], args.compile)
    variants = {name: _learner(policy, reference, args, *VARIANTS[name]) for name in args.variants}
    # one AdamW for every way: the policy's moments once, and each way's own value head
    shared = {id(p): p for way in (ours, *variants.values()) for p in way["loss"].parameters()}
    critic = ours["critic"]
    env = make_generation_env(prompts, tokenizer, batch_size=args.batch_size, seed=args.seed)
    gen = make_generation_policy(policy, tokenizer, max_new_tokens=args.response_length,
                                 temperature=args.temperature, record_log_probs=True,
                                 record_entropy=not args.sample_entropy, autocast_dtype=bf16,
                                 # the shared trunk's old values off the sampling pass (the recipe's)
                                 value_head=None if args.recompute_log_probs else critic.head)
    return {
        **ours, "tokenizer": tokenizer, "policy": policy, "reference": reference,
        "variants": variants,
        "optimizer": torch.optim.AdamW(list(shared.values()), lr=1e-6, fused=True),
        "collector": RolloutCollector(env, gen, tokenizer=tokenizer),
        "scorer": Scorer({"vader": (vader_sentiment, 1.0)}),
        "shaper": KLRewardShaper(make_kl_controller(0.05)), "gae": ResponseGAE(),
        # lr=0: the floor pays for a full AdamW step but leaves the weights to ours
        "floor_optimizer": torch.optim.AdamW(policy.parameters(), lr=0.0, fused=True),
        "buffer": make_minibatch_buffer(args.batch_size, args.batch_size // args.minibatches),
    }


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="responses per rollout")
    parser.add_argument("--response-length", type=int, default=32, help="max new tokens")
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs per iteration")
    parser.add_argument("--minibatches", type=int, default=1, help="minibatches per epoch")
    parser.add_argument("--forward-batch-size", type=int, default=64,
                        help="rows per no-grad forward of the old-quantities phase")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--iterations", type=int, default=5, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt order")
    parser.add_argument("--sample-entropy", action="store_true",
                        help="log the free sample estimate of the entropy instead of the exact one")
    parser.add_argument("--recompute-log-probs", action="store_true",
                        help="old log-probs from a policy forward instead of recorded while sampling")
    parser.add_argument("--autocast", choices=["none", "bfloat16"], default="none",
                        help="bf16 autocast for every model call (implies --recompute-log-probs)")
    parser.add_argument("--no-trunk-handoff", action="store_true",
                        help="the shared-trunk critic runs the trunk itself (no hidden-state handoff)")
    parser.add_argument("--max-words", type=int, default=8,
                        help="first N words of each review sentence as the prompt (0: whole sentences, "
                             "5 to 60 words: ragged prompts, much padding)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="also time the update with token-budget micro-batches (same rollout; "
                             "the --variants' updates use it too)")
    parser.add_argument("--packing", choices=list(PACKING), default="false",
                        help="ours as model.packing: padded rows, packed real tokens, or auto")
    parser.add_argument("--compile", action="store_true",
                        help="ours as model.compile: the decoder layers compiled (the first "
                             "iteration compiles: give --warmup 1 or more)")
    parser.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                        metavar="VARIANT",
                        help=f"also time the old-quantities and update phases as {', '.join(VARIANTS)} "
                             "(same rollout, rotating order)")
    add_runtime_args(parser)
    add_out_arg(parser)
    args = parser.parse_args(argv)
    # bf16 decoding and the training forward round differently: the recipe recomputes there
    args.recompute_log_probs = args.recompute_log_probs or args.autocast == "bfloat16"
    apply_runtime_args(args)
    parts = build(args)
    rollouts = iter(parts["collector"])
    ours_rows, floor_rows, first = [], [], None
    for i in range(args.warmup + args.iterations):
        ours, rollout = run_ours(parts, rollouts, args)
        floor = run_floor(parts, rollout, args)
        first = first or ours  # the first iteration: a compiled way compiles in it
        if i >= args.warmup:
            ours_rows.append(ours)
            floor_rows.append(floor)
    parts["collector"].shutdown()
    ours, floor = medians(ours_rows), medians(floor_rows)
    rows = []
    for phase in (*PHASES, "total"):
        ratio = ours[phase] / floor[phase] if floor[phase] > 0 else float("nan")
        rows.append([phase, f"{ours[phase]:.3f}", f"{floor[phase]:.3f}",
                     "-" if floor[phase] == 0 else f"{ratio:.2f}x"])
    if args.micro_batch_tokens:
        budget = ours["update_token_budget"]
        rows.append([f"update, token budget {args.micro_batch_tokens}", f"{budget:.3f}",
                     f"{floor['update']:.3f}", f"{budget / floor['update']:.2f}x"])
    # generation alone, each way's tokens/s (the counts can differ: a response may stop early)
    speed = ours["tokens_per_second"]
    generation = [[name, f"{seconds:.3f}", f"{tps:.0f}", f"{tps / speed:.2f}x"] for name, seconds, tps in (
        ("ours: the collector", ours["generation"], speed),
        ("floor: generate, the same sampler", floor["generation"], floor["tokens_per_second"]),
        ("HF generate, multinomial", floor["hf_generate"], floor["hf_tokens_per_second"]))]
    print(f"\nPPO iteration, {args.model} ({args.autocast if args.autocast != 'none' else 'fp32'}, "
          f"vocabulary {len(parts['tokenizer'])}), "
          f"batch {args.batch_size}, response {args.response_length}, "
          f"{args.epochs} epoch(s) x {args.minibatches} minibatch(es), {args.threads} threads, "
          f"median of {args.iterations} after {args.warmup} warm-up")
    print(table(rows, ["phase", "ours (s)", "floor (s)", "ours/floor"]))
    print("\nGeneration alone, the same prompts (ours/its: our seconds per token over its)")
    print(table(generation, ["generation", "seconds", "tokens/s", "ours/its"]))
    if args.variants:
        print("\nThe old-quantities and update phases by layout, the same rollouts (floor: padded, "
              "eager; first: the first iteration's old quantities + update, compiling included)")
        print(table(variant_rows(args, ours, floor, first),
                    ["layout", "old quantities (s)", "/floor", "update (s)", "/floor", "first (s)"]))
    print(f"peak RSS: {peak_rss_mb():.0f} MB; padded positions in the rollout: "
          f"{100 * ours['padded_share']:.0f}%")
    result = {"args": vars(args), "machine": machine(), "vocabulary": len(parts["tokenizer"]),
              "ours": ours, "floor": floor, "ours_all": ours_rows, "floor_all": floor_rows,
              "first": first, "peak_rss_mb": peak_rss_mb()}
    return finish(args, result, "ppo_iteration")


if __name__ == "__main__":
    main()
