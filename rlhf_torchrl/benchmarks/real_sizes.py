"""Real model sizes on one GPU: the PPO recipe with Qwen2.5-0.5B's and 1.5B's architectures at
verl's single-GPU quickstart settings, beside the floor of the same shapes and verl's published
step.

The models are random inits of the ``config.json`` files in ``model_configs/`` (Qwen2.5's
published shapes, its 151,936-token vocabulary included: no weights to download), with SmolLM2's
tokenizer for the text (ids it does not know decode to nothing; the shapes are what is measured).
A random init almost never samples EOS, so every response is 256 tokens (verl's step 0 averaged
239). The prompts are made to GSM8K's lengths in verl's log (68 to 185 tokens, mean ~105).

verl's quickstart (``docs/start/quickstart.rst``, Qwen2.5-0.5B-Instruct, one GPU): 256 prompts a
step, prompts up to 512 tokens, responses up to 256, minibatches of 64 (4 a step, one epoch), a
separate critic, KL coefficient 0.001, actor lr 1e-6, critic lr 1e-5. It logs per step (step 0):
generation 21.5 s, reference 4.4 s, values 5.8 s, critic update 15.7 s, actor update 20.3 s. Ours
runs the same work in bf16 autocast over fp32 weights; our ``old_quantities`` phase is verl's
reference + values (+ the recomputed old log-probs, which verl's log puts elsewhere) and our
``update`` is its critic + actor updates.

Per model, each in its own process (the GPU's memory freed between them):

1. ``floor``: bare calls at the run's shapes, no framework around them: ``generate`` eager and
   with the compiled decode step (tokens/s), the old quantities' forwards, and the update's
   forwards, backwards and fused AdamW steps of the policy and the critic (its MFU).
2. the recipe (``rlhf-torchrl ppo``) per variant: ``eager``, ``bf16x3`` (the LM head's fp32
   logits from three bf16 products, ``model.lm_head_matmul=bf16x3``), ``compiled`` generation
   (``generation.compile=true``), and ``fsdp2`` (torchrun with one process, the models sharded by
   FSDP2 over a mesh of one: its engine's cost on one GPU), seconds per phase (medians after the first iteration), tokens/s,
   the peak GPU memory (``memory/gpu_peak_gb``).
3. ``plan`` (``plan-VARIANT``): ``rlhf-torchrl plan`` of the eager (VARIANT's) run on this
   device, given the prompt set's longest and mean prompt: its seconds timed on one-layer
   copies there, and its memory; the table puts it beside the run it plans.

A device profile first (``rlhf-torchrl plan``'s :func:`~rlhf_torchrl.plan.measure_device`: peak
matmul FLOP/s and copy bandwidth), for MFU and for the plan's estimates. Every figure goes to ``--out`` as it comes, so a run cut short
keeps what it measured.

    rlhf-torchrl bench real_sizes --out outputs/real_sizes.json      # on a CUDA machine
    bash benchmarks/gpu.sh OUTDIR                                    # this plus the GPU tests

Without a CUDA GPU it prints that and exits 0 (``--device cpu --models tiny`` runs the same
steps on a 2-layer model, to check the script).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from rlhf_torchrl.benchmarks.common import add_out_arg, machine, make_parser, table, write_json
from rlhf_torchrl.plan import measure_device

CONFIGS = Path(__file__).parent / "model_configs"
#: --models: a config in model_configs/ (Qwen2.5's shapes), or ``tiny`` (2 layers, to check the script)
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "tiny")
#: verl's quickstart, step 0 of its log (seconds), and its settings
VERL = {"settings": {"model": "Qwen2.5-0.5B-Instruct", "train_batch_size": 256,
                     "max_prompt_length": 512, "max_response_length": 256,
                     "ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 4,
                     "log_prob_micro_batch_size_per_gpu": 8, "critic": "separate",
                     "response_length_mean": 239.1, "prompt_length_mean": 104.9},
        "seconds": {"generation": 21.47, "reference": 4.36, "values": 5.80,
                    "update_critic": 15.66, "update_actor": 20.31}}
VERL["seconds"]["old_quantities"] = VERL["seconds"]["reference"] + VERL["seconds"]["values"]
VERL["seconds"]["update"] = VERL["seconds"]["update_critic"] + VERL["seconds"]["update_actor"]
VARIANTS = {"eager": [],
            # the LM head's fp32 logits from three bf16 products (functional/matmul.py)
            "bf16x3": ["model.lm_head_matmul=bf16x3"],
            "compiled": ["generation.compile=true"],
            # torchrun with one process: FSDP2's engine (bf16 all-gathers, fp32 reductions) on one GPU
            "fsdp2": ["distributed.strategy=fsdp2"]}
PHASES = ("generation", "scoring", "old_quantities", "advantages", "update", "total")
_FILLER = ("apples", "trains", "school", "money", "hours", "friends", "baker", "cookies", "miles",
           "price", "weeks", "garden", "books", "toys", "water", "store", "dollars", "minutes")


def model_dir(name: str, folder: Path, tokenizer) -> Path:
    """``name``'s config with ``tokenizer``'s special ids, random weights (seed 0, bf16 on disk),
    and the tokenizer, saved in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if name == "tiny":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=len(tokenizer))
    else:
        config = AutoConfig.from_pretrained(CONFIGS / f"{name}.json")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompt_file(path: Path, tokenizer, n: int, seed: int = 0) -> dict:
    """``n`` GSM8K-shaped rows (``question``, ``answer``) whose prompts, with the gsm8k preset's
    instruction, are 68 to 185 tokens (verl's step 0: 68 to 175, mean 105); returns their
    lengths' statistics."""
    rng = random.Random(seed)
    suffix = " Let's think step by step and output the final answer after \"####\"."
    lengths = []
    with open(path, "w") as f:
        for _ in range(n):
            target = int(rng.triangular(68, 185, 90))
            words = []
            while len(tokenizer(" ".join(words) + suffix)["input_ids"]) < target:
                words.append(rng.choice(_FILLER))
            question = " ".join(words)
            lengths.append(len(tokenizer(question + suffix)["input_ids"]))
            f.write(json.dumps({"question": question, "answer": f"#### {rng.randint(1, 99)}"}) + "\n")
    return {"mean": statistics.mean(lengths), "min": min(lengths), "max": max(lengths)}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def floor(path: str, prompts: str, args) -> dict:
    """Bare calls at the run's shapes in bf16 autocast over fp32 weights: ``generate`` (eager, and
    with the compiled decode step), the old quantities' forwards and the update's forwards,
    backwards and fused AdamW steps of the policy and a separate critic; nothing around them."""
    import copy

    from transformers import AutoConfig

    from rlhf_torchrl.functional import log_probs_from_logits
    from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
    from rlhf_torchrl.modules.shapes import ModelShape, training_flops

    device = args.device
    tok = load_tokenizer(path)
    policy = load_causal_lm(path, tok).to(device)
    shape = ModelShape.counted(AutoConfig.from_pretrained(path))  # (a mixture: the experts used)
    suffix = " Let's think step by step and output the final answer after \"####\"."
    texts = [json.loads(x)["question"] + suffix for x in open(prompts)][:args.batch_size]
    R, out = args.response_length, {}
    amp = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)

    def generate(rows: int, compiled: bool) -> dict:
        enc = tok(texts[:rows], padding=True, return_tensors="pt", add_special_tokens=False).to(device)
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=R,
                      min_new_tokens=R, pad_token_id=tok.pad_token_id)
        if compiled:  # what generation.compile does: a static cache, the decode step compiled
            from rlhf_torchrl.collectors.backends.transformers import (
                StaticCaches,
                cache_kwarg,
                compile_config,
            )

            caches = StaticCaches(enc["input_ids"].shape[1] + R)
            kwargs["compile_config"] = compile_config()
        timings = []
        for _ in range(2):  # the first compiles (and warms the allocator)
            if compiled:
                kwargs[cache_kwarg(policy)] = caches(policy, rows, torch.bfloat16, policy.device)
            _sync(device)
            start = time.perf_counter()
            with torch.no_grad(), amp:
                policy.generate(**enc, **kwargs)
            _sync(device)
            timings.append(time.perf_counter() - start)
        return {"first_s": timings[0], "seconds": timings[1],
                "tokens_per_second": rows * R / timings[1]}

    for rows in args.generate_batches:
        for compiled in (False, True):
            name = f"generate_b{rows}_{'compiled' if compiled else 'eager'}"
            try:
                out[name] = generate(rows, compiled)
            except Exception as error:  # noqa: BLE001 - recorded; the other figures go on
                out[name] = {"error": f"{type(error).__name__}: {error}"}
            print(name, out[name], flush=True)
            _emit(args, out)
    # the update's shapes: rows of the prompt set's lengths plus the full response
    enc = tok(texts, add_special_tokens=False)
    lengths = [len(x) for x in enc["input_ids"]]
    rng = random.Random(0)
    critic_trunk = copy.deepcopy(policy.model)
    head = torch.nn.Linear(shape.hidden, 1).to(device)
    reference = copy.deepcopy(policy).requires_grad_(False)
    params = [*policy.parameters(), *critic_trunk.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=device == "cuda")
    mini = args.batch_size // args.minibatches

    def batches(rows_per_step):
        order = list(range(len(lengths)))
        rng.shuffle(order)
        for i in range(0, len(order), rows_per_step):
            rows = sorted(order[i:i + rows_per_step], key=lambda r: lengths[r])
            yield rows

    def micro(rows):  # micro-batches of at most micro_batch_tokens padded tokens
        group = []
        for r in rows:
            if group and (len(group) + 1) * (max(lengths[g] for g in group + [r]) + R) > args.micro_batch_tokens:
                yield group
                group = []
            group.append(r)
        if group:
            yield group

    def ids_of(rows):
        P = max(lengths[r] for r in rows)
        return torch.randint(0, len(tok), (len(rows), P + R), device=device), P

    flops = {"old_quantities": 0.0, "update": 0.0}

    def old_quantities():
        with torch.no_grad(), amp:
            for rows in batches(args.forward_batch_size):
                ids, P = ids_of(rows)
                for model in (policy, reference):  # old log-probs (recomputed in bf16), reference
                    logits = model(ids, logits_to_keep=R + 1).logits[:, :-1]
                    log_probs_from_logits(logits, ids[:, P:], 1.0)
                head(critic_trunk(ids).last_hidden_state[:, P - 1:-1].float())
                flops["old_quantities"] += (2 * shape.forward_flops(len(rows), P + R, R)
                                            + shape.forward_flops(len(rows), P + R, 0))

    def update():
        for rows in batches(mini):
            optimizer.zero_grad(set_to_none=True)
            for group in micro(rows):
                ids, P = ids_of(group)
                with amp:
                    logits = policy(ids, logits_to_keep=R + 1).logits[:, :-1]
                    log_probs = log_probs_from_logits(logits, ids[:, P:], 1.0)
                    values = head(critic_trunk(ids).last_hidden_state[:, P - 1:-1])
                (log_probs.sum() + values.float().sum()).backward()
                flops["update"] += (training_flops(shape, len(group), P + R, R)
                                    + training_flops(shape, len(group), P + R, 0))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

    for name, fn in (("old_quantities", old_quantities), ("update", update)):
        try:
            fn()  # warm-up
            flops[name] = 0.0
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            seconds = time.perf_counter() - start
            out[name] = {"seconds": seconds, "flops": flops[name],
                         "achieved_flops": flops[name] / seconds}
        except Exception as error:  # noqa: BLE001
            out[name] = {"error": f"{type(error).__name__}: {error}"}
        print(name, out[name], flush=True)
        _emit(args, out)
    if device == "cuda":
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["prompt_lengths"] = lengths
    return out


