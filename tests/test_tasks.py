"""The task presets (rlhf_torchrl/config/task/*.yaml): each loads a local file in its dataset's schema,
written here, and runs two PPO iterations with a tiny model; the data features they rely on
(templates over several columns, truncation inside the template, dataset config names,
reasoning-gym tasks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rlhf_torchrl.config import checks, components, compose, inputs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import ppo  # noqa: E402

from rlhf_torchrl.data import load_prompts  # noqa: E402
from rlhf_torchrl.data.prompts import check_prompts  # noqa: E402

TASKS = ["sentiment", "tldr", "hh", "gsm8k", "arithmetic", "custom"]
TWO_ITERATIONS = ["ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
                  "model.autocast=null", "ppo.forward_batch_size=2", "ppo.micro_batch_tokens=null",
                  "logging.progress_bar=false", "eval.every=1", "eval.num_prompts=2",
                  "checkpoint.every=0", "reuse_freed_memory=false", "optim.lr=1e-3",
                  "optim.critic_warmup=0"]


def _compose(*overrides):
    return compose(overrides)


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _save_classifier(path: Path, policy_dir: str, tokenizer) -> str:
    """A 1-label sequence classifier on the tiny Llama's config: a reward model for the tests."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def base_model_dirs(tmp_path_factory, tiny_llama_dir):
    """(policy, reward model) of a *base* model: the tokenizer has no chat template, so prompts
    are read raw (TL;DR's Pythia)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = None
    policy = tmp_path_factory.mktemp("base_policy")
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(policy)
    tok.save_pretrained(policy)
    assert not AutoTokenizer.from_pretrained(policy).chat_template
    return str(policy), _save_classifier(tmp_path_factory.mktemp("base_rm"), str(policy), tok)


@pytest.fixture(scope="module")
def chat_reward_dir(tmp_path_factory, tiny_llama_dir, tokenizer):
    """A tiny reward model with SmolLM2's chat template (HH: it reads conversations)."""
    return _save_classifier(tmp_path_factory.mktemp("chat_rm"), tiny_llama_dir, tokenizer)


LONG_POST = "\n".join(" ".join(f"p{p}w{i}" for i in range(60)) for p in range(15)) + "\nTHE END"


def tldr_rows(n: int = 8) -> list[dict]:
    """Rows in the schema of vwxyzjn/summarize_from_feedback_tldr_3_filtered."""
    rows = [{"id": f"t{i}", "subreddit": "relationships", "title": f"Title {i}",
             "post": f"My friend and I argued about chores, day {i}.", "summary": "we argued"}
            for i in range(n)]
    rows[1]["post"] = LONG_POST
    return rows


def hh_rows(n: int = 8) -> list[dict]:
    """Rows in the schema of Anthropic/hh-rlhf: multi-turn transcripts."""
    return [{"chosen": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: {2 * i}.\n\nHuman: And "
                       f"times two?\n\nAssistant: {4 * i}.",
             "rejected": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: {2 * i}.\n\nHuman: And "
                         "times two?\n\nAssistant: No idea."} for i in range(n)]


def gsm8k_rows(n: int = 8) -> list[dict]:
    """Rows in the schema of openai/gsm8k (main): reasoning, then '#### <answer>'."""
    return [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples has he?",
             "answer": f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n"
                       f"#### {2 * i + 3}"} for i in range(n)]


