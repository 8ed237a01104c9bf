"""Process rewards (issue 49, item 2): steps split and placed on their last tokens, against plain
loops with a real tokenizer and multi-byte text; the per-token rewards through the shaper and GAE
against hand-computed values; the critic-free estimators on them; both styles of process reward
model on tiny models built from config; the refusals; the recipe end to end."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.data.rollout import probe_rollout
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import (
    GRPOAdvantage,
    ReinforcePPAdvantage,
    ResponseGAE,
    RLOOAdvantage,
)
from rlhf_torchrl.objectives.kl_shaping import FixedKLController, KLRewardShaper
from rlhf_torchrl.rewards.functions import arithmetic_steps, evaluate_arithmetic
from rlhf_torchrl.rewards.process import ProcessRewardModel
from rlhf_torchrl.rewards.scoring import Scorer
from rlhf_torchrl.rewards.steps import StepRewards, StepSplit, token_text_ends

ROOT = Path(__file__).resolve().parents[1]

#: responses with multi-byte characters split over several tokens (✓ 3 bytes, 学 3, 🙂 4, é 2)
MULTI_BYTE = [
    "12 + 7 = 19 ✓\n数学: 3 × 4 = 12 🙂\n\nÉtape ки\n#### 19",
    "  leading blanks\n\n\ntrailing blanks   \n",
    "one line, no delimiter",
    "🙂🙂\n✓\né",
    "",
]


def _rollout(tokenizer, responses, stopped=None):
    return probe_rollout(["Calculate 2 + 3."] * len(responses), tokenizer, responses,
                         stopped=stopped if stopped is not None else [True] * len(responses))


# ---- splitting -----------------------------------------------------------------------------------

def test_steps_split_by_delimiter_by_hand():
    split = StepSplit()
    text = "  2 + 3 = 5 \n\n5 * 2 = 10\n \n#### 10\n"
    assert split.texts(text) == ["2 + 3 = 5", "5 * 2 = 10", "#### 10"]
    assert split.spans(text) == [(2, 11), (14, 24), (27, 34)]
    assert [text[s:e] for s, e in split.spans(text)] == split.texts(text)
    assert split.texts("") == [] and split.texts(" \n \n") == []
    assert StepSplit("\n\n").texts("a\nb\n\nc") == ["a\nb", "c"]
    assert StepSplit(" ки").texts("a ки\nb ки") == ["a", "b"]


def test_steps_split_by_marker_by_hand():
    split = StepSplit(marker=r"Step \d+:")
    assert split.texts("Let me see. Step 1: 2 + 3 = 5\nStep 2: 5 * 2 = 10 ") == [
        "Let me see.", "Step 1: 2 + 3 = 5", "Step 2: 5 * 2 = 10"]
    assert split.texts("Step 1: a Step 2: b") == ["Step 1: a", "Step 2: b"]
    assert split.texts("no marker at all") == ["no marker at all"]


def test_step_split_from_the_command_line(tmp_path):
    """A command line cannot type a newline: reward.step_delimiter='\\n\\n' is a blank line."""
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.components import step_split

    cfg = compose([f"output_dir={tmp_path}", r"reward.step_delimiter='\n\n'",
                   r"reward.step_marker=null"])
    assert step_split(cfg).texts("a\nb\n\nc") == ["a\nb", "c"]
    cfg = compose([f"output_dir={tmp_path}", r"reward.step_marker='Step \d+:'"])
    assert step_split(cfg).texts("Step 1: a Step 2: b") == ["Step 1: a", "Step 2: b"]
    assert step_split(compose([f"output_dir={tmp_path}"])) == StepSplit("\n")


@pytest.mark.parametrize("kwargs, match", [
    (dict(delimiter=""), "reward.step_delimiter is empty"),
    (dict(marker="Step ("), "reward.step_marker='Step \\(' is not a regular expression"),
    (dict(marker="x*"), "matches the empty text"),
])
def test_bad_step_splits_get_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        StepSplit(**kwargs)
    assert "\n" not in str(e.value)


# ---- token placement -----------------------------------------------------------------------------

def _ends_by_prefixes(tokenizer, ids, text):
    """The definition, as a plain loop: characters of the text each prefix of tokens has written."""
    ends = []
    for t in range(len(ids)):
        prefix = tokenizer.decode(ids[:t + 1], skip_special_tokens=True)
        n = 0
        while n < min(len(prefix), len(text)) and prefix[n] == text[n]:
            n += 1
        ends.append(max([n, *ends[-1:]]))
    return ends


def test_token_text_ends_match_the_prefix_loop_on_multi_byte_text(tokenizer):
    for text in MULTI_BYTE:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert token_text_ends(tokenizer, ids) == _ends_by_prefixes(tokenizer, ids, decoded), text
    # the windowed decoding serves these texts (one batch of windows, no prefix decoding)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def batch_decode(self, seqs, **kwargs):
            calls.append(max(map(len, seqs)))
            return tokenizer.batch_decode(seqs, **kwargs)

    ids = tokenizer(MULTI_BYTE[0], add_special_tokens=False)["input_ids"]
    token_text_ends(Counting(), ids)
    assert len(ids) > 20 and calls == [9]  # windows of at most 8 + 1 tokens
    # a character split over tokens counts from the token that completes it: ✓ is 2-3 tokens here
    ids = tokenizer("a✓b", add_special_tokens=False)["input_ids"]
    assert len(ids) > 3 and token_text_ends(tokenizer, ids)[-2:] == [2, 3]
    assert token_text_ends(tokenizer, ids)[:len(ids) - 2] == [1] * (len(ids) - 2)


def test_token_text_ends_on_random_tokens_and_special_tokens(tokenizer):
    """Token ids a policy may sample: bytes that never form a character, special tokens inside."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, len(tokenizer), (24,), generator=gen).tolist()
        ids[5] = tokenizer.eos_token_id
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert token_text_ends(tokenizer, ids) == _ends_by_prefixes(tokenizer, ids, text)


