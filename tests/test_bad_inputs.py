"""Bad input, table-driven: each case fails before any training with a message naming the setting
(or file, line, reward, model) and what to do, as one of the errors the CLI prints without a
traceback (``rlhf_torchrl.cli.USER_ERRORS``); a few go through the real command line."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import _save_tiny, _tiny_llama
from test_recipe import IN_PROCESS, RECIPES, TINY, _cfg, ppo

from rlhf_torchrl.cli import USER_ERRORS
from rlhf_torchrl.config import components, compose, inputs, model_checks


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """Bad files of each kind, written once."""
    d = tmp_path_factory.mktemp("bad")
    (d / "bad_json.jsonl").write_text('{"prompt": "a b"}\n{"prompt": "c d"}\n{"prompt": oops}\n')
    (d / "no_column.jsonl").write_text('{"text": "a b"}\n')
    (d / "empty.jsonl").write_text("")
    (d / "latin1.jsonl").write_bytes('{"prompt": "ok"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (d / "a_file").write_text("not a directory")
    (d / "long.jsonl").write_text(json.dumps({"prompt": "word " * 400}) + "\n")
    small_vocab = _tiny_llama(tokenizer, vocab_size=1000)
    _save_tiny(d / "small_vocab", small_vocab, tokenizer)
    # the other forms (tests/test_data.py reads each of them when they are right)
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = [f"What is {i} plus {i}?" for i in range(8)]
    pq.write_table(pa.table({"question": questions, "answer": [str(2 * i) for i in range(8)]}),
                   d / "gsm8k.parquet")
    (d / "gsm8k.parquet").rename(d / "wrong_column.parquet")  # (the prompt is not in "prompt")
    pq.write_table(pa.table({"question": questions, "answer": [str(2 * i) for i in range(8)]}),
                   d / "gsm8k.parquet")
    (d / "wrong_column.csv").write_text("question,answer\n" + "".join(f"{q},{i}\n" for i, q in enumerate(questions)))
    pq.write_table(pa.table({"question": questions}), d / "no_answer.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), d / "empty.parquet")
    (d / "empty.csv").write_text("")
    (d / "header.csv").write_text("prompt,answer\n")
    (d / "mixed.jsonl").write_text('{"prompt": "a b"}\n{"prompt": [{"role": "user", "content": "c"}]}\n')
    pq.write_table(pa.table({"prompt": list(range(8))}), d / "numbers.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", None, "d"] * 2}), d / "nulls.parquet")
    (d / "text.parquet").write_text('{"prompt": "a JSON line, not Parquet"}\n')
    (d / "prompts.txt").write_text("a prompt per line\n")
    (d / "config_only").mkdir()  # a model folder whose weights were never saved
    shutil.copy(d / "small_vocab" / "config.json",
                d / "config_only" / "config.json")
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": questions})}).save_to_disk(
        str(d / "saved_dict"))
    return d


# (overrides, message regex); {d}: the bad-files folder, {model}: the tiny Llama's directory
CASES = {
    # ranges and choices (validation.py)
    "clip-negative": (["ppo.clip_epsilon=-0.2"], r"ppo.clip_epsilon=-0.2 is out of range: it must be > 0"),
    "gamma-above-1": (["ppo.gamma=1.5"], r"ppo.gamma=1.5 is out of range: it must be in \[0, 1\]"),
    "lambda-negative": (["ppo.lmbda=-1"], r"ppo.lmbda=-1.0 is out of range: it must be in \[0, 1\]"),
    "kl-coef-negative": (["ppo.kl_coef=-1"], r"ppo.kl_coef=-1.0 is out of range: it must be >= 0"),
    "dtype-float7": (["model.dtype=float7"], r"model.dtype='float7' is not one of the allowed values: float32"),
    "logger-nonsense": (["logging.logger=nonsense"], r"logging.logger='nonsense' is not one of .*csv"),
    "temperature-zero": (["generation.temperature=0"], r"generation.temperature=0.0 is out of range: it must be > 0"),
    "top-p-zero": (["generation.top_p=0"], r"generation.top_p=0.0 is out of range: it must be in \(0, 1\]"),
    "lr-negative": (["optim.lr=-1e-5"], r"optim.lr=-1e-05 is out of range"),
    "lora-dropout-1": (["lora.dropout=1.0"], r"lora.dropout=1.0 is out of range: it must be in \[0, 1\)"),
    "kl-estimator": (["ppo.kl_estimator=kl"], r"ppo.kl_estimator='kl' is not one of .*k1, k2, k3"),
    "schedule": (["optim.lr_schedule=cosine"], r"optim.lr_schedule='cosine' .*linear, constant"),
    "autocast-float8": (["model.autocast=float8"], r"model.autocast='float8'"),
    "strategy": (["distributed.strategy=zero3"], r"distributed.strategy='zero3' .*ddp, fsdp2"),
    "backend": (["generation.backend=tgi"], r"generation.backend='tgi' .*transformers, vllm"),
    "micro-batch-tokens-0": (["ppo.micro_batch_tokens=0"], r"ppo.micro_batch_tokens=0 is out of range"),
    "keep-0": (["checkpoint.keep=0"], r"checkpoint.keep=0 is out of range: it must be >= 1"),
    "non-finite-choice": (["guards.non_finite=ignore"], r"guards.non_finite='ignore' .*stop, skip"),
    # settings against each other
    "batch-split": (["ppo.batch_size=6", "ppo.num_mini_batches=4"], r"not divisible"),
    "accumulation": (["ppo.gradient_accumulation_steps=3"], r"micro-batches"),
    "autocast-bf16-weights": (["model.autocast=bfloat16", "model.dtype=bfloat16"], r"master weights"),
    "critic-from-missing-rm": (["value_model.init=reward_model"], r"needs reward.model"),
    "tis-with-sampled-log-probs": (["ppo.tis_cap=2"], r"generation.log_probs_from_sampling=false"),
    # two splits of a minibatch: the token budget would override the row count silently
    "token-budget-and-accumulation": (["ppo.micro_batch_tokens=64", "ppo.gradient_accumulation_steps=2"],
                                      r"ppo.micro_batch_tokens=64 splits each minibatch by tokens, and "
                                      r"ppo.gradient_accumulation_steps=2 by rows: .*Set "
                                      r"ppo.gradient_accumulation_steps=1"),
    # dropout on in the update, off while sampling: PPO's first ratio is not 1
    "lora-dropout": (["lora.r=4", "lora.dropout=0.05"],
                     r"lora.dropout=0.05: .*first ratio is not 1.*set lora.dropout=0\.$"),
    # truncated sampling is off-policy for PPO's ratio: refused (docs/concepts.md)
    "top-k-in-training": (["generation.top_k=50"], r"generation.top_k=50 .*full distribution.*generation.top_k=0"),
    "top-p-in-training": (["generation.top_p=0.9"], r"generation.top_p=0.9: .*off-policy.*generation.top_p=1.0"),
    "estimator": (["advantage.estimator=ppo"], r"advantage.estimator='ppo' .*gae, grpo, rloo, reinforce_pp"),
    "samples-per-prompt-0": (["generation.samples_per_prompt=0"], r"generation.samples_per_prompt=0 is out of range"),
    "kl-loss-negative": (["ppo.kl_loss_coef=-0.1"], r"ppo.kl_loss_coef=-0.1 is out of range"),
    "grpo-one-sample": (["advantage.estimator=grpo"], r"advantage.estimator=grpo compares responses .*samples_per_prompt >= 2"),
    "rloo-one-sample": (["advantage.estimator=rloo"], r"samples_per_prompt >= 2"),
    "filter-one-sample": (["advantage.filter_groups=true"], r"advantage.filter_groups .*samples_per_prompt >= 2"),
    "filter-without-group-baseline": (["advantage.filter_groups=true", "generation.samples_per_prompt=2"],
                                      r"advantage.filter_groups .*advantage.estimator=grpo or rloo \(now gae\)"),
    "batch-not-whole-groups": (["generation.samples_per_prompt=3"], r"ppo.batch_size=4 responses do not make whole groups of generation.samples_per_prompt=3"),
    "ray-workers-split": (["collection.ray_workers=3"], r"collection.ray_workers=3: .*divisor"),
    "device": (["device=abacus"], r"not a device"),
    # rewards
    "no-reward": (["reward.functions=[]"], r"No reward"),
    "weights-count": (["reward.function_weights=[1.0,2.0]"], r"one weight per function"),
    "reward-import": (["reward.functions=[no_such_pkg.fn]"], r"no_such_pkg"),
    "reward-length": (["reward.functions=[test_scoring.wrong_length]"], r"wrong_length.*exactly one float"),
    "reward-raises": (["reward.functions=[test_scoring.raising_reward]"],
                      r"'raising_reward' raised KeyError: 'boom' \(at .*test_scoring.py:\d+"),
    "reward-nan-at-start": (["reward.functions=[test_scoring.nan_reward]"], r"nan_reward.*non-finite"),
    "reward-text": (["reward.functions=[test_scoring.text_reward]"], r"text_reward.*got list of str"),
    "reward-none": (["reward.functions=[test_scoring.none_reward]"], r"none_reward.*got NoneType"),
    # data
    "json-line-3": (["data.source={d}/bad_json.jsonl"], r"bad_json.jsonl:3: not valid JSON"),
    "json-column": (["data.source={d}/no_column.jsonl"], r"no_column.jsonl:1: .*'prompt' field .*data.column"),
    "empty-file": (["data.source={d}/empty.jsonl"], r"empty"),
    "not-utf8": (["data.source={d}/latin1.jsonl"], r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 .*UTF-8"),
    "missing-file": (["data.source={d}/none.jsonl"], r"none.jsonl' does not exist"),
    "too-few-prompts": (["data.limit=2"], r"2 prompts, 4 of them held out .*fewer than the 4 of a batch \(ppo.batch_size=4"),
    "over-long-prompt": (["data.source={d}/long.jsonl", "data.max_words=null", "ppo.batch_size=1",
                          "ppo.num_mini_batches=1"],
                         r"data.max_prompt_length=128.*truncate_prompts"),
    "offline-dataset": (["data.source=no_such_dataset_xyz"], r"data.source=no_such_dataset_xyz: not a local file"),
    # data in the other forms (the JSON-lines reader read every one of them before)
    "parquet-column": (["data.source={d}/wrong_column.parquet"],
                       r"wrong_column.parquet has no column 'prompt' \(data.column\); its columns are \['question', 'answer'\]. Set data.column"),
    "csv-column": (["data.source={d}/wrong_column.csv"], r"wrong_column.csv has no column 'prompt' .*\['question', 'answer'\]"),
    "empty-parquet": (["data.source={d}/empty.parquet"], r"empty.parquet is empty \(no rows\)"),
    "empty-csv": (["data.source={d}/empty.csv"], r"empty.csv is empty"),
    "header-only-csv": (["data.source={d}/header.csv"], r"header.csv is empty"),
    "mixed-prompt-types": (["data.source={d}/mixed.jsonl"],
                           r"mixed.jsonl:2: the prompt \(data.column 'prompt'\) is messages here but text at .*mixed.jsonl:1"),
    "prompt-not-text": (["data.source={d}/numbers.parquet"],
                        r"numbers.parquet: the column 'prompt' \(data.column\) holds int64 values: a prompt is text or a list of chat messages"),
    "null-prompt": (["data.source={d}/nulls.parquet"], r"nulls.parquet\[2\]: the prompt \(data.column 'prompt'\) is empty \(null\)"),
    "not-parquet": (["data.source={d}/text.parquet"], r"text.parquet: not a Parquet file"),
    "unknown-form": (["data.source={d}/prompts.txt"],
                     r"prompts.txt: a .txt file is not a form read here. Give a .jsonl file, a .json file .*\.parquet .*\.csv or \.tsv file, .*save_to_disk"),
    "missing-parquet": (["data.source={d}/none.parquet"], r"none.parquet' does not exist"),
    "saved-split": (["data.source={d}/saved_dict", "data.split=test"], r"saved_dict holds the splits \['train'\], not data.split='test'"),
    "ground-truth-missing": (["task=gsm8k", "data.source={d}/no_answer.parquet"],
                             r"Reward 'gsm8k_correct' asks for 'answer', which is not a dataset column: the prompts carry no columns"),
    "mixture-ground-truth": (["task=gsm8k", "data.sources=[{{source: {d}/gsm8k.parquet}}, {{source: {d}/no_answer.parquet}}]"],
                             r"data.sources\[1\] \(.*no_answer.parquet\): Reward 'gsm8k_correct' asks for 'answer'"),
    "mixture-weight": (["data.sources=[{{source: {d}/gsm8k.parquet, weight: 0}}]"],
                       r"data.sources\[0\].weight=0.0 is out of range: it must be > 0"),
    # models
    "policy-missing": (["model.policy={d}/nothing"], r"model.policy=.*nothing: no such directory"),
    "reference-missing": (["model.reference={d}/nothing"], r"model.reference=.*: no such directory"),
    "policy-without-weights": (["model.policy={d}/config_only"],
                               r"^model.policy=.*config_only has a config.json but no weights .*it "
                               r"holds config.json\): save the model there"),
    "reference-vocabulary": (["model.reference={d}/small_vocab"], r"vocabulary of 1000 tokens .*same tokenizer"),
    "reward-model-is-an-lm": (["reward.model={model}"], r"LlamaForCausalLM, not a sequence classifier"),
    "stop-token": (["generation.stop_token=nope_not_a_token"], r"generation.stop_token 'nope_not_a_token'"),
    "tools-on-plain-text": (["env.max_turns=2", "env.tools=[calculator]"],
                            r"env.max_turns=2 with data.chat_template=plain: a plain text has no "
                            r"roles.*Set data.chat_template=null"),
    # output directory and resume
    "output-is-a-file": (["output_dir={d}/a_file"], r"output_dir=.*a_file is a file"),
    "resume-not-a-checkpoint": (["resume={d}"], r"resume=.* is not a checkpoint directory"),
}


@pytest.mark.parametrize("overrides,match", CASES.values(), ids=CASES.keys())
def test_bad_input_fails_before_work(tmp_path, tiny_llama_dir, files, overrides, match):
    overrides = [o.format(d=files, model=tiny_llama_dir) for o in overrides]
    run = tmp_path / "run"
    if not any(o.startswith("output_dir=") for o in overrides):
        overrides.append(f"output_dir={run}")
    with pytest.raises(USER_ERRORS, match=match):
        ppo.train(_cfg(run, tiny_llama_dir, *overrides))
    assert not (run / "metrics.jsonl").exists()


def test_kl_in_the_loss_beside_the_presets_reward_kl_is_warned(tmp_path, tiny_llama_dir, caplog):
    """ppo.kl_loss_coef > 0 with the preset's reward KL (ppo.kl_coef > 0) runs both, which some
    setups want: one warning naming the fix for GRPO's loss-only KL; none when either is 0."""
    from rlhf_torchrl.config import checks

    def warnings(*overrides):
        caplog.clear()
        with caplog.at_level("WARNING", logger="rlhf_torchrl"):
            checks.check_config(_cfg(tmp_path, tiny_llama_dir, *overrides))
        return [r.getMessage() for r in caplog.records if "kl_loss_coef" in r.getMessage()]

    (line,) = warnings("ppo.kl_loss_coef=0.01")  # the sentiment preset's kl_coef=0.1
    assert line == ("ppo.kl_loss_coef=0.01 puts the KL in the loss, and ppo.kl_coef=0.1 (the task "
                    "preset's, unless set) keeps the KL penalty in the reward too: both apply. For "
                    "GRPO's loss-only KL set ppo.kl_coef=0.")
    assert warnings("ppo.kl_loss_coef=0.01", "ppo.kl_coef=0") == []
    assert warnings() == []