def test_every_preset_composes_and_passes_the_config_checks():
    for task in TASKS:
        extra = ["data.source=prompts.jsonl", "reward.model=rm"] if task == "custom" else []
        cfg = _compose(f"task={task}", "output_dir=/tmp/unused", *extra)
        checks.check_config(cfg)  # choices, ranges and cross-checks, before any weights
        assert cfg.data.source and (cfg.reward.functions or cfg.reward.model), task
    default = _compose()  # no task named: the sentiment task
    assert default == _compose("task=sentiment") and default.data.source == "polarity"
    assert (default.ppo.kl_coef, default.ppo.kl_target, default.optim.critic_warmup,
            default.generation.temperature, default.reward.functions[0]) == \
        (0.1, None, 2, 0.7, "rlhf_torchrl.rewards.functions.vader_sentiment")
    hh = _compose("task=hh")
    assert (hh.data.source, hh.data.column, hh.data.truncate_prompts) == ("Anthropic/hh-rlhf", "chosen", True)
    assert hh.reward.model and not hh.reward.functions and hh.data.system_prompt is None
    arithmetic = _compose("task=arithmetic")
    assert arithmetic.data.source == "reasoning_gym:basic_arithmetic"
    assert arithmetic.data.generator_args.max_terms == 2 and arithmetic.data.limit == 400
    custom = _compose("task=custom")
    assert custom.data.template == "{prompt}" and not custom.reward.functions
    tldr = _compose("task=tldr")
    assert (tldr.generation.temperature, tldr.generation.max_new_tokens, tldr.ppo.kl_coef) == \
        (0.7, 53, 0.05)
    assert tldr.value_model.init == "reward_model" and tldr.reward.missing_eos_penalty > 0
    assert (tldr.data.truncate_side, tldr.data.truncate_at) == ("right", "\n")
    assert _compose("task=gsm8k").eval.accuracy_reward == "gsm8k_correct"


def _run(tmp_path, *overrides):
    report = ppo.train(_compose(f"output_dir={tmp_path / 'run'}", *TWO_ITERATIONS, *overrides))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and report["iterations"] == 2
    assert (tmp_path / "run" / "report.html").is_file()
    return report, rows


def test_tldr_preset_runs_on_a_local_file(tmp_path, base_model_dirs):
    policy, reward_model = base_model_dirs
    data = _write_jsonl(tmp_path / "tldr.jsonl", tldr_rows())
    report, rows = _run(tmp_path, "task=tldr", f"model.policy={policy}",
                        f"reward.model={reward_model}", f"data.source={data}",
                        "generation.max_new_tokens=12")
    samples = report["samples_after"]
    assert all(s["prompt"].startswith("SUBREDDIT: r/relationships\n\nTITLE: Title ")
               and s["prompt"].endswith("\n\nTL;DR:") for s in samples)
    assert "objective/scores" in rows[0] and "eval/win_rate" in rows[-1]
    assert any("val/num_eos_tokens" in r for r in rows)


def test_tldr_truncation_cuts_the_post_at_a_paragraph_and_keeps_the_format(tmp_path,
                                                                           base_model_dirs):
    from rlhf_torchrl.modules import load_tokenizer

    tok = load_tokenizer(base_model_dirs[0])
    d = _compose("task=tldr").data
    prompts = load_prompts(_write_jsonl(tmp_path / "t.jsonl", tldr_rows(3)), column="post",
                           template=d.template)
    fitted, n = check_prompts(prompts, tok, max_prompt_length=d.max_prompt_length,
                              truncate=True, truncate_side=d.truncate_side,
                              truncate_at=d.truncate_at)
    assert n == 1
    text = fitted[1].text
    assert text.startswith("SUBREDDIT: r/relationships\n\nTITLE: Title 1\n\nPOST: p0w0 p0w1 ")
    assert text.endswith("w59\n\nTL;DR:")
    post = fitted[1].source_text
    assert LONG_POST.startswith(post) and LONG_POST[len(post)] == "\n"  # whole paragraphs kept
    assert "THE END" not in text and len(tok(text)["input_ids"]) <= 512
    # ... as many as fit: one more paragraph would not
    paragraphs = LONG_POST.split("\n")
    longer = fitted[1].with_source_text("\n".join(paragraphs[: post.count("\n") + 2]))
    assert len(tok(longer.text)["input_ids"]) > 512
    assert fitted[0] == prompts[0]  # a short post is left alone
    assert fitted[1].fields["summary"] == "we argued"  # the columns still travel
    # the other side: the post keeps its end
    (_, left), _ = check_prompts(prompts[:2], tok, max_prompt_length=512, truncate=True)
    assert left.text.endswith("THE END\n\nTL;DR:") and "p0w0 " not in left.text