def _last_token_loop(tokenizer, ids, mask, text, spans):
    """Each step's last token, as a plain loop: the first token after which the decoded response
    starts with the text up to the step's end."""
    positions = [t for t in range(len(ids)) if mask[t]]
    out = []
    for _, end in spans:
        for k in range(len(positions)):
            prefix = tokenizer.decode([ids[p] for p in positions[:k + 1]], skip_special_tokens=True)
            if prefix.startswith(text[:end]):
                out.append(positions[k])
                break
    return out


def test_step_values_land_on_each_steps_last_token(tokenizer):
    rollout = _rollout(tokenizer, MULTI_BYTE, stopped=[True, False, True, True, True])
    texts = rollout.get(K.RESPONSE_TEXT).tolist()
    split = StepSplit()
    values = [[float(10 * i + k + 1) for k in range(len(split.spans(t)))] for i, t in enumerate(texts)]
    placed = StepRewards(tokenizer, split).to_tokens("r", values, rollout)
    tokens, mask = rollout.get(K.RESPONSE_TOKENS), rollout.get(K.RESPONSE_MASK)
    assert placed.shape == mask.shape and placed.dtype == torch.float32
    for i, text in enumerate(texts):
        expected = torch.zeros(mask.shape[1])
        for j, v in zip(_last_token_loop(tokenizer, tokens[i].tolist(), mask[i].tolist(), text,
                                         split.spans(text)), values[i]):
            expected[j] += v
        assert torch.equal(placed[i], expected), text
    # by hand: row 0's steps end on "✓" (completed by its last byte), "🙂", "ки" and "19"
    row = tokens[0].tolist()
    ends = [j for j in range(mask.shape[1]) if placed[0, j] != 0]
    assert [tokenizer.decode(row[:j + 1]) for j in ends] == [
        "12 + 7 = 19 ✓", "12 + 7 = 19 ✓\n数学: 3 × 4 = 12 🙂", "12 + 7 = 19 ✓\n数学: 3 × 4 = 12 🙂\n\nÉtape ки",
        MULTI_BYTE[0]]
    assert placed[4].abs().sum() == 0  # no steps