def test_a_finished_run_without_checkpoints_is_not_overwritten(tmp_path, tiny_llama_dir):
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "checkpoint.every=0", "ppo.num_iterations=1"))
    report = (tmp_path / "report.json").read_bytes()
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=1"))  # finished: nothing to do
    with pytest.raises(ValueError, match="holds a finished run without a checkpoint.*resume=never"):
        ppo.train(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=2"))  # no checkpoint to go on from
    assert (tmp_path / "report.json").read_bytes() == report


COMPOSE_CASES = {  # wrong types and unknown keys: Hydra refuses them while composing
    "int-abc": ("ppo.batch_size=abc", r"Value 'abc' of type 'str' could not be converted to Integer"
                                      r"[\s\S]*full_key: ppo.batch_size"),
    "float-abc": ("ppo.gamma=high", r"could not be converted to Float[\s\S]*full_key: ppo.gamma"),
    "bool-maybe": ("generation.check_on_policy=maybe", r"full_key: generation.check_on_policy"),
    "typo": ("ppo.batchsize=3", r"Key 'batchsize' not in 'PPO'"),
}


@pytest.mark.parametrize("override,match", COMPOSE_CASES.values(), ids=COMPOSE_CASES.keys())
def test_wrong_types_are_refused_while_composing(override, match):
    from rlhf_torchrl.cli import override_error

    with pytest.raises(Exception) as info:
        compose([override])
    error = info.value
    assert re.search(match, f"{error}\n{error.__cause__ or ''}"), (error, error.__cause__)
    # what the command line prints: one line naming the key
    line, key = override_error(error), override.split("=")[0]
    assert "\n" not in line and line.startswith((f"{override} is not", f"{key} is not a setting")), line


@pytest.mark.parametrize("override,expected", [
    ("ppo.nope=1", "Error: ppo.nope is not a setting: check its spelling; `rlhf-torchrl ppo --cfg job` "
                   "prints every setting."),
    ("ppo.batchsize=3", "Error: ppo.batchsize is not a setting: did you mean ppo.batch_size? "),
    ("ppo.batch_size=abc", "Error: ppo.batch_size=abc is not an integer: give an integer, e.g. "
                           "ppo.batch_size=32 (its value now)."),
    ("generation.check_on_policy=maybe", "Error: generation.check_on_policy=maybe is not true or false"),
    ("ppo=3", "Error: ppo=3: ppo is a group of settings, not a value"),
], ids=["unknown-key", "typo", "int-abc", "bool-maybe", "group"])
def test_unknown_keys_and_wrong_types_print_one_line(tmp_path, monkeypatch, capsys, override, expected):
    """`rlhf-torchrl ppo ...` and `python recipes/ppo.py ...` (in process): exit status 1, one line
    on stderr naming the key and the fix (Hydra printed six, with a HYDRA_FULL_ERROR hint)."""
    import runpy

    from rlhf_torchrl.cli import main

    monkeypatch.setattr(sys, "argv", ["recipes/ppo.py", override, f"hydra.run.dir={tmp_path}"])
    for run in (lambda: main(["ppo", *sys.argv[1:]]),
                lambda: runpy.run_path(str(RECIPES / "ppo.py"), run_name="__main__")):
        with pytest.raises(SystemExit) as info:
            run()
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(expected), err


@pytest.fixture(scope="module")
def short_gpt2_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny GPT-2 with 128 learned positions: a token past them is an IndexError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return _save_tiny(tmp_path_factory.mktemp("short_gpt2"), GPT2LMHeadModel(config), tokenizer)


def test_prompt_plus_response_past_the_models_positions_is_one_line(tmp_path, short_gpt2_dir, capsys):
    """128 positions and generation.max_new_tokens=128 (task=custom's default): refused before
    any weights load, naming both numbers and the fix (it was an IndexError from the position
    embedding in the first evaluation)."""
    from rlhf_torchrl.cli import run

    cfg = _cfg(tmp_path, short_gpt2_dir, "generation.max_new_tokens=128")
    with pytest.raises(SystemExit) as info:
        run(ppo.train, cfg)
    assert info.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    longest = re.search(r"The longest prompt \((\d+) tokens, chat template included\) plus 128 "
                        r"response tokens \(generation.max_new_tokens=128\) is (\d+) tokens, more "
                        r"than the 128 positions of model.policy=.*short_gpt2.*: set "
                        r"generation.max_new_tokens=(\d+) or less\.$", line)
    assert longest, line
    prompt, total, most = map(int, longest.groups())
    assert total == prompt + 128 and most == 128 - prompt > 0
    assert not (tmp_path / "metrics.jsonl").exists()
    # prompts that fit with the response: accepted, though data.max_prompt_length=128 would not
    cfg = _cfg(tmp_path, short_gpt2_dir, f"generation.max_new_tokens={most}")
    tokenizer = components.make_tokenizer(cfg)
    model_checks.check_sequence_length(cfg, inputs.make_prompts(cfg, tokenizer), tokenizer)
    for overrides, fix in [
        # episodes of up to 3 turns of 50 tokens, without an episode budget
        (["data.chat_template=null", "env.max_turns=3", "env.tools=[calculator]",
          "env.describe_tools=false",
          "generation.max_new_tokens=50"],
         r"plus 150 response tokens \(env.max_turns=3 x generation.max_new_tokens=50, the tool "
         r"messages on top\) .*: set env.max_tokens=\d+ or less\.$"),
        # whole reviews (up to 56 tokens as plain text): the prompts could be cut to fit too
        (["generation.max_new_tokens=100", "data.max_words=null"],
         r"set generation.max_new_tokens=\d+ or less, or cut the prompts "
         r"\(data.max_prompt_length=28 data.truncate_prompts=true\)\.$"),
    ]:
        cfg = _cfg(tmp_path, short_gpt2_dir, *overrides)
        with pytest.raises(USER_ERRORS, match=fix):
            model_checks.check_sequence_length(cfg, inputs.make_prompts(cfg, tokenizer), tokenizer)


@pytest.mark.parametrize("overrides,expected", [
    (["ppo.clip_epsilon=-0.2"], "Error: ppo.clip_epsilon=-0.2 is out of range"),
    (["ppo.batch_size=abc"], "Error: ppo.batch_size=abc is not an integer"),
    (["data.source={d}/bad_json.jsonl"], "bad_json.jsonl:3: not valid JSON"),
], ids=["range", "type", "data"])
def test_cli_prints_errors_without_traceback(tmp_path, tiny_llama_dir, files, overrides, expected):
    overrides = [o.format(d=files) for o in overrides]
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "ppo.py"), f"output_dir={tmp_path}",
         f"model.policy={tiny_llama_dir}", *TINY, *IN_PROCESS, *overrides],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_load_tokenizer_gives_a_distinct_pad_token(tokenizer):
    """Missing pad token or pad = EOS: the tokenizer gets its own pad token (no error needed)."""
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert torch.tensor(tokenizer("a b")["input_ids"]).ndim == 1