def test_hh_preset_runs_multi_turn_dialogues_through_the_chat_template(tmp_path, tiny_llama_dir,
                                                                       chat_reward_dir):
    data = _write_jsonl(tmp_path / "hh.jsonl", hh_rows())
    report, rows = _run(tmp_path, "task=hh", f"model.policy={tiny_llama_dir}",
                        f"reward.model={chat_reward_dir}", f"data.source={data}",
                        "generation.max_new_tokens=8")
    prompt = report["samples_after"][0]["prompt"]
    # the earlier turns are in the rendered conversation, the policy answers the last one
    assert prompt.count("<|im_start|>user") == 2 and prompt.count("<|im_start|>assistant") == 2
    assert "And times two?" in prompt and "No idea" not in prompt
    assert "eval/win_rate" in rows[-1]


def test_gsm8k_preset_reports_accuracy(tmp_path, tiny_llama_dir):
    data = _write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    report, rows = _run(tmp_path, "task=gsm8k", f"model.policy={tiny_llama_dir}",
                        f"data.source={data}", "generation.max_new_tokens=16")
    for row in rows:
        assert 0.0 <= row["eval/accuracy"] <= 1.0
        assert "objective/scores/gsm8k_correct" in row and "objective/scores/gsm8k_format" in row
    assert "Let's think step by step" in report["samples_after"][0]["prompt"]


def test_gsm8k_preset_trains_on_verls_parquet(tmp_path, tiny_llama_dir):
    """A GSM8K Parquet as verl's preprocessing writes it (the prompt as chat messages with the
    instruction in, reward_model.ground_truth, data_source, extra_info): `task=gsm8k
    data.source=train.parquet` reads the prompts as written and trains two iterations, the GSM8K
    verifier reading the ground truth."""
    datasets = pytest.importorskip("datasets")
    from test_data import verl_rows

    from rlhf_torchrl.data.rollout import probe_rollout

    instruction = "Let's think step by step and output the final answer after \"####\"."
    rows = [{"prompt": f"{r['question']} {instruction}", "answer": r["answer"].split("#### ")[-1]}
            for r in gsm8k_rows()]
    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list(verl_rows(rows)).to_parquet(path)
    overrides = ["task=gsm8k", f"model.policy={tiny_llama_dir}", f"data.source={path}",
                 "generation.max_new_tokens=16"]
    report, metrics = _run(tmp_path, *overrides)
    for row in metrics:
        assert 0.0 <= row["eval/accuracy"] <= 1.0 and "objective/scores/gsm8k_correct" in row
    assert report["samples_after"][0]["prompt"].count("Let's think step by step") == 1
    # the verifier, through the rollout's ("data", ...) fields: right and wrong final answers
    cfg = _compose(f"output_dir={tmp_path / 'probe'}", *TWO_ITERATIONS, *overrides)
    tokenizer = components.make_tokenizer(cfg)
    prompts = inputs.make_prompts(cfg, tokenizer)
    truth = [p.fields["ground_truth"] for p in prompts[:2]]
    assert truth == ["3", "5"]
    rollout = probe_rollout(prompts[:2], tokenizer, [f"So #### {truth[0]}", f"#### {truth[1]}1"])
    scorer = components.make_scorer(cfg, components.make_reward_functions(cfg), torch.device("cpu"))
    assert scorer(rollout).get(("scores", "gsm8k_correct")).tolist() == [1.0, 0.0]


def test_sentiment_preset_is_the_default(tmp_path, tiny_llama_dir):
    report, rows = _run(tmp_path, "task=sentiment", f"model.policy={tiny_llama_dir}",
                        "data.limit=16")
    prompt = report["samples_after"][0]["prompt"]  # an opening to continue, as plain text
    assert prompt and len(prompt.split()) <= 8 and "<|im_start|>" not in prompt
    assert "eval/distinct_2" in rows[-1]