def test_step_values_of_a_multi_turn_episode_land_in_the_policy_turns(tokenizer):
    """Two policy turns with a tool's tokens between: the text is the turns joined by "\\n"."""
    first = tokenizer("2 + 3 = 5", add_special_tokens=False)["input_ids"]
    tool = tokenizer("<tool>5</tool>", add_special_tokens=False)["input_ids"]
    second = tokenizer("so 5 * 2 = 10\n#### 10", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([first + tool + second])
    mask = torch.tensor([[True] * len(first) + [False] * len(tool) + [True] * len(second)])
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    td = TensorDict({K.RESPONSE_TOKENS: ids, K.RESPONSE_MASK: mask}, batch_size=[1])
    td.set(K.RESPONSE_TEXT, NonTensorStack(NonTensorData("2 + 3 = 5\nso 5 * 2 = 10\n#### 10")))
    placed = StepRewards(tokenizer).to_tokens("r", [[1.0, 2.0, 3.0]], td)
    at = placed[0].nonzero().flatten().tolist()
    assert at == [len(first) - 1, len(first) + len(tool) + len(tokenizer("so 5 * 2 = 10", add_special_tokens=False)["input_ids"]) - 1,
                  ids.shape[1] - 1]
    assert placed[0, at].tolist() == [1.0, 2.0, 3.0]


# ---- the scorer ----------------------------------------------------------------------------------

SEEN: dict = {}


def count_steps(prompts, responses, steps):
    """A step reward: each step's value is its number (1, 2, ...)."""
    SEEN["steps"] = steps
    return [[float(k + 1) for k in range(len(row))] for row in steps]


def test_scorer_keeps_step_rewards_out_of_the_score(tokenizer):
    rollout = _rollout(tokenizer, ["2 + 3 = 5\n#### 5", "#### 6", ""])
    outcome = lambda prompts, responses: [1.0, 0.0, 0.5]  # noqa: E731
    scorer = Scorer({"outcome": (outcome, 2.0), "steps": (count_steps, 0.5)},
                    steps=StepRewards(tokenizer))
    scorer(rollout)
    assert SEEN["steps"] == [["2 + 3 = 5", "#### 5"], ["#### 6"], []]
    assert rollout.get(K.SCORE).tolist() == [2.0, 0.0, 1.0]
    assert rollout.get(("scores", "steps")).tolist() == [3.0, 1.0, 0.0]  # each response's sum
    step = rollout.get(K.STEP_REWARD)
    assert step.sum(-1).tolist() == [1.5, 0.5, 0.0]  # weighted
    assert sorted(step[0][step[0] != 0].tolist()) == [0.5, 1.0]


@pytest.mark.parametrize("fn, match", [
    (lambda p, r, steps: [[0.0] * (len(s) + 1) for s in steps],
     r"Reward 'bad' returned 3 step values for row 0, which has 2 steps \(reward.step_delimiter='\\n'\)"),
    (lambda p, r, steps: [[0.0] * len(steps[0]), 1.0],
     "Reward 'bad' returned a list per response for some rows and a float for row 1"),
    (lambda p, r, steps: [[0.0] * len(s) for s in steps][:1], "returned 1 lists of step values for 2"),
    (lambda p, r, steps: [[float("nan")] * len(s) for s in steps], "non-finite step value"),
    (lambda p, r, steps: [["x"] * len(s) for s in steps], "not floats"),
])
def test_wrong_step_rewards_get_one_line_naming_the_reward_and_row(tokenizer, fn, match):
    rollout = _rollout(tokenizer, ["2 + 3 = 5\n#### 5", "#### 6"])
    scorer = Scorer({"bad": (fn, 1.0)}, steps=StepRewards(tokenizer))
    with pytest.raises(ConfigError, match=match) as e:
        scorer.check(rollout)
    assert "\n" not in str(e.value)


def test_a_step_reward_without_a_tokenizer_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="steps=StepRewards"):
        Scorer({"steps": (count_steps, 1.0)})(_rollout(tokenizer, ["a\nb"]))


# ---- shaping and advantages ----------------------------------------------------------------------

def _shaped(step_reward, score, mask, log_prob=None, kl_coef=1.0):
    from tensordict import TensorDict

    n, r = mask.shape
    log_prob = torch.zeros(n, r) if log_prob is None else log_prob
    td = TensorDict({K.LOG_PROB: log_prob, K.REF_LOG_PROB: torch.zeros(n, r), K.RESPONSE_MASK: mask,
                     K.SCORE: score, K.STEP_REWARD: step_reward, K.GROUP: torch.zeros(n, dtype=torch.long)},
                    batch_size=[n])
    return KLRewardShaper(FixedKLController(kl_coef))(td)


