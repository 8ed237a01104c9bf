"""pass@k, maj@k and their interval against plain loops, brute force over every k-subset and
hand-computed values; the evaluation settings' one-line refusals."""

import copy
import itertools
import math
import random
import statistics

import pytest
import torch

from rlhf_torchrl.config import compose
from rlhf_torchrl.config.evaluate_policy import evaluation_name
from rlhf_torchrl.config.validation import validate
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.at_k import majority_at_k, majority_vote, mean_interval, pass_at_k
from rlhf_torchrl.trainers.evaluation import default_ks


def test_pass_at_k_by_hand_and_against_the_binomial_formula():
    # n = 4, k = 2: 1 - C(4 - c, 2) / 6 = 0, 1 - 3/6, 1 - 1/6, 1, 1
    assert pass_at_k(torch.tensor([0, 1, 2, 3, 4]), 4, 2).tolist() == pytest.approx(
        [0.0, 0.5, 5 / 6, 1.0, 1.0], abs=1e-15)
    assert pass_at_k(torch.tensor([3]), 8, 1).item() == pytest.approx(3 / 8)  # pass@1 = c / n
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        c, k = rng.randint(0, n), rng.randint(1, n)
        plain = 1 - math.comb(n - c, k) / math.comb(n, k)  # math.comb(m, k) = 0 for k > m
        assert pass_at_k(torch.tensor([c]), n, k).item() == pytest.approx(plain, abs=1e-12)
    # one n per prompt
    got = pass_at_k(torch.tensor([1, 1]), torch.tensor([2, 4]), 2).tolist()
    assert got == pytest.approx([1.0, 0.5])
    with pytest.raises(ValueError, match="1 <= k <= the samples per prompt"):
        pass_at_k(torch.tensor([1]), 4, 5)


def _plain_vote(answers, correct):
    """The majority answer's correctness, ties averaged, unanswered samples not voting: a loop."""
    counts = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return 0.0
    top = max(counts.values())
    winners = [a for a in counts if counts[a] == top]
    verdict = {a: ok for a, ok in zip(answers, correct)}
    return sum(verdict[a] for a in winners) / len(winners)


def test_majority_vote_by_hand():
    assert majority_vote([7, 7, 3, None, None], [1, 1, 0, 0, 0]) == 1.0  # None does not vote
    assert majority_vote([7, 3], [1, 0]) == 0.5  # a tie: each winner half
    assert majority_vote([7, 3, 4], [1, 0, 0]) == pytest.approx(1 / 3)
    assert majority_vote([None, None], [0, 0]) == 0.0  # no answer: wrong
    assert majority_vote([3, 3, 7], [0, 0, 1]) == 0.0


def test_majority_at_k_is_the_mean_over_every_k_subset():
    # by hand: 7 (right) twice, 3 (wrong) three times; k = 3: 7 wins {7, 7, 3}, 3 of the 10 triples
    assert majority_at_k([7, 7, 3, 3, 3], [1, 1, 0, 0, 0], 3) == pytest.approx(0.3)
    # k = 2: {7, 7} wins (1 pair), {7, 3} ties (6 pairs, half each): (1 + 3) / 10
    assert majority_at_k([7, 7, 3, 3, 3], [1, 1, 0, 0, 0], 2) == pytest.approx(0.4)
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(1, 9)
        pool = [None, 1.0, 2.0, 3.0, "x"][: rng.randint(1, 5)]
        answers = [rng.choice(pool) for _ in range(n)]
        right = rng.choice([1.0, 2.0, "x", None])
        correct = [float(a is not None and a == right) for a in answers]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(_plain_vote([answers[i] for i in s], [correct[i] for i in s])
                        for s in subsets) / len(subsets)
            assert majority_at_k(answers, correct, k) == pytest.approx(brute, abs=1e-12), (answers, k)
    # many samples: every state a probability, no overflow; one answer of two halves ties at k = n
    assert majority_at_k([1] * 300 + [2] * 300, [1.0] * 300 + [0.0] * 300, 600) == 0.5
    assert majority_at_k([1] * 300 + [2] * 300, [1.0] * 300 + [0.0] * 300, 64) == pytest.approx(0.5)


def test_mean_interval_by_hand():
    # values 1, 0, 1, 0: s = sqrt(1/3), 95%: z = 1.95996 -> 1.95996 * 0.57735 / 2
    mean, half = mean_interval([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and half == pytest.approx(1.959963984540054 * math.sqrt(1 / 3) / 2)
    assert mean_interval([0.25]) == (0.25, None)  # one prompt: no spread to measure
    values = [0.1, 0.4, 0.35, 0.8, 0.0]
    z90 = statistics.NormalDist().inv_cdf(0.95)
    assert mean_interval(values, 0.9)[1] == pytest.approx(z90 * statistics.stdev(values) / 5**0.5)


def test_default_ks_and_the_evaluation_folder_name():
    assert default_ks(1) == [] and default_ks(2) == [1, 2] and default_ks(8) == [1, 2, 4, 8]
    assert default_ks(6) == [1, 2, 4, 6]
    assert evaluation_name("outputs/ppo/gsm8k/2026-11-24_10-00-00/policy") == "gsm8k_2026-11-24_10-00-00"
    assert evaluation_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"
    assert evaluation_name("/models/my model/") == "my-model"


BAD_SETTINGS = [
    ({"samples_per_prompt": 4, "k": [1, 8]},
     r"eval.k=\[1,8\]: 8 is outside \[1, eval.samples_per_prompt=4\] .*raise eval.samples_per_prompt"),
    ({"samples_per_prompt": 4, "k": [0]}, r"eval.k=\[0\]: 0 is outside"),
    ({"samples_per_prompt": 4, "k": []}, r"eval.k=\[\] is empty"),
    ({"samples_per_prompt": 4, "k": [2], "accuracy_reward": None},
     r"eval.k=\[2\] needs eval.accuracy_reward"),
    ({"samples_per_prompt": 0}, r"eval.samples_per_prompt=0 is out of range: it must be >= 1"),
    ({"max_new_tokens": 0}, r"eval.max_new_tokens=0 is out of range"),
    ({"batch_size": 0}, r"eval.batch_size=0 is out of range"),
]


def test_bad_evaluation_settings_get_one_line():
    from omegaconf import OmegaConf

    base = compose(["task=gsm8k", "output_dir=/tmp/unused"])  # composed once: it takes a second
    for settings, message in BAD_SETTINGS:
        cfg = copy.deepcopy(base)
        for key, value in settings.items():
            OmegaConf.update(cfg, f"eval.{key}", value)
        with pytest.raises(ConfigError, match=message) as error:
            validate(cfg)
        assert "\n" not in str(error.value)
    OmegaConf.update(base, "eval.samples_per_prompt", 4)
    OmegaConf.update(base, "eval.k", [1, 4])
    validate(base)  # the fixed settings pass