def test_arithmetic_preset_runs_offline(tmp_path, tiny_llama_dir):
    pytest.importorskip("reasoning_gym")
    report, rows = _run(tmp_path, "task=arithmetic", f"model.policy={tiny_llama_dir}",
                        "data.limit=16", "generation.max_new_tokens=8")
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in rows)
    assert report["samples_after"][0]["prompt"].count("Calculate ") == 1
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["config"]["model"]["packing"] is True  # ragged answers: the preset packs


def test_gsm8k_preset_on_a_reasoning_gym_task(tmp_path, tiny_llama_dir):
    pytest.importorskip("reasoning_gym")
    _, rows = _run(tmp_path, "task=gsm8k", f"model.policy={tiny_llama_dir}",
                   "data.source=reasoning_gym:basic_arithmetic", "data.limit=16",
                   "+data.generator_args.max_terms=2", "generation.max_new_tokens=8",
                   "reward.functions=[rlhf_torchrl.rewards.functions.reasoning_gym_score]",
                   "reward.function_weights=null", "eval.judge=null",
                   "eval.accuracy_reward=reasoning_gym_score")
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in rows)


# ---- the data features the presets use -----------------------------------------------------------
def test_template_fills_columns_and_names_a_missing_one(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"post": "text", "title": "T", "n": 3}])
    prompt = load_prompts(path, column="post", template="{title} ({n}): {prompt}")[0]
    assert prompt.text == "T (3): text" and prompt.fields == {"title": "T", "n": 3}
    with pytest.raises(ValueError, match=r"names \{subreddit\}.*\['n', 'title'\]"):
        load_prompts(path, column="post", template="r/{subreddit}: {prompt}")
    with pytest.raises(ValueError, match=r"a 'body' field"):
        load_prompts(path, column="body")
    # an entry of a dict column (reasoning-gym's metadata, say)
    path = _write_jsonl(tmp_path / "m.jsonl", [{"post": "text", "meta": {"level": 2}}])
    prompt = load_prompts(path, column="post", template="[level {meta[level]}] {prompt}")[0]
    assert prompt.text == "[level 2] text"
    with pytest.raises(ValueError, match=r"cannot be filled from this row's fields \['meta'\]: "
                                         r"KeyError 'rank'"):
        load_prompts(path, column="post", template="{meta[rank]} {prompt}")


def test_truncation_without_a_column_template_keeps_the_instruction(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": LONG_POST}])
    prompts = load_prompts(path, template="Summarise: {prompt}")
    (fitted,), n = check_prompts(prompts, tokenizer, max_prompt_length=64, truncate=True)
    assert n == 1 and fitted.text.startswith("Summarise: ") and fitted.text.endswith("THE END")


def test_dataset_config_name_reaches_the_hub_loader(tmp_path):
    """A local dataset directory with two configurations: data.config picks one (as 'main' does
    for openai/gsm8k)."""
    pytest.importorskip("datasets")
    root = tmp_path / "gsm8k_like"
    for name, rows in (("main", gsm8k_rows(3)), ("socratic", gsm8k_rows(5))):
        (root / name).mkdir(parents=True)
        _write_jsonl(root / name / "train.jsonl", rows)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: "
        "main/train.jsonl\n- config_name: socratic\n  data_files:\n  - split: train\n    path: "
        "socratic/train.jsonl\n---\n")
    assert len(load_prompts(str(root), column="question", config="main")) == 3
    assert len(load_prompts(str(root), column="question", config="socratic")) == 5


