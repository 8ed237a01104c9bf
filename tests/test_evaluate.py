"""``rlhf-torchrl evaluate`` on every prompt of a GSM8K test file in verl's Parquet schema, several
samples per prompt: its pass@k and maj@k recomputed from the responses in eval.json by plain
loops; and a training run's periodic evaluation with several samples on a file of its own."""

import itertools
import json
import logging
import math
import os
import statistics
import sys

import pytest
import torch
from conftest import _save_tiny, _tiny_llama
from test_at_k import _plain_vote as _vote  # the majority vote as a plain loop
from test_data import verl_rows

from rlhf_torchrl.rewards.functions import extract_final_number

pytestmark = pytest.mark.xdist_group("evaluate")

N, K = 4, [1, 2, 4]
#: the test split's questions and answers (3 or 5: the answers the model below writes most)
QUESTIONS = [(f"Tom has {i} apples and buys {i + 1} more. How many has he? Answer after "
              f"\"####\".", "3" if i % 2 else "5") for i in range(6)]


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama that answers with the tokens EOS, "3", "5" and " ", about equally likely:
    answers such as "3", "53 5" or none, some right, some tied, some empty."""
    model = _tiny_llama(tokenizer, tie_word_embeddings=False)
    words = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("3", "5", " 3")]
    assert words[0] != words[1] and len(words[2]) == 2  # one token each, and " " before a digit
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # a large, positive first hidden unit
        model.lm_head.weight.zero_()
        for token in (tokenizer.eos_token_id, words[0][0], words[1][0], words[2][0]):
            model.lm_head.weight[token, 0] = 3.0  # logit ~17 for these four, 0 for the rest
    return _save_tiny(tmp_path_factory.mktemp("digits"), model, tokenizer)


@pytest.fixture(scope="module")
def test_parquet(tmp_path_factory) -> str:
    """GSM8K's test split as verl's examples/data_preprocess/gsm8k.py writes it."""
    datasets = pytest.importorskip("datasets")
    rows = verl_rows([{"prompt": q, "answer": a} for q, a in QUESTIONS])
    path = str(tmp_path_factory.mktemp("gsm8k") / "test.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def _ci95(values):
    return 1.959963984540054 * statistics.stdev(values) / math.sqrt(len(values))


def test_evaluate_command_on_a_verl_test_file(tmp_path, monkeypatch, capsys, digits_dir,
                                              test_parquet):
    from rlhf_torchrl.cli import main

    monkeypatch.chdir(tmp_path)  # outputs/ goes here
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets Hydra's
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        main(["evaluate", "task=gsm8k", f"model.policy={digits_dir}", f"eval.source={test_parquet}",
              f"eval.samples_per_prompt={N}", "eval.temperature=1.0", "eval.max_new_tokens=8",
              "eval.batch_size=8",  # 2 prompts a batch: 3 batches, joined
              "reuse_freed_memory=false"])
    finally:  # Hydra's job logging (a file in the evaluation's folder) leaves with the test
        for handler in logging.root.handlers[:]:
            if handler not in handlers:
                logging.root.removeHandler(handler)
                handler.close()
        logging.root.setLevel(level)
    # a folder named as an evaluation, after the policy; the command says where eval.json went
    folders = list((tmp_path / "outputs" / "evaluate").iterdir())
    assert len(folders) == 1 and folders[0].name.endswith("_" + os.path.basename(digits_dir))
    found = json.loads((folders[0] / "eval.json").read_text())
    assert f"Evaluation written to {folders[0] / 'eval.json'}" in capsys.readouterr().out
    assert not (tmp_path / "outputs" / "ppo").exists()
    assert (found["num_prompts"], found["samples_per_prompt"], found["k"]) == (6, N, K)
    assert found["max_new_tokens"] == 8 and found["temperature"] == 1.0

    # every prompt of the file, N samples each, in order; the verdicts and answers recomputed
    responses = found["responses"]
    assert [r["prompt_index"] for r in responses] == [i for i in range(6) for _ in range(N)]
    correct, answers = [[] for _ in QUESTIONS], [[] for _ in QUESTIONS]
    for r in responses:
        i = r["prompt_index"]
        assert QUESTIONS[i][0] in r["prompt"]
        answer = extract_final_number(r["response"])
        assert r["answer"] == answer
        assert r["correct"] == (answer is not None and answer == float(QUESTIONS[i][1]))
        correct[i].append(float(r["correct"]))
        answers[i].append(answer)
    total = sum(map(sum, correct))
    assert 0 < total < len(responses)  # some right, some wrong: the numbers below say something
    assert found["eval/accuracy"] == pytest.approx(total / len(responses))
    for k in K:
        passed = [1 - math.comb(N - int(sum(c)), k) / math.comb(N, k) for c in correct]
        majority = []
        for a, c in zip(answers, correct):
            subsets = list(itertools.combinations(range(N), k))
            majority.append(sum(_vote([a[i] for i in s], [c[i] for i in s]) for s in subsets)
                            / len(subsets))
        assert found[f"eval/pass@{k}"] == pytest.approx(statistics.mean(passed))
        assert found[f"eval/pass@{k}_ci95"] == pytest.approx(_ci95(passed))
        assert found[f"eval/maj@{k}"] == pytest.approx(statistics.mean(majority))
        assert found[f"eval/maj@{k}_ci95"] == pytest.approx(_ci95(majority))
    assert found["eval/pass@1"] == pytest.approx(found["eval/accuracy"])

    # the report: one page, nothing fetched
    page = (folders[0] / "report.html").read_text()
    assert "<svg id='at_k_plot'" in page and "id='prompts'" in page
    assert f"{found['eval/pass@2']:.3f}" in page and f"{found['eval/maj@4']:.3f}" in page
    assert "src=" not in page and "<link" not in page


def test_training_evaluates_several_samples_on_its_own_file(tmp_path, digits_dir, test_parquet):
    from test_recipe import _cfg, ppo

    datasets = pytest.importorskip("datasets")
    train = str(tmp_path / "train.parquet")
    rows = [{"prompt": f"What is {i} plus 1? Answer after \"####\".", "answer": str(i + 1)}
            for i in range(8)]
    datasets.Dataset.from_list(verl_rows(rows)).to_parquet(train)
    report = ppo.train(_cfg(tmp_path / "run", digits_dir, "task=gsm8k", f"data.source={train}",
                            f"eval.source={test_parquet}", "eval.every=1", "ppo.num_iterations=1",
                            "eval.samples_per_prompt=2", "eval.temperature=1.0",
                            "value_model.init=shared"))
    for found in (report["eval_before"], report["eval_after"]):
        for key in ("eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2", "eval/pass@2_ci95"):
            assert key in found, key
        # k = 1: the share of correct samples, however counted
        assert found["eval/pass@1"] == pytest.approx(found["eval/accuracy"])
        assert found["eval/maj@1"] == pytest.approx(found["eval/accuracy"])
        assert found["eval/pass@1"] <= found["eval/pass@2"] <= 1
    # the test file's 6 prompts, none held out of the 8 training prompts; the report pairs one
    # response of each before and after
    pairs = report["held_out_samples"]
    assert len(pairs) == len({s["prompt"] for s in pairs}) == 6
    assert all("apples" in s["prompt"] for s in pairs)


def test_a_runs_policy_evaluated_with_other_prompt_settings_is_told_which(tmp_path):
    """A run's saved policy evaluated under another task's prompt form (the default task's plain
    six-word openings) gets the overrides that give the prompts it trained on; the folder of
    the evaluation is named after the run."""
    from omegaconf import OmegaConf

    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.evaluate_policy import evaluation_name, trained_settings

    run = tmp_path / "run2"
    (run / "policy").mkdir(parents=True)
    trained = compose([f"output_dir={run}", "task=custom", "data.column=question",
                       "data.template='Q: {prompt}'"])
    (run / "report.json").write_text(json.dumps({"config": OmegaConf.to_container(trained)}))
    default = compose([f"output_dir={tmp_path}/e", f"model.policy={run}/policy"])
    assert trained_settings(default) == [
        "data.column=question", 'data.template="Q: {prompt}"', "data.chat_template=null",
        "data.max_words=null", "data.max_prompt_length=512"]
    suggested = compose([f"output_dir={tmp_path}/e", f"model.policy={run}/policy",
                         *trained_settings(default)])  # (the overrides as printed compose)
    assert trained_settings(suggested) == []
    elsewhere = compose([f"output_dir={tmp_path}/e", f"model.policy={tmp_path}/other/policy"])
    assert trained_settings(elsewhere) == []  # (no run beside it)
    assert evaluation_name("run2/policy") == "run2"
