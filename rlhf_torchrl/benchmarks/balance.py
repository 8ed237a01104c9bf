"""Sequence-length balancing across data-parallel processes (``distributed.balance``): the PPO
update's seconds on ``torchrun`` processes, rows balanced by real tokens against equal slices.

For each ``--layouts`` entry one ``torchrun --nproc_per_node=--processes`` job (gloo, one thread
per process) builds the same models and the same global rollout on every process, as the recipe
has it after the all-gather: ``--batch-size`` rows of ragged prompts and of responses whose lengths
are log-normal (median ``--median-length``, spread ``--sigma``, capped at ``--response-length``: most
short, a few long, as reasoning answers are). Then the update (:func:`~rlhf_torchrl.trainers.update.
ppo_update`, ``--minibatches`` per epoch) runs ``--repeats`` times each way, balanced and not, in
alternating order, each pair drawing the same minibatches (the shuffle seeded by the repeat), after
one warm-up call each. Reported per way, as medians: the slowest process's seconds for the update
(every process waits on it at each gradient all-reduce); the critical busy seconds, each
minibatch's slowest process's CPU seconds (``time.process_time`` up to its optimiser step: its own
work, not its waits) summed over the minibatches, which is the update's time on an idle machine
with a core per process and moves less than the wall clock when other jobs share the cores; each
process's busy seconds; the real tokens of the busiest process over the mean. Ratios are the
medians of the paired ratios (balanced / unbalanced, the same repeat).

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench balance --repeats 7 --out runs/balance.json

Layouts: ``padded`` (one padded micro-batch per process and minibatch: the recipe's default),
``padded-accumulation`` (``--accumulation`` equal row slices), ``token-budget``
(``ppo.micro_batch_tokens=--micro-batch-tokens``, padded), ``packed`` (``model.packing=true``) and
``packed-token-budget``. The models are built with seeded random weights (``--model``): figures of
speed, never of quality.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.benchmarks.common import (
    add_model_args,
    add_out_arg,
    add_timeout_arg,
    finish,
    machine,
    make_parser,
    run_bounded,
    table,
)

#: name -> (model.packing, micro-batches by token budget, equal row slices)
LAYOUTS = {"padded": (False, False, False), "padded-accumulation": (False, False, True),
           "token-budget": (False, True, False), "packed": (True, False, False),
           "packed-token-budget": (True, True, False)}
WAYS = ("unbalanced", "balanced")


def _parser():
    parser = make_parser(__doc__)
    add_model_args(parser, default="tiny-llama")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--processes", type=int, default=2, help="torchrun processes (gloo)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--batch-size", type=int, default=64, help="rows of the global rollout")
    parser.add_argument("--minibatches", type=int, default=4, help="minibatches per epoch")
    parser.add_argument("--prompt-length", type=int, default=32,
                        help="the longest prompt (prompts drawn from half of it to it)")
    parser.add_argument("--median-length", type=int, default=48, help="responses' median length")
    parser.add_argument("--sigma", type=float, default=1.0,
                        help="spread of the log of the response lengths")
    parser.add_argument("--response-length", type=int, default=512, help="the longest response")
    parser.add_argument("--accumulation", type=int, default=2,
                        help="equal row slices per process (padded-accumulation)")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024,
                        help="the token budget of the token-budget layouts")
    parser.add_argument("--repeats", type=int, default=5, help="update calls per way, after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    # a torchrun worker's own options (not in --help)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="padded", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    add_timeout_arg(parser, 3600)
    add_out_arg(parser)
    return parser


def ragged_rollout(tokenizer, args):
    """The global rollout's tokens: ragged prompts (left-padded) and log-normal response lengths
    (right-padded), the same on every process (seeded)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(args.seed)
    B, P, R = args.batch_size, args.prompt_length, args.response_length
    p_len = torch.randint(max(P // 2, 1), P + 1, (B,), generator=g)
    normal = torch.randn(B, generator=g)
    r_len = (args.median_length * torch.exp(args.sigma * normal)).round().clamp(1, R).long()
    low, high = 3, len(tokenizer)  # past the special tokens of the byte tokenizer
    prompt = torch.randint(low, high, (B, P), generator=g)
    response = torch.randint(low, high, (B, R), generator=g)
    prompt_mask = torch.arange(P).expand(B, P) >= (P - p_len).unsqueeze(1)  # (B, P), left-padded
    response_mask = torch.arange(R).expand(B, R) < r_len.unsqueeze(1)  # (B, R), right-padded
    pad = tokenizer.pad_token_id
    return TensorDict({
        K.PROMPT_TOKENS: prompt.masked_fill(~prompt_mask, pad), K.PROMPT_MASK: prompt_mask,
        K.RESPONSE_TOKENS: response.masked_fill(~response_mask, pad),
        K.RESPONSE_MASK: response_mask, K.HAS_STOP: torch.ones(B, dtype=torch.bool),
        K.SCORE: torch.randn(B, generator=g),
    }, batch_size=[B])


def rank_tokens(rollout, args, balance: bool, seed: int) -> float:
    """The real tokens of the busiest process over the mean, summed over one epoch's minibatches
    (drawn as the update draws them)."""
    from rlhf_torchrl.modules.sequences import response_attention
    from rlhf_torchrl.trainers.micro_batches import balanced_partition
    from rlhf_torchrl.trainers.update import make_minibatch_buffer

    packed, budget, _ = LAYOUTS[args.layout]
    buffer = make_minibatch_buffer(rollout.shape[0], seed=seed)
    buffer.extend(rollout.select(K.PROMPT_MASK, K.RESPONSE_MASK))
    n, sizes = args.processes, [len(p) for p in torch.arange(rollout.shape[0]).tensor_split(args.minibatches)]
    busiest = total = 0.0
    for size in sizes:
        minibatch = buffer.sample(size).contiguous()
        lengths = (minibatch.get(K.PROMPT_MASK).sum(-1) + response_attention(minibatch).sum(-1)).tolist()
        if balance:
            sets = balanced_partition(lengths, n, equal_size=not (packed or budget))
        else:
            sets = [list(p) for p in torch.arange(size).tensor_split(n)]
        per_rank = [sum(lengths[i] for i in s) for s in sets]
        busiest, total = busiest + max(per_rank), total + sum(per_rank)
    return busiest / (total / n)


def _worker(args) -> None:
    """One process of the torchrun job: the models, the rollout, then the update each way."""
    from rlhf_torchrl.benchmarks.common import build_models
    from rlhf_torchrl.distributed import init_data_parallel
    from rlhf_torchrl.modules import compute_old_quantities, make_critic
    from rlhf_torchrl.modules.assembly import make_actors
    from rlhf_torchrl.objectives.advantages import ResponseGAE
    from rlhf_torchrl.objectives.kl_shaping import KLRewardShaper, make_kl_controller
    from rlhf_torchrl.objectives.ppo import make_ppo_loss
    from rlhf_torchrl.trainers.update import make_minibatch_buffer, ppo_update

    torch.set_num_threads(1)
    packed, budget, accumulate = LAYOUTS[args.layout]
    parallel = init_data_parallel(args.strategy)
    tok, policy, reference = build_models(args.model, seed=args.seed, tokenizer=args.tokenizer)
    critic = make_critic(policy=policy, tokenizer=tok, init="shared", packing=packed)
    parallel.shard(policy, reference, *critic.modules_to_shard())
    actor, ref = make_actors(policy, reference, critic, temperature=1.0, packing=packed)
    loss = make_ppo_loss(actor, critic)
    parallel.wrap_loss(loss)
    optimizer = torch.optim.AdamW([p for p in loss.parameters() if p.requires_grad], lr=1e-6)
    rollout = ragged_rollout(tok, args)
    compute_old_quantities(rollout, actor=actor, reference=ref, critic=critic, chunk_size=16)
    ResponseGAE()(KLRewardShaper(make_kl_controller(0.05))(rollout))
    settings = dict(num_ppo_epochs=1, num_mini_batches=args.minibatches,
                    gradient_accumulation_steps=args.accumulation if accumulate else 1,
                    micro_batch_tokens=args.micro_batch_tokens if budget else None)
    # this process's CPU clock as each optimiser step starts: a minibatch's work ends there
    steps: list[float] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(time.process_time()))
    rows = []
    for repeat in range(-1, args.repeats):  # -1: warm-up, not recorded
        ways = WAYS if repeat % 2 else WAYS[::-1]  # alternating order
        for way in ways:
            parallel.balance = way == "balanced"
            buffer = make_minibatch_buffer(rollout.shape[0], seed=args.seed + repeat + 1)
            parallel.barrier()
            steps.clear()
            start, busy = time.perf_counter(), time.process_time()
            ppo_update(rollout, loss, optimizer, replay_buffer=buffer, parallel=parallel, **settings)
            wall, cpu = time.perf_counter() - start, time.process_time() - busy
            # each minibatch's busy seconds on this process (its waits on the others excluded)
            per_step = [b - a for a, b in zip([busy, *steps], steps)]
            times = torch.tensor([wall, cpu, *per_step], dtype=torch.float64)
            parts = [torch.empty_like(times) for _ in range(parallel.world_size)]
            torch.distributed.all_gather(parts, times)
            if repeat >= 0:
                per_rank = torch.stack(parts)  # (processes, 2 + minibatches)
                rows.append({"way": way, "repeat": repeat,
                             "seconds": per_rank[:, 0].tolist(),
                             "busy_seconds": per_rank[:, 1].tolist(),
                             # the slowest process of each minibatch, summed: the update's
                             # seconds on an idle machine of a core per process
                             "critical_busy_seconds": float(per_rank[:, 2:].max(0).values.sum()),
                             "token_imbalance": rank_tokens(rollout, args, way == "balanced",
                                                            args.seed + repeat + 1)})
    if parallel.is_main and args.result:
        with open(args.result, "w") as f:
            json.dump(rows, f)
    parallel.shutdown()


def summarize(rows: list[dict]) -> dict:
    """Per way: medians of the slowest process's seconds and of each process's busy seconds,
    the token imbalance; and the median of the paired ratios balanced / unbalanced."""
    out = {}
    for way in WAYS:
        mine = [r for r in rows if r["way"] == way]
        out[way] = {"seconds": statistics.median(max(r["seconds"]) for r in mine),
                    "critical_busy_seconds": statistics.median(r["critical_busy_seconds"] for r in mine),
                    "busy_seconds": [statistics.median(r["busy_seconds"][i] for r in mine)
                                     for i in range(len(mine[0]["busy_seconds"]))],
                    "token_imbalance": statistics.median(r["token_imbalance"] for r in mine)}
    for name, figure in (("paired_ratio", lambda r: max(r["seconds"])),
                         ("paired_ratio_critical_busy", lambda r: r["critical_busy_seconds"])):
        pairs: dict[int, dict] = {}
        for r in rows:
            pairs.setdefault(r["repeat"], {})[r["way"]] = figure(r)
        out[name] = statistics.median(p["balanced"] / p["unbalanced"] for p in pairs.values())
    return out


def _job(args, layout: str) -> list[dict]:
    """The torchrun job of one layout; returns its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={args.processes}", "-m", "rlhf_torchrl.benchmarks.balance",
                   *_worker_args(args), "--worker", "--layout", layout, "--result", result]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        proc = run_bounded(command, args.timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the {layout} job failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(result) as f:
            return json.load(f)


def _worker_args(args) -> list[str]:
    """The options a worker needs, as given to this process."""
    out = ["--model", args.model, "--tokenizer", args.tokenizer]
    for name in ("processes", "strategy", "batch_size", "minibatches", "prompt_length",
                 "median_length", "sigma", "response_length", "accumulation", "micro_batch_tokens",
                 "repeats", "seed"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def main(argv: list[str] | None = None) -> dict | None:
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return None
    header = ["layout", "unbalanced s", "balanced s", "ratio", "critical busy s, unbal.", "bal.",
              "ratio", "busy s per process, unbal.", "bal.", "tokens max/mean, unbal.", "bal."]
    results, lines = {}, []
    for layout in args.layouts:
        rows = _job(args, layout)
        s = results[layout] = {**summarize(rows), "rows": rows}
        u, b = s["unbalanced"], s["balanced"]
        lines.append([layout, f"{u['seconds']:.3f}", f"{b['seconds']:.3f}",
                      f"{s['paired_ratio']:.3f}", f"{u['critical_busy_seconds']:.3f}",
                      f"{b['critical_busy_seconds']:.3f}", f"{s['paired_ratio_critical_busy']:.3f}",
                      " / ".join(f"{x:.2f}" for x in u["busy_seconds"]),
                      " / ".join(f"{x:.2f}" for x in b["busy_seconds"]),
                      f"{u['token_imbalance']:.3f}", f"{b['token_imbalance']:.3f}"])
        print(f"{layout}: done", file=sys.stderr, flush=True)
    print(table(lines, header))
    payload = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "layout", "result")},
               "machine": {**machine(), "threads": 1}, "layouts": results}
    return finish(args, payload, "balance")


if __name__ == "__main__":
    main()