def test_unknown_task_lists_the_presets(tmp_path, monkeypatch, capsys):
    """What `rlhf-torchrl ppo task=...` and `python recipes/ppo.py task=...` print (in process:
    both stop before Hydra composes anything)."""
    import runpy

    from rlhf_torchrl.cli import main

    monkeypatch.setattr(sys, "argv", ["recipes/ppo.py", "task=sentimnet", f"hydra.run.dir={tmp_path}"])
    for run in (lambda: main(["ppo", *sys.argv[1:]]),
                lambda: runpy.run_path(str(RECIPES / "ppo.py"), run_name="__main__")):
        with pytest.raises(SystemExit) as info:
            run()
        assert info.value.code == 1
        out = capsys.readouterr()
        assert "Error: task=sentimnet is not a task preset: choose one of arithmetic, arithmetic_tools, custom" in out.err
        assert "search path" not in out.err + out.out


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(capsys):
    """A ConfigError (a setting, a file) is the user's: one line, exit 1. A ValueError from
    anywhere else is a bug: it propagates with its traceback."""
    from rlhf_torchrl.cli import run
    from rlhf_torchrl.errors import ConfigError

    def bad_setting(cfg):
        raise ConfigError("ppo.batch_size=3 does not split")

    def bug(cfg):
        raise ValueError("an internal mistake")

    with pytest.raises(SystemExit) as info:
        run(bad_setting, None)
    assert info.value.code == 1 and capsys.readouterr().err == "Error: ppo.batch_size=3 does not split\n"
    with pytest.raises(ValueError, match="an internal mistake"):
        run(bug, None)