def test_reasoning_gym_source_and_checker():
    pytest.importorskip("reasoning_gym")
    from rlhf_torchrl.rewards.functions import extract_tagged_answer, reasoning_gym_score

    prompts = load_prompts("reasoning_gym:basic_arithmetic", column="question", limit=4, seed=3,
                           generator_args={"max_terms": 2, "max_digits": 2})
    again = load_prompts("reasoning_gym:basic_arithmetic", column="question", limit=4, seed=3,
                         generator_args={"max_terms": 2, "max_digits": 2})
    assert [p.text for p in prompts] == [p.text for p in again]  # seeded
    answers = [p.fields["answer"] for p in prompts]
    metadata = [p.fields["metadata"] for p in prompts]
    responses = [f"<answer>{answers[0]}</answer>", f"so the answer is {answers[1]}.",
                 f"#### {answers[2]}", "I do not know"]
    assert reasoning_gym_score([""] * 4, responses, answers, metadata) == [1.0, 1.0, 1.0, 0.0]
    assert extract_tagged_answer("work\n<answer> 7 </answer>\nmore <answer>8</answer>") == "8"
    assert extract_tagged_answer("first line\n\n 42.\n") == "42"
    with pytest.raises(ValueError, match="no task 'no_such_task'"):
        load_prompts("reasoning_gym:no_such_task", limit=2)
    with pytest.raises(ValueError, match="refused data.generator_args"):
        load_prompts("reasoning_gym:basic_arithmetic", limit=2, generator_args={"colour": 1})


def test_task_custom_asks_for_the_data_before_any_work(tmp_path):
    cfg = _compose("task=custom", f"output_dir={tmp_path}",
                   "reward.functions=[rlhf_torchrl.rewards.functions.vader_sentiment]")
    with pytest.raises(ValueError, match=r"data.source must be set"):
        ppo.train(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_truncation_drops_the_oldest_turns_of_a_long_dialogue(tokenizer):
    from rlhf_torchrl.data.prompts import to_prompt

    turn = " ".join(["blah"] * 40)
    transcript = (f"\n\nHuman: {turn}\n\nAssistant: {turn}\n\nHuman: Short question "
                  f"one?\n\nAssistant: Short answer.\n\nHuman: The last question? {turn}"
                  "\n\nAssistant:")
    # the earlier turns alone fit, the whole does not: old context goes before the question
    (fitted,), n = check_prompts([to_prompt(transcript, "Be brief.")], tokenizer,
                                 max_prompt_length=125, truncate=True)
    roles = [m["role"] for m in fitted.messages]
    assert n == 1 and roles == ["system", "user", "assistant", "user"]
    assert fitted.messages[1]["content"] == "Short question one?"
    assert fitted.text == f"The last question? {turn}"  # the turn the policy answers is whole
    # earlier turns that alone overflow: dropped until the last turn is left, then it is cut
    (fitted,), _ = check_prompts([to_prompt(transcript, "Be brief.")], tokenizer,
                                 max_prompt_length=60, truncate=True)
    assert [m["role"] for m in fitted.messages] == ["system", "user"]
    assert fitted.text.endswith("blah blah") and not fitted.text.startswith("The last")


def test_a_templated_prompt_keeps_its_template_through_a_system_prompt_and_a_cut(tmp_path,
                                                                                  tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"post": LONG_POST, "title": "T{x}"}])
    (prompt,) = load_prompts(path, column="post", template="{title}: {prompt} Summary:")
    (fitted,), n = check_prompts([prompt], tokenizer, max_prompt_length=80, truncate=True,
                                 system_prompt="Be brief.")
    assert n == 1 and fitted.messages[0] == {"role": "system", "content": "Be brief."}
    assert fitted.text.startswith("T{x}: ") and fitted.text.endswith("THE END Summary:")
    assert prompt.with_text("plain").template is None  # rewritten by hand: no template any more


def test_arithmetic_tools_preset_composes_with_the_calculator():
    """The calculator preset: episodes of up to 3 turns, the tool shown in the system prompt
    (tests/test_multiturn.py runs the same machinery end to end with a taught tiny model)."""
    cfg = _compose("task=arithmetic_tools", "output_dir=/tmp/unused")
    checks.check_config(cfg)
    assert (cfg.env.max_turns, list(cfg.env.tools)) == (3, ["calculator"])
    assert "<tool name=\"calculator\">" in inputs.system_prompt(cfg)
    assert cfg.eval.accuracy_reward == "gsm8k_correct"