def _emit(args, payload: dict) -> None:
    """The floor process's figures so far, as JSON at ``--floor-out``."""
    if getattr(args, "floor_out", None):
        Path(args.floor_out).write_text(json.dumps(payload))


def run_floor(path: Path, prompts: Path, out: Path, args) -> dict:
    """:func:`floor` in a process of its own (the GPU's memory is freed after it); what it
    measured before an error or its deadline is kept, with the error."""
    cmd = [sys.executable, "-m", "rlhf_torchrl.benchmarks.real_sizes", "--floor", str(path),
           "--prompts", str(prompts), "--floor-out", str(out), *_forward_args(args)]
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, timeout=args.recipe_timeout)
        error = proc.stderr[-2000:] if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.recipe_timeout} s"
    figures = json.loads(out.read_text()) if out.exists() else {}
    return {**figures, **({"error": error} if error else {})}


def recipe_overrides(variant: str, path: Path, prompts: Path, out_dir: Path, args) -> list[str]:
    """The PPO command's overrides for ``variant`` at verl's quickstart settings."""
    return [
        "task=gsm8k", f"model.policy={path}", f"data.source={prompts}", "data.chat_template=plain",
        "data.check_prompts=all", "eval.every=0", "checkpoint.every=0", "logging.logger=null",
        "logging.save_model=false", "logging.progress_bar=false", f"device={args.device}",
        f"output_dir={out_dir}", "model.autocast=bfloat16",
        f"ppo.num_iterations={args.iterations}", f"ppo.batch_size={args.batch_size}",
        f"ppo.num_mini_batches={args.minibatches}", "ppo.num_ppo_epochs=1",
        f"ppo.micro_batch_tokens={args.micro_batch_tokens}",
        f"ppo.forward_batch_size={args.forward_batch_size}",
        f"generation.max_new_tokens={args.response_length}", "data.max_prompt_length=512",
        "optim.critic_warmup=0", *VARIANTS[variant], *args.overrides]