def test_gae_on_step_rewards_by_hand():
    """Row 0: a step worth 0.5 ending at token 1, the score 1.0 at token 3, KL 0.1 at token 0;
    V = [0.1, 0.2, 0.3, 0.4], gamma 1, lambda 0.5. By hand: rewards [-0.1, 0.5, 0, 1],
    deltas [0, 0.6, 0.1, 0.6], A = [0.4, 0.8, 0.4, 0.6], returns = A + V = [0.5, 1.0, 0.7, 1.0].
    Row 1 (two tokens and two pads, a step value on a pad that must be dropped): rewards
    [0.25, 2 + 0] -> deltas [0.25 + 0.2 - 0.1, 2 - 0.2] = [0.35, 1.8], A = [0.35 + 0.9, 1.8]."""
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    step = torch.tensor([[0.0, 0.5, 0.0, 0.0], [0.25, 0.0, 0.0, 7.0]])
    log_prob = torch.tensor([[0.1, 0.0, 0.0, 0.0], [0.0] * 4])
    td = _shaped(step, torch.tensor([1.0, 2.0]), mask, log_prob)
    assert torch.allclose(td.get(K.REWARD).squeeze(-1),
                          torch.tensor([[-0.1, 0.5, 0.0, 1.0], [0.25, 2.0, 0.0, 0.0]]))
    assert torch.allclose(td.get(K.SHAPED_SCORE), torch.tensor([1.5, 2.25]))
    td.set(K.VALUE, torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.0, 0.0]]).unsqueeze(-1))
    ResponseGAE(gamma=1.0, lmbda=0.5, whiten_advantages=False)(td)
    assert torch.allclose(td.get(K.ADVANTAGE).squeeze(-1),
                          torch.tensor([[0.4, 0.8, 0.4, 0.6], [1.25, 1.8, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(td.get(K.VALUE_TARGET).squeeze(-1),
                          torch.tensor([[0.5, 1.0, 0.7, 1.0], [1.35, 2.0, 0.0, 0.0]]), atol=1e-6)


def test_group_baselines_sum_the_step_rewards_and_reinforce_pp_takes_them_per_token():
    """GRPO and RLOO compare one number per response: with step rewards they give what they give
    for those steps summed into the score. REINFORCE++'s returns-to-go credit each step where it
    ends: rewards [0, 0.5, 0, 1] -> returns-to-go [1.5, 1.5, 1, 1], then whitened."""
    mask = torch.tensor([[True] * 4, [True] * 4, [True, True, True, False]])
    step = torch.tensor([[0.0, 0.5, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [0.25, 0.25, 0.0, 0.0]])
    score = torch.tensor([1.0, 0.0, 0.5])
    for estimator in (GRPOAdvantage(), RLOOAdvantage()):
        with_steps = estimator(_shaped(step, score, mask)).get(K.ADVANTAGE)
        summed = estimator(_shaped(torch.zeros_like(step), score + step.sum(-1), mask)).get(K.ADVANTAGE)
        assert torch.allclose(with_steps, summed), type(estimator).__name__
    adv = ReinforcePPAdvantage()(_shaped(step, score, mask)).get(K.ADVANTAGE).squeeze(-1)
    returns = torch.tensor([[1.5, 1.5, 1.0, 1.0], [-1.0, -1.0, -1.0, 0.0], [1.0, 0.75, 0.5, 0.0]])
    valid = returns[mask]
    expected = (returns - valid.mean()) / (valid.var() + 1e-8).sqrt()
    assert torch.allclose(adv[mask], expected[mask], atol=1e-5)


# ---- the per-step arithmetic verifier ------------------------------------------------------------

def test_evaluate_arithmetic_by_hand():
    assert evaluate_arithmetic("2 + 3 * 4") == 14.0
    assert evaluate_arithmetic("10 - 4 - 3") == 3.0
    assert evaluate_arithmetic("8 / 2 / 2") == 2.0
    assert evaluate_arithmetic("2 × 3 ÷ 4") == 1.5
    assert evaluate_arithmetic("-3 + 5") == 2.0
    assert evaluate_arithmetic("1.5 + 2.25") == 3.75
    assert evaluate_arithmetic("5 / 0") is None and evaluate_arithmetic("two + 3") is None


def test_arithmetic_steps_by_hand():
    steps = [
        ["66 + 46 = 112", "#### 112"],  # right: +1
        ["66 + 46 = 102", "#### 102"],  # wrong: -1
        ["12 + 7 = 19", "19 - 4 = 16", "#### 16"],  # one right, one wrong, of two: +-0.5
        ["To add them: 66+46=112, and 112 - 10 = 102.", "So 2 + 3 * 4 = 20"],  # all right / wrong
        ["no arithmetic here"],
        [],
        ["3 × 4 = 12", "12 / 0 = 0", "1.5 + 2.25 = 3.75"],
    ]
    assert arithmetic_steps([""] * len(steps), [""] * len(steps), steps) == [
        [1.0, 0.0], [-1.0, 0.0], [0.5, -0.5, 0.0], [0.5, -0.5], [0.0], [], [1 / 3, -1 / 3, 1 / 3]]


def test_arithmetic_steps_through_the_scorer(tokenizer):
    from rlhf_torchrl.rewards.functions import gsm8k_correct

    rollout = _rollout(tokenizer, ["66 + 46 = 112\n#### 112", "66 + 46 = 102\n#### 102"])
    from tensordict import NonTensorData, NonTensorStack

    rollout.set((K.DATA, "answer"), NonTensorStack(NonTensorData("112"), NonTensorData("112")))
    scorer = Scorer({"gsm8k_correct": (gsm8k_correct, 1.0), "arithmetic_steps": (arithmetic_steps, 0.5)},
                    steps=StepRewards(tokenizer))
    scorer(rollout)
    assert rollout.get(K.SCORE).tolist() == [1.0, 0.0]
    assert rollout.get(K.STEP_REWARD).sum(-1).tolist() == [0.5, -0.5]
    tokens = rollout.get(K.RESPONSE_TOKENS)[0].tolist()
    at = int(rollout.get(K.STEP_REWARD)[0].nonzero())
    assert tokenizer.decode(tokens[:at + 1]) == "66 + 46 = 112"


# ---- process reward models -----------------------------------------------------------------------

QUESTION = "Calculate 66 + 46."
STEPS = [["66 + 46 = 112", "#### 112"], [], ["60 + 40 = 100 ✓", "100 + 12 = 112", "#### 112"]]


def _trained_bpe(path):
    """A real byte-level BPE tokenizer trained here on a few lines: not the policy's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([QUESTION, *(s for row in STEPS for s in row), "Step 1: add them"] * 4,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def _tiny_config(cls, tokenizer, **extra):
    return cls(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=tokenizer.pad_token_id, **extra)


@pytest.fixture(scope="module")
def token_prm_dir(tmp_path_factory):
    """A tiny random Llama token classifier (2 labels) with a BPE tokenizer of its own."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    path = tmp_path_factory.mktemp("token_prm")
    tok = _trained_bpe(path)
    torch.manual_seed(0)
    LlamaForTokenClassification(_tiny_config(LlamaConfig, tok, num_labels=2)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tag_prm_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama LM with SmolLM2's tokenizer plus Math-Shepherd's step tag "ки" (a
    vocabulary that differs from the policy's)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tag_prm")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_tokens(["ки"])
    tok.save_pretrained(path)
    torch.manual_seed(1)
    LlamaForCausalLM(_tiny_config(LlamaConfig, tok)).save_pretrained(path)
    return str(path)


def test_token_classification_prm_scores_each_steps_last_token(token_prm_dir):
    """Each step's score, P(label 1) at the last token of "step + separator" in TRL's layout,
    equals the model's on the input cut after that step (a causal model: nothing later is seen)."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    prm = ProcessRewardModel.from_pretrained(token_prm_dir, batch_size=2)
    assert prm.style == "token_classification"
    scores = prm([QUESTION] * 3, [""] * 3, steps=STEPS)
    assert [len(s) for s in scores] == [2, 0, 3]
    model = AutoModelForTokenClassification.from_pretrained(token_prm_dir).eval()
    tok = AutoTokenizer.from_pretrained(token_prm_dir)
    for row, steps in enumerate(STEPS):
        for k in range(len(steps)):
            ids = [tok.bos_token_id, *tok(QUESTION, add_special_tokens=False)["input_ids"]]
            for step in steps[:k + 1]:
                ids += tok(step + "\n", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            assert math.isclose(scores[row][k], float(logits.softmax(-1)[1]), abs_tol=1e-5)


def test_token_classification_prm_with_one_label_gives_the_sigmoid(token_prm_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForTokenClassification

    tok = AutoTokenizer.from_pretrained(token_prm_dir)
    torch.manual_seed(0)
    model = LlamaForTokenClassification(_tiny_config(LlamaConfig, tok, num_labels=1)).eval()
    prm = ProcessRewardModel(model, tok)
    ids, positions = prm.encode(QUESTION, STEPS[0])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, positions, 0]
    assert torch.allclose(torch.tensor(prm([QUESTION], [""], steps=[STEPS[0]])[0]), logits.sigmoid())


def test_step_tag_prm_scores_good_against_bad_at_each_tag(tag_prm_dir):
    """Math-Shepherd's input, f"{question} {step} ки\\n{step} ки"; each step's score,
    softmax([good, bad]) at its tag, equals the model's on the text cut after that tag."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prm = ProcessRewardModel.from_pretrained(tag_prm_dir)
    assert prm.style == "step_tag"
    scores = prm([QUESTION] * 3, [""] * 3, steps=STEPS)
    assert [len(s) for s in scores] == [2, 0, 3]
    model = AutoModelForCausalLM.from_pretrained(tag_prm_dir).eval()
    tok = AutoTokenizer.from_pretrained(tag_prm_dir)
    good, bad = tok("+", add_special_tokens=False)["input_ids"][0], tok("-", add_special_tokens=False)["input_ids"][0]
    for row, steps in enumerate(STEPS):
        for k in range(len(steps)):
            text = QUESTION + " " + "\n".join(f"{s} ки" for s in steps[:k + 1])
            ids = tok(text)["input_ids"]
            assert tok.convert_ids_to_tokens(ids[-1]) == "ки"
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            assert math.isclose(scores[row][k], float(logits[[good, bad]].softmax(-1)[0]), abs_tol=1e-5)
    # in a run, its question is the prompt's last user message, without the policy's chat template
    rollout = _rollout(tok, ["66 + 46 = 112\n#### 112"])
    assert "<|im_start|>" in rollout.get(K.PROMPT_TEXT).tolist()[0]
    assert prm(rollout.get(K.PROMPT_TEXT).tolist(), [""], steps=[STEPS[0]], tensordict=rollout) == \
        prm.score_steps(["Calculate 2 + 3."], [STEPS[0]])


def _cfg(tmp_path, *overrides):
    from rlhf_torchrl.config import compose

    return compose([f"output_dir={tmp_path}", *overrides])


def test_prm_kind_places_its_scores_on_the_policys_tokens(tmp_path, tokenizer, tag_prm_dir):
    """A prm: entry of reward.functions, built by its kind, its step scores on the policy's
    tokens (another tokenizer: the steps are tokenised again by the PRM's)."""
    from rlhf_torchrl.config.components import make_reward_functions, make_scorer

    cfg = _cfg(tmp_path, f"reward.functions=[prm:{tag_prm_dir}]", "reward.prm_prompt_column=question",
               "device=cpu")
    functions = make_reward_functions(cfg)
    assert list(functions) == ["prm"]
    scorer = make_scorer(cfg, functions, torch.device("cpu"), tokenizer=tokenizer)
    rollout = _rollout(tokenizer, ["66 + 46 = 112\n#### 112", "", "60 + 40 = 100 ✓\n100 + 12 = 112\n#### 112"])
    from tensordict import NonTensorData, NonTensorStack

    rollout.set((K.DATA, "question"), NonTensorStack(*[NonTensorData(QUESTION)] * 3))
    scorer(rollout)
    expected = functions["prm"][0].score_steps([QUESTION] * 3, STEPS)
    placed = rollout.get(K.STEP_REWARD)
    for row in range(3):
        assert torch.allclose(placed[row][placed[row] != 0], torch.tensor(expected[row]))
    assert rollout.get(K.SCORE).tolist() == [0.0, 0.0, 0.0]


def test_prm_refusals_are_one_line(tmp_path, tag_prm_dir, token_prm_dir, tiny_llama_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForTokenClassification

    from rlhf_torchrl.config.components import make_reward_functions

    def refused(*overrides, match):
        with pytest.raises(ConfigError, match=match) as e:
            make_reward_functions(_cfg(tmp_path, "device=cpu", *overrides))
        assert "\n" not in str(e.value), str(e.value)

    refused(f"reward.functions=[prm:{tmp_path}/no_such_model]",
            match=r"Process reward model 'prm' \(.*no_such_model\) cannot be loaded")
    refused(f"reward.functions=[prm:{tag_prm_dir}]", "reward.prm_step_tag='<step>'",
            match="reward.prm_step_tag='<step>' is not a token of its vocabulary")
    refused(f"reward.functions=[prm:{tag_prm_dir}]", "reward.prm_good_token='good!'",
            match="reward.prm_good_token='good!' is not a token")
    refused(f"reward.functions=[prm:{token_prm_dir}]", "reward.prm_step_separator=''",
            match="reward.prm_step_separator='' has no tokens")
    refused("reward.functions=[prm:]", match="names no model")
    # a sequence classifier is no PRM; a token classifier of 3 labels neither
    from transformers import LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(token_prm_dir)
    seq = tmp_path / "seq"
    LlamaForSequenceClassification(_tiny_config(LlamaConfig, tok, num_labels=1)).save_pretrained(seq)
    tok.save_pretrained(seq)
    refused(f"reward.functions=[prm:{seq}]", match="is a LlamaForSequenceClassification: a PRM is a token classifier")
    three = tmp_path / "three"
    LlamaForTokenClassification(_tiny_config(LlamaConfig, tok, num_labels=3)).save_pretrained(three)
    tok.save_pretrained(three)
    refused(f"reward.functions=[prm:{three}]", match="classifies tokens into 3 labels")


def test_step_tag_that_merges_in_context_is_refused_naming_the_row(tag_prm_dir):
    """A tag the tokenizer merges with the text around it cannot be found by id: one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tag_prm_dir)
    assert len(tok("ing", add_special_tokens=False)["input_ids"]) == 1  # " ing" is another token
    prm = ProcessRewardModel(AutoModelForCausalLM.from_pretrained(tag_prm_dir), tok, step_tag="ing")
    from rlhf_torchrl.rewards.scoring import RewardError

    with pytest.raises(RewardError, match="row 1's input holds 0 step tags 'ing' .* for 1 steps") as e:
        prm([QUESTION] * 2, [""] * 2, steps=[[], ["adding them"]])
    assert "\n" not in str(e.value)


# ---- the recipe ----------------------------------------------------------------------------------

def test_recipe_trains_on_process_rewards(tmp_path, tiny_llama_dir, tag_prm_dir):
    """The arithmetic task with GAE on three rewards: the outcome, the per-step verifier and a
    step-tag PRM of another vocabulary; two iterations, the step rewards logged and in the reward."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import ppo

    cfg = _cfg(tmp_path, "task=arithmetic", f"model.policy={tiny_llama_dir}", "model.packing=false",
               "reward.functions=[rlhf_torchrl.rewards.functions.gsm8k_correct,"
               f"rlhf_torchrl.rewards.functions.arithmetic_steps,prm:{tag_prm_dir}]",
               "reward.function_weights=[1.0,0.5,0.5]",
               "ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
               "ppo.forward_batch_size=4", "generation.max_new_tokens=8", "data.limit=12",
               "eval.num_prompts=4", "eval.every=0", "logging.progress_bar=false",
               "logging.save_model=false", "checkpoint.every=0", "model.autocast=null",
               "reuse_freed_memory=false", "optim.lr=1e-3", "device=cpu")
    ppo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        for name in ("objective/step_reward", "objective/scores/prm", "objective/scores/arithmetic_steps",
                     "loss/value_avg", "val/explained_variance"):
            assert math.isfinite(row[name]), name
        # the PRM's probabilities on every response with a step: its sum is positive
        assert row["objective/scores/prm"] > 0
        assert row["objective/step_reward"] != 0
