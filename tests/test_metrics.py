"""Rollout metrics against hand-computed values (TRL / open-instruct definitions)."""

import json

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import keys as K
from rlhf_torchrl.record.metrics import MetricsWriter, rollout_metrics


def _shaped_rollout():
    """Two responses: 3 valid tokens (stopped) and 2 valid tokens (cut short), hand-made values."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    td = TensorDict({
        K.RESPONSE_MASK: mask,
        K.HAS_STOP: torch.tensor([True, False]),
        K.KL: torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.1, 0.0]]),
        K.NON_SCORE_REWARD: torch.tensor([[-0.01, -0.02, -0.03], [-0.05, 0.01, 0.0]]).unsqueeze(-1),
        K.SCORE: torch.tensor([1.0, -2.0]),
        K.RAW_SCORE: torch.tensor([1.0, -1.0]),
        K.ENTROPY: torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.0]]),
        K.VALUE: torch.tensor([[0.2, 0.4, 0.6], [1.0, 3.0, 0.0]]).unsqueeze(-1),
    }, batch_size=[2])
    td.set(("scores", "vader"), torch.tensor([0.5, -0.5]))
    return td


def test_rollout_metrics_by_hand():
    m = rollout_metrics(_shaped_rollout(), kl_coef=0.1)
    # objective/kl: KL summed over each response, averaged over responses: (0.6 + 0.4) / 2
    assert m["objective/kl"] == pytest.approx(0.5)
    # non-score reward -kl_coef * KL, summed per response, averaged: (-0.06 - 0.04) / 2
    assert m["objective/non_score_reward"] == pytest.approx(-0.05)
    # rlhf reward = score + non-score reward per response, averaged: (0.94 - 2.04) / 2
    assert m["objective/rlhf_reward"] == pytest.approx(-0.55)
    assert m["objective/scores"] == pytest.approx(-0.5)  # after the missing-EOS penalty
    assert m["objective/raw_scores"] == pytest.approx(0.0)
    assert m["objective/scores/vader"] == pytest.approx(0.0)
    # entropy summed over each response's valid tokens, averaged: (6 + 1) / 2
    assert m["objective/entropy"] == pytest.approx(3.5)
    assert m["val/num_eos_tokens"] == 1.0
    assert m["val/sequence_lengths"] == pytest.approx(2.5)
    assert m["val/value_mean"] == pytest.approx((1.2 + 4.0) / 5)
    assert m["objective/kl_coef"] == 0.1


def test_metrics_writer_jsonl(tmp_path):
    writer = MetricsWriter(str(tmp_path), logger=None)
    writer.log(0, {"a": 1.0, "b": torch.tensor(2.0)})
    writer.log(1, {"a": float("nan")})
    writer.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"iteration": 0, "a": 1.0, "b": 2.0} and rows[1]["iteration"] == 1


def test_numbers_print_without_a_negative_zero():
    """A KL of -0.0002 (k1 averages to a hair below zero) prints 0.000, as every summary line,
    the progress bar and the evaluation line write it."""
    from rlhf_torchrl.record.metrics import number
    from rlhf_torchrl.trainers.evaluation import format_metrics

    assert f"{-0.0002:.3f}" == "-0.000"  # (what a plain format gives)
    assert number(-0.0002) == "0.000" and number(-0.0002, "+.3f") == "+0.000"
    assert number(-0.0016) == "-0.002" and number(0.25, "+.2f") == "+0.25"
    assert format_metrics({"eval/reference_kl": -0.0001, "eval/score": 0.5}) == (
        "reference_kl 0.000, score 0.500")
