"""A soak: the real ``rlhf-torchrl ppo`` command for ``--iterations`` iterations, with an
evaluation and a checkpoint every ``--every``, SIGKILLed once midway and started again (the same
command: ``resume=auto`` continues from the newest checkpoint); are seconds per iteration and the
resident set flat?

The run is a process of its own (its own session, so the kill takes its whole group). A thread of
this benchmark watches it: every ``--poll`` seconds it reads the rows ``metrics.jsonl`` gained and
stamps each with the wall clock, the resident set (``VmRSS``, summed over the run's process
tree), its peak (``VmHWM``) and the tree's CPU seconds (``/proc/<pid>/stat``); every
``--sample-every`` seconds it also records those and the 1-minute load average between rows (an
evaluation's peak, the start-up), and times a fixed probe (:func:`probe`: a loop of the
interpreter and a hash of 2 MB, a few milliseconds, in the watcher's own thread on the core the
single-threaded run leaves free): the machine's own speed at that moment. The kill comes once
the row of ``--kill-at`` is read (default: half-way between two checkpoints past the middle, so
that the resumed run redoes the iterations after the newest checkpoint). At the end the whole
run's ``metrics.jsonl`` must hold every iteration once, ``0 .. --iterations - 1``.

Figures, per block of ``--every`` iterations and per segment (before and after the kill): the
median ``time/total`` of the iterations without an evaluation or a checkpoint (the library's own
clock), wall-clock and CPU seconds per iteration (the block's span over its iterations: logging,
evaluations, checkpoints included), the median resident set, its peak in the block, the mean load
average and the probe's median milliseconds (context: the machine's speed, not judged); the
evaluation's and the checkpoint's seconds apart. The drift of each: the median of the
last ``--windows`` blocks against the first ``--windows`` after the segment's first block (its
warm-up), in %, for each segment, and for the run (the first segment's first blocks against the
second's last). Flat: every drift within ``--tolerance``. ``--no-kill`` runs the same command
once, uninterrupted: the arm to compare a killed and resumed soak with, at the same iterations.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench soak --out runs/soak.json

``--model word-task`` (the default) is the tests' tiny Llama (``tests/conftest.py``'s
``tiny_llama_dir``: 2 layers, 32 wide, 4 query and 2 key-value heads, tied embeddings, seeded
random weights) with SmolLM2's tokenizer (its 49k-token LM head is most of the work), built into
the run's folder; the task is the default one (``task=sentiment``: review openings, VADER's
reward) at the tests' tiny sizes: 8 responses of at most 8 tokens an iteration in 2 minibatches,
16 held-out prompts, fp32, ``threads=--threads`` (1), ``checkpoint.keep=2`` (:data:`SETTINGS`).
Overrides after the options go to the command, e.g. ``ppo.batch_size=16``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from rlhf_torchrl.benchmarks.common import (
    add_out_arg,
    add_timeout_arg,
    finish,
    kill_tree,
    machine,
    make_parser,
    process_tree,
    recipe_model,
    table,
)

#: the soak's recipe settings beside --iterations, --every, --threads and the model
SETTINGS = ["ppo.batch_size=8", "ppo.num_mini_batches=2", "ppo.forward_batch_size=8",
            "generation.max_new_tokens=8", "eval.num_prompts=16", "checkpoint.keep=2",
            "model.autocast=null",  # fp32 whatever the CPU (auto picks bf16 where it is native)
            "logging.progress_bar=false"]
#: the per-block figures whose drift is reported, and the label of each
FIGURES = {"seconds": "s/it (median time/total)", "wall_seconds": "wall s/it",
           "cpu_seconds": "CPU s/it", "rss_mb": "RSS MB (median)", "peak_rss_mb": "peak RSS MB"}
#: figures whose drift is reported beside, never judged: the machine's, not the run's
CONTEXT = ("load", "probe_ms")


def word_task_model(folder: str) -> str:
    """The tests' tiny Llama (``tests/conftest.py``, ``tiny_llama_dir``) with SmolLM2's tokenizer,
    saved into ``folder``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_torchrl.modules import load_tokenizer
    from rlhf_torchrl.modules.models import SMOLLM2

    tokenizer = load_tokenizer(SMOLLM2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_stats(pid: int) -> dict | None:
    """The process tree's resident set, the sum of its processes' peaks (MB: at least the tree's
    peak) and its CPU seconds (user + system); None once the process is gone."""
    rss = hwm = cpu = 0.0
    found = False
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{p}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()  # past the command's name
        except OSError:
            continue
        if "VmRSS" not in fields:  # a zombie: the run itself exiting ends the sampling
            if p == pid:
                return None
            continue
        found = True
        rss += int(fields["VmRSS"].split()[0]) / 1024
        hwm += int(fields["VmHWM"].split()[0]) / 1024
        cpu += (int(stat[11]) + int(stat[12])) / _TICK  # utime, stime
    return {"rss_mb": rss, "hwm_mb": hwm, "cpu_s": cpu} if found else None


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def probe() -> float:
    """Milliseconds of a fixed piece of work: 40,000 steps of the interpreter and SHA-256 over
    2 MB (about 4 ms on an idle core here). Its changes over a soak are the machine's."""
    start = time.perf_counter()
    total = 0
    for i in range(40_000):
        total += i * i
    hashlib.sha256(bytes(2_000_000)).digest()
    return 1e3 * (time.perf_counter() - start)


class Watcher(threading.Thread):
    """Stamps each new row of ``metrics.jsonl`` (iterations ``>= first`` not yet seen) with the
    clock and the run's :func:`tree_stats`, and samples them every ``sample_every`` seconds.

    A resumed run first rewrites ``metrics.jsonl`` without the rows past its checkpoint (a new
    file): while the file is still ``stale_inode`` (the killed run's, holding such rows), nothing
    is read."""

    def __init__(self, pid: int, path: str, first: int, poll: float, sample_every: float,
                 stale_inode: int | None = None, kill_at: int | None = None):
        super().__init__(daemon=True)
        self.pid, self.path, self.first, self.poll = pid, path, first, poll
        self.sample_every, self.stale_inode, self.kill_at = sample_every, stale_inode, kill_at
        self.rows: list[dict] = []
        self.samples: list[dict] = []
        self.killed_after: int | None = None  # the last row read before the kill
        self.stop = threading.Event()
        self._inode = self._offset = None
        self._buffer = ""
        self._seen: set[int] = set()

    def _new_rows(self) -> list[dict]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino == self.stale_inode:
            return []
        if st.st_ino != self._inode or st.st_size < (self._offset or 0):  # a new file
            self._inode, self._offset, self._buffer = st.st_ino, 0, ""
        if st.st_size == self._offset:
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        lines = (self._buffer + text).split("\n")
        self._buffer = lines.pop()  # a line not yet complete
        out = []
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            i = row["iteration"]
            if i >= self.first and i not in self._seen:
                self._seen.add(i)
                out.append(row)
        return out

    def run(self) -> None:
        start = time.monotonic()
        next_sample = start
        while not self.stop.is_set():
            now = time.monotonic()
            rows = self._new_rows()
            if rows or now >= next_sample:
                stats = tree_stats(self.pid)
                if stats is None:
                    if rows:  # written just before the process ended
                        stats = self.samples[-1] if self.samples else {}
                    else:
                        self.stop.wait(self.poll)
                        continue
                for row in rows:
                    self.rows.append({
                        "iteration": row["iteration"], "t": now - start,
                        "seconds": row.get("time/total"), "eval_s": row.get("time/eval"),
                        "checkpoint_s": row.get("time/checkpoint"),
                        "response_length": row.get("val/sequence_lengths"),
                        "rss_mb": stats.get("rss_mb"), "hwm_mb": stats.get("hwm_mb"),
                        "cpu_s": stats.get("cpu_s")})
                if now >= next_sample:
                    last = self.rows[-1]["iteration"] if self.rows else None
                    self.samples.append({"t": now - start, "iteration": last, "load": _load(),
                                         "probe_ms": probe(), **stats})
                    next_sample = now + self.sample_every
                if self.kill_at is not None and rows and rows[-1]["iteration"] >= self.kill_at:
                    os.killpg(self.pid, signal.SIGKILL)  # the run's whole group (its own session)
                    self.killed_after = rows[-1]["iteration"]
                    self.kill_at = None
            self.stop.wait(self.poll)


def _newest_checkpoint(run_dir: str) -> int:
    """The iterations the newest checkpoint holds (0 if none): the resumed run's first."""
    folder = os.path.join(run_dir, "checkpoints")
    done = [int(n.split("_")[1]) for n in os.listdir(folder) if n.startswith("iter_")
            and n.split("_")[1].isdigit()] if os.path.isdir(folder) else []
    return max(done, default=0)


def run_segment(command: list[str], run_dir: str, log_path: str, args,
                kill_at: int | None) -> dict:
    """One start of the command, watched (:class:`Watcher`); killed once the row of ``kill_at``
    is read (None: to its end)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    first = _newest_checkpoint(run_dir)
    stale = os.stat(metrics).st_ino if os.path.exists(metrics) else None
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        watcher = Watcher(proc.pid, metrics, first, args.poll, args.sample_every, stale, kill_at)
        watcher.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # the run and whatever it started
            rc = proc.wait()
            watcher.stop.set()
            watcher.join()
            with open(log_path) as f:
                raise RuntimeError(f"the run took more than {args.timeout:g} s (--timeout); "
                                   f"killed. Its log ends:\n{f.read()[-3000:]}") from None
        except BaseException:  # Ctrl-C: the run's session does not see it
            kill_tree(proc.pid)
            raise
        watcher.stop.set()
        watcher.join()
    seconds = time.monotonic() - started
    if kill_at is None and rc != 0:
        with open(log_path) as f:
            raise RuntimeError(f"the run failed (exit {rc}):\n{f.read()[-3000:]}")
    if kill_at is not None and watcher.killed_after is None:
        raise RuntimeError(f"the run ended (exit {rc}) before iteration {kill_at}: raise "
                           f"--iterations or lower --kill-at (its log: {log_path})")
    rows = watcher.rows
    last_on_disk = None
    if watcher.killed_after is not None:  # the rows the killed run had written
        with open(metrics, encoding="utf-8") as f:
            last_on_disk = max(json.loads(line)["iteration"] for line in f if line.endswith("\n"))
    return {"first_iteration": first, "exit_code": rc, "killed_after": watcher.killed_after,
            "last_row_written": last_on_disk,
            "seconds": seconds, "startup_s": rows[0]["t"] if rows else None,
            "peak_rss_mb": max((s["hwm_mb"] for s in watcher.samples + rows
                                if s.get("hwm_mb") is not None), default=None),
            "rows": rows, "samples": watcher.samples}


def blocks(segment: dict, every: int) -> list[dict]:
    """Per block of ``every`` iterations whole in the segment: its figures (see the module's
    docstring)."""
    rows, samples = segment["rows"], segment["samples"]
    by_block: dict[int, list[dict]] = {}
    for r in rows:
        by_block.setdefault(r["iteration"] // every, []).append(r)
    out, previous_end = [], None
    for b in sorted(by_block):
        mine = sorted(by_block[b], key=lambda r: r["iteration"])
        if len(mine) != every:  # cut by the kill, or the segment began inside it
            previous_end = mine[-1]
            continue
        plain = [r for r in mine if r["eval_s"] is None and r["checkpoint_s"] is None]
        # the span from the previous block's last row (its end) where there is one
        start = previous_end if previous_end and previous_end["iteration"] == b * every - 1 else mine[0]
        n = mine[-1]["iteration"] - start["iteration"]
        in_block = [s for s in samples if s["iteration"] is not None
                    and b * every <= s["iteration"] < (b + 1) * every]
        probes = [s["probe_ms"] for s in in_block if s.get("probe_ms") is not None]
        seconds = statistics.median(r["seconds"] for r in plain) if plain else None
        probe_ms = statistics.median(probes) if probes else None
        out.append({
            "block": b, "iterations": [b * every, (b + 1) * every - 1],
            "seconds": seconds,
            "probe_ms": probe_ms,
            "wall_seconds": (mine[-1]["t"] - start["t"]) / n,
            "cpu_seconds": (mine[-1]["cpu_s"] - start["cpu_s"]) / n,
            "rss_mb": statistics.median(r["rss_mb"] for r in mine),
            "peak_rss_mb": max(r["rss_mb"] for r in mine + in_block),
            "hwm_mb": mine[-1]["hwm_mb"],
            "load": statistics.fmean(s["load"] for s in in_block) if in_block else None,
            "eval_s": sum(r["eval_s"] or 0.0 for r in mine),
            "checkpoint_s": sum(r["checkpoint_s"] or 0.0 for r in mine),
            "response_length": statistics.fmean([r["response_length"] for r in mine
                                                 if r["response_length"] is not None] or [0.0]),
        })
        previous_end = mine[-1]
    return out


def drift(first: list[dict], last: list[dict]) -> dict:
    """Each figure's median over the ``last`` blocks against the ``first`` blocks, in %."""
    out = {}
    for name in (*FIGURES, *CONTEXT):
        a = [b[name] for b in first if b[name] is not None]
        z = [b[name] for b in last if b[name] is not None]
        if a and z:
            out[name] = {"first": statistics.median(a), "last": statistics.median(z),
                         "percent": 100 * (statistics.median(z) / statistics.median(a) - 1)}
    return out


def drifts(segments: list[list[dict]], windows: int) -> dict:
    """Per segment (its first block left out: the warm-up) and for the run: :func:`drift` of the
    last ``windows`` blocks against the first ``windows``; None where too few blocks."""
    out = {}
    steady = [blocks_[1:] for blocks_ in segments]
    for k, mine in enumerate(steady):
        out[f"segment_{k + 1}"] = (drift(mine[:windows], mine[-windows:])
                                   if len(mine) >= 2 * windows else None)
    if steady[0][:windows] and steady[-1][-windows:] and len(steady) > 1:
        out["run"] = drift(steady[0][:windows], steady[-1][-windows:])
    return out


def _verdict(found: dict, tolerance: float) -> dict:
    """Per figure: flat (every drift reported within ``tolerance`` %) or not."""
    out = {}
    for name in FIGURES:
        values = [d[name]["percent"] for d in found.values() if d and name in d]
        out[name] = ("flat" if values and all(abs(v) <= tolerance for v in values) else
                     "not flat" if values else "too few blocks")
    return out


def _columns(rows: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    """``rows`` as one list per key, rounded (a smaller JSON)."""
    return {k: [round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for r in rows]
            for k in keys}


def _compact(segment: dict) -> dict:
    """A segment for the JSON: its rows and samples as columns, an evaluation's and a
    checkpoint's seconds by iteration."""
    rows = segment["rows"]
    return {**{k: v for k, v in segment.items() if k not in ("rows", "samples")},
            "rows": _columns(rows, ("iteration", "t", "seconds", "rss_mb", "cpu_s")),
            "eval_s": {r["iteration"]: round(r["eval_s"], 4) for r in rows if r["eval_s"]},
            "checkpoint_s": {r["iteration"]: round(r["checkpoint_s"], 4) for r in rows
                             if r["checkpoint_s"]},
            "samples": _columns(segment["samples"], ("t", "iteration", "load", "probe_ms",
                                                      "rss_mb", "hwm_mb", "cpu_s"))}


def check_metrics(run_dir: str, iterations: int) -> dict:
    """The run's ``metrics.jsonl``: its rows, and whether they are iterations 0..N-1 once each."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        seen = [json.loads(line)["iteration"] for line in f if line.strip()]
    return {"rows": len(seen), "each_once": seen == list(range(iterations))}


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="word-task",
                        help="word-task (the tests' tiny Llama, SmolLM2's tokenizer), a benchmark "
                             "preset (tiny-llama ...) or a local model directory or hub id")
    parser.add_argument("--iterations", type=int, default=3000, help="ppo.num_iterations")
    parser.add_argument("--every", type=int, default=100,
                        help="eval.every and checkpoint.every, and the block of the figures")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="SIGKILL the run once this iteration's row is read (from 0; default: "
                             "the middle of the block past half-way, not a checkpoint)")
    parser.add_argument("--no-kill", action="store_true",
                        help="run the command once, uninterrupted (the arm to compare with)")
    parser.add_argument("--windows", type=int, default=3,
                        help="blocks at each end of a segment whose medians are compared")
    parser.add_argument("--tolerance", type=float, default=5.0, help="flat: drifts within this %%")
    parser.add_argument("--threads", type=int, default=1, help="the run's threads=")
    parser.add_argument("--poll", type=float, default=0.05,
                        help="seconds between reads of metrics.jsonl")
    parser.add_argument("--sample-every", type=float, default=1.0,
                        help="seconds between samples of the resident set and the load")
    parser.add_argument("--dir", default=None,
                        help="keep the run here (a new folder inside; default: a temporary one, "
                             "removed at the end)")
    add_timeout_arg(parser, 4 * 3600)
    add_out_arg(parser)
    parser.add_argument("overrides", nargs="*", default=[], help="more recipe overrides")
    args = parser.parse_args(argv)
    kill_at = args.kill_at
    if kill_at is None:
        kill_at = (args.iterations // 2 // args.every) * args.every + args.every // 2 - 1
    if not args.no_kill and not 0 < kill_at < args.iterations - 1:
        parser.error(f"--kill-at {kill_at} is not inside the run (0..{args.iterations - 1})")

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    holder = tempfile.TemporaryDirectory() if args.dir is None else None
    root = holder.name if holder else tempfile.mkdtemp(prefix="soak_", dir=args.dir)
    try:
        model_dir = os.path.join(root, "model")
        model = ([f"model.policy={word_task_model(model_dir)}"] if args.model == "word-task"
                 else recipe_model(args.model, model_dir))
        run_dir = os.path.join(root, "run")
        command = [sys.executable, "-m", "rlhf_torchrl.cli", "ppo", *model, *SETTINGS,
                   f"threads={args.threads}", f"ppo.num_iterations={args.iterations}",
                   f"eval.every={args.every}", f"checkpoint.every={args.every}",
                   f"output_dir={run_dir}", f"hydra.run.dir={run_dir}", *args.overrides]
        if args.no_kill:
            kill_at = None
        print(f"soak: {args.iterations} iterations, "
              f"{'uninterrupted' if kill_at is None else f'killed after {kill_at}'}, in {root}",
              file=sys.stderr, flush=True)
        segments = [run_segment(command, run_dir, os.path.join(root, "segment_1.log"), args,
                                kill_at)]
        if kill_at is not None:
            print(f"killed after iteration {segments[0]['killed_after']}; resuming from "
                  f"{_newest_checkpoint(run_dir)}", file=sys.stderr, flush=True)
            segments.append(run_segment(command, run_dir, os.path.join(root, "segment_2.log"),
                                        args, None))
        check = check_metrics(run_dir, args.iterations)
    finally:
        if holder:
            holder.cleanup()

    per_segment = [blocks(s, args.every) for s in segments]
    found = drifts(per_segment, args.windows)
    verdict = _verdict(found, args.tolerance)
    header = ["segment", "block", *FIGURES.values(), "load", "probe ms", "eval s", "ckpt s"]
    digits = {"seconds": 4, "wall_seconds": 4, "cpu_seconds": 4, "load": 2, "probe_ms": 2}
    lines = [[k + 1, f"{b['iterations'][0]}-{b['iterations'][1]}",
              *("-" if b.get(f) is None else f"{b[f]:.{digits.get(f, 0)}f}"
                for f in (*FIGURES, *CONTEXT)),
              f"{b['eval_s']:.2f}", f"{b['checkpoint_s']:.2f}"]
             for k, mine in enumerate(per_segment) for b in mine]
    print(table(lines, header))
    print(f"\ndrift, the last {args.windows} blocks against the first {args.windows} after "
          f"warm-up (%):")
    for where, d in found.items():
        text = "too few blocks" if not d else ", ".join(
            f"{FIGURES.get(n, n)} {v['percent']:+.1f}" for n, v in d.items())
        print(f"  {where}: {text}")
    print("verdict: " + ", ".join(f"{FIGURES[n]} {v}" for n, v in verdict.items())
          + f" (within {args.tolerance:g}%)")
    print(f"metrics.jsonl: {check['rows']} rows, iterations 0..{args.iterations - 1} once each: "
          f"{check['each_once']}")
    payload = {"args": vars(args), "machine": {**machine(), "threads": args.threads},
               "command": " ".join(command[1:]), "kill_at": kill_at, "metrics": check,
               "segments": [_compact(s) for s in segments],
               "blocks": per_segment, "drift": found, "verdict": verdict}
    return finish(args, payload, "soak")


if __name__ == "__main__":
    main()
