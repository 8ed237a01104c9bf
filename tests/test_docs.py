"""The documentation's commands and Python blocks run as a user copies them, at tiny settings
(tests/doc_snippets.py: which blocks, and the markers that say how).

- ``check`` blocks (most ``bash`` blocks: the recipe's command lines): each command is composed
  and put through every check a run makes before it loads weights, in a folder holding the files
  the docs name (prompts.jsonl, my_rewards.py, my_rm/, ...), with tiny models for hub models;
- ``run`` blocks: ``python`` blocks are executed; ``bash`` ones run each command in a subprocess
  with tiny settings (one at a time, on one worker);
- ``skip`` blocks say why (GPU, several machines, the network, hours of training).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import ROOT, all_blocks, commands, entry_point
from omegaconf import OmegaConf, open_dict

BLOCKS = all_blocks()
#: the settings a documented command runs with here, after its own
TINY = ["ppo.num_iterations=1", "ppo.batch_size=4", "ppo.num_mini_batches=1",
        "ppo.forward_batch_size=4", "generation.max_new_tokens=4", "logging.progress_bar=false",
        "eval.num_prompts=4", "optim.critic_warmup=0", "model.autocast=null", "threads=1",
        "checkpoint.every=0", "data.check_prompts=all"]
#: hub datasets the docs name -> the local file of the same columns the docs folder holds
HUB_DATA = {"openai/gsm8k": "gsm8k.jsonl", "Anthropic/hh-rlhf": "dialogues.jsonl",
            "vwxyzjn/summarize_from_feedback_tldr_3_filtered": "posts.jsonl"}
#: the placeholders the docs write for a run directory
RUN_DIRS = ("outputs/ppo/sentiment/<run>", "outputs/ppo/gsm8k/<run>", "outputs/ppo/<run>")


def _rows(n: int = 256) -> list[dict]:
    topics = ["rain", "tea", "maps", "owls", "jazz", "bread", "tides", "clocks"]
    return [{"prompt": f"Write one line about {topics[i % 8]} number {i}.", "answer": str(i % 10)}
            for i in range(n)]


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory, tiny_llama_dir, tokenizer):
    """A folder holding every file the docs' commands name, as a user would have them."""
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    d = tmp_path_factory.mktemp("docs_user")
    rows = _rows()

    def jsonl(name, records):
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    jsonl("prompts.jsonl", rows)
    (d / "prompts.json").write_text(json.dumps(rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(d / "train.parquet"))
    (d / "data").mkdir()
    for i in range(2):
        table.shard(2, i).to_parquet(str(d / "data" / f"train-{i:05d}-of-00002.parquet"))
    table.to_csv(str(d / "prompts.csv"), index=False)
    table.to_csv(str(d / "prompts.tsv"), index=False, sep="\t")
    datasets.DatasetDict({"train": table}).save_to_disk(str(d / "saved_prompts"))
    gsm = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
           for i in range(256)]
    jsonl("gsm8k.jsonl", gsm)
    jsonl("problems.jsonl", gsm)
    jsonl("chats.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    jsonl("chat.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    table.to_parquet(str(d / "math.parquet"))
    jsonl("posts.jsonl", [{"subreddit": "tea", "title": f"Post {i}", "post": r["prompt"]}
                          for i, r in enumerate(rows)])
    jsonl("dialogues.jsonl", [{"chosen": f"\n\nHuman: {r['prompt']}\n\nAssistant: Fine."}
                              for r in rows])
    jsonl("pairs.jsonl", [{"prompt": r["prompt"], "chosen": " Lovely.", "rejected": " Awful."}
                          for r in rows])
    for block in BLOCKS:  # the files the docs show (my_rewards.py, my_tools.py) ...
        if block.save:
            (d / block.save).write_text(block.text + "\n")
    cwd = os.getcwd()
    os.chdir(d)
    try:  # ... and the ones their code writes (my_prompts.jsonl)
        for block in BLOCKS:
            if block.setup:
                exec(compile(block.text, block.id, "exec"), {"__name__": "__docs__"})  # noqa: S102
    finally:
        os.chdir(cwd)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    rm.save_pretrained(d / "my_rm")
    tokenizer.save_pretrained(d / "my_rm")
    shutil.copytree(tiny_llama_dir, d / "my_lm")
    return d


def _tiny_models(cfg, d: Path, tiny_llama_dir: str) -> None:
    """Hub models and hub datasets in ``cfg`` -> the tiny ones of the docs folder (offline)."""
    def local(value) -> bool:
        return value is None or Path(str(value)).expanduser().exists()

    with open_dict(cfg):
        for key, tiny in (("model.policy", tiny_llama_dir), ("model.reference", tiny_llama_dir),
                          ("reward.model", str(d / "my_rm")),
                          ("value_model.name_or_path", tiny_llama_dir)):
            if OmegaConf.select(cfg, key, default=None) is not None and not local(OmegaConf.select(cfg, key)):
                OmegaConf.update(cfg, key, tiny)
        source = OmegaConf.select(cfg, "data.source", default=None)
        if source in HUB_DATA:
            cfg.data.source, cfg.data.config = str(d / HUB_DATA[source]), None


def _words(words: list[str], run_dir: str | None) -> list[str]:
    out = []
    for w in words:
        for placeholder in RUN_DIRS:
            if placeholder in w:
                assert run_dir, "a <run> placeholder needs the tiny run"
                w = w.replace(placeholder, run_dir)
        out.append(w)
    return out


def _check(name: str, args: list[str], d: Path, tiny_llama_dir: str) -> None:
    """Every check ``rlhf-torchrl <name> args`` makes before it loads weights."""
    from rlhf_torchrl.config import checks, components, compose, inputs, model_checks

    if name == "report":
        assert (Path(args[0]) / "metrics.jsonl").is_file(), args
        return
    config = "reward_model" if name == "reward-model" else "ppo"
    given = any(a.startswith("output_dir=") for a in args)
    cfg = compose([*args, *([] if given else [f"output_dir={d / 'outputs' / 'check'}"])], config)
    if name == "reward-model":
        with open_dict(cfg):
            if cfg.data.source in HUB_DATA or "/" in cfg.data.source and not Path(cfg.data.source).exists():
                cfg.data.source = str(d / "pairs.jsonl")
        assert cfg.data.source == "polarity" or Path(cfg.data.source).exists(), cfg.data.source
        return
    _tiny_models(cfg, d, tiny_llama_dir)
    checks.check_config(cfg)
    model_checks.check_models(cfg)
    components.make_reward_functions(cfg)
    components.make_tools(cfg)
    tokenizer = components.make_tokenizer(cfg)
    prompts = inputs.make_prompts(cfg, tokenizer)
    model_checks.check_sequence_length(cfg, prompts, tokenizer)


def _needs_run(block) -> bool:
    return any(p in block.text for p in RUN_DIRS)


@pytest.fixture(scope="module")
def finished_run(docs_dir, tiny_llama_dir):
    """A tiny finished run in the docs folder, for the docs' ``outputs/ppo/<run>``."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import ppo

    from rlhf_torchrl.config import compose

    out = docs_dir / "outputs" / "ppo" / "sentiment" / "run"
    ppo.train(compose([f"output_dir={out}", f"model.policy={tiny_llama_dir}", *TINY,
                       "eval.every=1", "data.limit=16", "reuse_freed_memory=false",
                       "checkpoint.every=1"]))
    return str(out.relative_to(docs_dir))


def test_every_block_is_run_checked_or_skipped_with_a_reason():
    """A ``bash`` block that ``check`` cannot take (a pip install, a benchmark, torchrun) says
    ``run`` or ``skip``; every block is found (the runner reads the pages it should)."""
    assert len(BLOCKS) > 40
    for block in BLOCKS:
        if block.lang == "bash" and block.mode == "check":
            for words in commands(block.text):
                name, _, _ = entry_point(words)
                assert name is not None, (
                    f"{block.id}: `{' '.join(words)}` is not a command the docs test can check: "
                    "mark the block <!-- docs-test: run --> or <!-- docs-test: skip REASON -->")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash" and b.mode == "check"],
                         ids=lambda b: b.id)
def test_documented_command_passes_the_checks(block, docs_dir, tiny_llama_dir, request, monkeypatch):
    monkeypatch.chdir(docs_dir)
    run_dir = request.getfixturevalue("finished_run") if _needs_run(block) else None
    for words in commands(block.text):
        name, args, env = entry_point(_words(words, run_dir))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
            if key == "PYTHONPATH":  # what the command's own process would import from
                for folder in value.split(os.pathsep):
                    monkeypatch.syspath_prepend(os.path.abspath(folder))
        _check(name, [*args, *block.overrides], docs_dir, tiny_llama_dir)


def _run_command(words: list[str], block, d: Path, tiny_llama_dir: str):
    name, args, env = entry_point(words)
    if name is None:
        cmd = words
    else:
        cmd = [sys.executable, "-m", "rlhf_torchrl.cli", name, *args]
        if name in ("ppo", "evaluate"):  # tiny where the command says nothing, the marker's last
            given = {a.split("=", 1)[0].lstrip("+") for a in args if "=" in a}
            cmd += [f"model.policy={tiny_llama_dir}",
                    *(t for t in TINY if t.split("=", 1)[0] not in given), *block.overrides]
        elif name == "reward-model":
            cmd += ["train.epochs=1", "data.limit=16", *block.overrides]
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=d, env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.id}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.xdist_group("docs_commands")  # one worker: the finished run they read, built once
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash" and b.mode == "run"],
                         ids=lambda b: b.id)
def test_documented_command_runs(block, docs_dir, tiny_llama_dir, request):
    run_dir = request.getfixturevalue("finished_run") if _needs_run(block) else None
    for words in commands(block.text):
        _run_command(_words(words, run_dir), block, docs_dir, tiny_llama_dir)


def _python_chains() -> list[list]:
    """The ``python`` blocks to run, each with the ``continue`` blocks after it on its page."""
    chains: list[list] = []
    for block in BLOCKS:
        if block.lang != "python" or block.mode != "run":
            continue
        if block.cont:
            assert chains and chains[-1][0].path == block.path, f"{block.id}: nothing to continue"
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


@pytest.mark.parametrize("chain", _python_chains(), ids=lambda c: c[0].id)
def test_documented_python_runs(chain, docs_dir, tiny_llama_dir, monkeypatch):
    monkeypatch.chdir(docs_dir)
    monkeypatch.syspath_prepend(str(docs_dir))
    namespace: dict = {"__name__": "__docs__"}
    for block in chain:
        code = block.text
        for old, new in block.replace:
            new = new.replace("{tiny_llama}", tiny_llama_dir).replace("{docs}", str(docs_dir))
            assert old in code, f"{block.id}: replace={old}->...: {old!r} is not in the block"
            code = code.replace(old, new)
        exec(compile(code, block.id, "exec"), namespace)  # noqa: S102 - the docs' own code