def planned(variant: str, path: Path, prompts: Path, lengths: dict, out_dir: Path, args) -> dict:
    """``rlhf-torchrl plan`` of the recipe's ``variant`` run, on this machine's device (its
    seconds timed on one-layer copies there), given the prompt set's longest and mean prompt:
    each phase's seconds and GiB, and the plan's peak."""
    cmd = [sys.executable, "-m", "rlhf_torchrl.cli", "plan", "--json",
           f"--prompt-tokens={lengths['max']}", f"--mean-prompt-tokens={lengths['mean']}",
           *recipe_overrides(variant, path, prompts, out_dir, args)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.recipe_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.recipe_timeout} s"}
    result = {"command": " ".join(cmd), "wall_s": time.perf_counter() - start}
    try:
        plan = json.loads(proc.stdout)
    except ValueError:
        return {**result, "error": (proc.stderr or proc.stdout)[-2000:]}
    return {**result, "times": plan["settings"].get("times"), "peak_gb": plan["peak_gb"],
            "peak_phase": plan["peak_phase"],
            "seconds": {p: ph.get("seconds") for p, ph in plan["phases"].items()},
            "memory_gb": {p: ph["memory_gb"] for p, ph in plan["phases"].items()}}


def recipe(name: str, variant: str, path: Path, prompts: Path, out_dir: Path, args) -> dict:
    """The PPO recipe at verl's quickstart settings on model ``path``: seconds per phase (medians
    after the first iteration), tokens/s and the peak GPU memory."""
    overrides = [*recipe_overrides(variant, path, prompts, out_dir, args),
                 f"hydra.run.dir={out_dir}"]
    launcher = [sys.executable]
    if variant == "fsdp2":
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [*launcher, "-m", "rlhf_torchrl.cli", "ppo", *overrides]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.recipe_timeout)
        error = proc.stderr[-2000:] if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.recipe_timeout} s"
    wall = time.perf_counter() - start
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in open(metrics)] if metrics.exists() else []
    result = {"command": " ".join(cmd), "wall_s": wall, "iterations": len(rows)}
    if error:
        result["error"] = error
    if rows:
        steady = rows[1:] or rows
        result.update({p: statistics.median(r[f"time/{p}"] for r in steady) for p in PHASES})
        result["first_iteration"] = {p: rows[0][f"time/{p}"] for p in PHASES}
        result["per_iteration"] = [{k: v for k, v in r.items() if k.startswith(("time/", "memory/"))}
                                   for r in rows]
        result["tokens_per_second"] = statistics.median(r["time/tokens_per_second"] for r in steady)
        for key in ("memory/gpu_peak_gb", "response/length_mean", "objective/kl"):
            if key in rows[-1]:
                result[key] = rows[-1][key]
    return result


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                        choices=MODELS, help="the architectures, in order")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="recipe variants per model: eager or compiled generation, fsdp2 "
                             "(torchrun with one process)")
    parser.add_argument("--iterations", type=int, default=2,
                        help="PPO iterations per run (the first, with any compilation, is "
                             "reported apart)")
    parser.add_argument("--batch-size", type=int, default=256, help="ppo.batch_size (verl: 256)")
    parser.add_argument("--minibatches", type=int, default=4, help="ppo.num_mini_batches (verl: 256/64)")
    parser.add_argument("--response-length", type=int, default=256, help="verl: 256")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192,
                        help="ppo.micro_batch_tokens (verl: 4 rows a micro-batch, ~1,400 tokens)")
    parser.add_argument("--forward-batch-size", type=int, default=64, help="ppo.forward_batch_size")
    parser.add_argument("--generate-batches", type=int, nargs="*", default=[128],
                        help="the floor's bare generate batch sizes (eager and compiled each)")
    parser.add_argument("--steps", nargs="*", default=None, metavar="MODEL:STEP",
                        help="run these in this order instead, each a model and 'floor', a "
                             "variant, or 'plan' ('plan-VARIANT'): rlhf-torchrl plan of the "
                             "eager run (of VARIANT's) on this device, e.g. "
                             "qwen2.5-1.5b:eager qwen2.5-0.5b:floor qwen2.5-1.5b:plan")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--recipe-timeout", type=float, default=600,
                        help="seconds one recipe run may take")
    parser.add_argument("--floor", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--floor-out", default=None, help=argparse.SUPPRESS)
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[], help="more recipe overrides")
    args = parser.parse_args(argv)
    steps = ("floor", "plan", *VARIANTS, *(f"plan-{v}" for v in VARIANTS))
    for step in args.steps or ():
        model, _, what = step.partition(":")
        if model not in MODELS or what not in steps:
            parser.error(f"--steps {step!r}: give MODEL:STEP, MODEL one of {', '.join(MODELS)} "
                         f"and STEP one of {', '.join(steps)}")
    if args.floor is not None:  # the floor's own process
        return floor(args.floor, args.prompts, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("No CUDA GPU is visible: the real sizes run on one (rlhf-torchrl bench real_sizes "
              "--device cpu --models tiny checks the script here).")
        return {"skipped": "no CUDA GPU"}
    from rlhf_torchrl.modules import load_tokenizer
    from rlhf_torchrl.modules.models import smollm2_path

    result = {"benchmark": "real_sizes", "args": vars(args), "machine": machine(), "verl": VERL,
              "profile": asdict(measure_device(torch.device(args.device))), "models": {}}
    print("device profile:", result["profile"], flush=True)
    save = lambda: write_json(args.out, result)  # noqa: E731
    save()
    tokenizer = load_tokenizer(smollm2_path())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl"
        result["prompt_lengths"] = prompt_file(prompts, tokenizer, args.batch_size * args.iterations)
        paths = {}
        # each model's floor and first variant, then the other variants: a run cut short at its
        # deadline has every model's baseline
        steps = [(name, variant) for name in args.models for variant in ("floor", args.variants[0])]
        steps += [(name, v) for v in args.variants[1:] for name in args.models]
        if args.steps:  # the order given
            steps = [tuple(step.split(":", 1)) for step in args.steps]
        for name, variant in steps:
            entry = result["models"].setdefault(name, {})
            # a plan of a packaged shape reads its config.json alone: no weights to make
            shape_only = variant.startswith("plan") and (CONFIGS / f"{name}.json").exists()
            if name not in paths and not shape_only:
                paths[name] = model_dir(name, tmp / name, tokenizer)
            if variant == "floor":
                entry["floor"] = run_floor(paths[name], prompts, tmp / f"{name}.floor.json", args)
                print(name, "floor:", {k: v for k, v in entry["floor"].items()
                                       if k != "prompt_lengths"}, flush=True)
            elif variant.startswith("plan"):  # plan (the eager run's) or plan-VARIANT
                entry[variant] = planned(variant.partition("-")[2] or "eager",
                                         Path(name) if shape_only else paths[name],
                                         prompts, result["prompt_lengths"],
                                         tmp / f"{name}-{variant}", args)
                print(name, variant, {k: v for k, v in entry[variant].items() if k != "command"},
                      flush=True)
            else:
                entry[variant] = recipe(name, variant, paths[name], prompts,
                                        tmp / f"{name}-{variant}", args)
                print(name, variant, {k: v for k, v in entry[variant].items() if k != "command"},
                      flush=True)
            save()
        for name in result["models"]:
            _print_table(name, result["models"][name])
    if args.out is not None:
        from rlhf_torchrl.benchmarks.plots import PLOTS, plot_path, save

        save(PLOTS["real_sizes"], result, plot_path(args.out))
    return result


def _forward_args(args) -> list[str]:
    return ["--batch-size", str(args.batch_size), "--minibatches", str(args.minibatches),
            "--response-length", str(args.response_length),
            "--micro-batch-tokens", str(args.micro_batch_tokens),
            "--forward-batch-size", str(args.forward_batch_size), "--device", args.device,
            "--generate-batches", *map(str, args.generate_batches)]


def _print_table(name: str, entry: dict) -> None:
    rows = []
    for variant in VARIANTS:
        r = entry.get(variant)
        if r and "total" in r:
            rows.append([variant, *(f"{r[p]:.2f}" for p in PHASES), f"{r['tokens_per_second']:.0f}",
                         f"{r.get('memory/gpu_peak_gb', float('nan')):.1f}"])
    for key, r in entry.items():  # the plan's estimates, and against the run they plan
        if not key.startswith("plan") or not r.get("seconds"):
            continue
        planned_run = key.partition("-")[2] or "eager"
        s = r["seconds"]
        rows.append([f"plan of {planned_run}", f"{s['generation']:.2f}", "-",
                     f"{s['old_quantities']:.2f}", "-", f"{s['update']:.2f}", "-", "-",
                     f"{r['peak_gb']:.1f}"])
        measured = entry.get(planned_run) or {}
        if "total" in measured:
            rows.append(["  plan / measured", *(f"{s[p] / measured[p]:.2f}" if p in s else "-"
                                                for p in PHASES), "-",
                         f"{r['peak_gb'] / measured.get('memory/gpu_peak_gb', float('nan')):.2f}"])
    rows.append(["verl (published)", f"{VERL['seconds']['generation']:.2f}", "-",
                 f"{VERL['seconds']['old_quantities']:.2f}", "-", f"{VERL['seconds']['update']:.2f}",
                 "-", "-", "-"])
    print(f"\n{name}, median of iterations 2.. (s)")
    print(table(rows, ["run", *PHASES, "tokens/s", "peak GPU (GB)"]))


if __name__ == "__main__":
    try:
        main()
    except Exception:  # the floor process: its traceback to stderr, for the parent's JSON
        traceback.print_exc()
        sys.exit(1)
