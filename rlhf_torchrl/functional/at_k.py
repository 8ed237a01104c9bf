"""pass@k and maj@k from ``n`` sampled answers per prompt, and a confidence interval over prompts.

Both estimate what ``k`` samples of the policy would score, from ``n >= k`` samples: pass@k with
Chen et al. (2021)'s unbiased estimator, maj@k as the exact mean over every ``k``-subset of the
``n`` samples (no subset is drawn at random: the same answers always give the same number).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np
import torch


def pass_at_k(num_correct: torch.Tensor, num_samples: int | torch.Tensor, k: int) -> torch.Tensor:
    """The chance that at least one of ``k`` samples is correct, per prompt, estimated without bias
    from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1)::

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    The product form never forms a binomial coefficient (the paper's numerically stable version);
    it is 1 exactly when ``n - c < k`` (every ``k``-subset holds a correct sample).

    Args:
        num_correct: ``c``, each prompt's correct samples.
        num_samples: ``n``, the samples per prompt (one for all, or one per prompt).
        k: the samples the estimate is for, ``1 <= k <= n``.

    Shapes: ``num_correct`` (P,), ``num_samples`` () or (P,); returns (P,) float64.

    Example:
        >>> pass_at_k(torch.tensor([0, 1, 2, 4]), 4, 2)  # 1 - C(3, 2) / C(4, 2) = 0.5 for c = 1
        tensor([0.0000, 0.5000, 0.8333, 1.0000], dtype=torch.float64)
    """
    c = torch.as_tensor(num_correct, dtype=torch.float64)
    n = torch.as_tensor(num_samples, dtype=torch.float64, device=c.device).expand_as(c)
    if c.numel() == 0:
        return c.clone()
    if not 1 <= k <= n.min():
        raise ValueError(f"pass@{k} needs 1 <= k <= the samples per prompt ({int(n.min())} at the "
                         "fewest): sample more, or lower k.")
    if (c < 0).any() or (c > n).any():
        raise ValueError("pass@k: a prompt's correct samples must be between 0 and its samples.")
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64, device=c.device)  # (n_max,)
    # the factors (1 - k / i) for i in (n - c, n]; 1 elsewhere
    in_product = (i > (n - c)[:, None]) & (i <= n[:, None])  # (P, n_max)
    factors = torch.where(in_product, 1.0 - k / i, torch.ones_like(i))
    return 1.0 - factors.prod(-1)


def majority_vote(answers: Sequence[Hashable | None], correct: Sequence[float]) -> float:
    """The correctness of the answer given most often among ``answers`` (maj@k of one set of
    ``k`` samples).

    A sample whose answer could not be read (``None``) does not vote; when no sample gives an
    answer the vote is wrong (0). An answer's correctness is the mean of its samples' ``correct``
    (a verifier judges the answer, so they agree: 0 or 1). Answers tied for the most votes share
    the win equally: the result is the mean of their correctness (the expected score of a vote
    whose tie is broken at random).

    Args:
        answers: each sample's extracted answer (None: none).
        correct: each sample's verdict, 1.0 correct and 0.0 wrong.

    Example:
        >>> majority_vote([7, 7, 3, None, None], [1, 1, 0, 0, 0])  # 7 wins, 2 votes to 1
        1.0
        >>> majority_vote([7, 3], [1, 0])  # a tie: half the chance of the right answer
        0.5
    """
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    most = max(votes.values())
    winners = [a for a, v in votes.items() if v == most]
    right = Counter()
    for a, ok in zip(answers, correct):
        if a is not None:
            right[a] += float(ok)
    return sum(right[a] / votes[a] for a in winners) / len(winners)


def majority_at_k(answers: Sequence[Hashable | None], correct: Sequence[float], k: int) -> float:
    """maj@k of one prompt: the mean of :func:`majority_vote` over all ``C(n, k)`` subsets of its
    ``n`` samples, computed exactly without enumerating them. For ``k = n`` it is the vote of all
    ``n``; for ``k = 1`` the share of correct samples (pass@1).

    An answer ``a`` given by ``c_a`` of the ``n`` samples wins a random ``k``-subset, sharing ties,
    with probability::

        sum_{x >= 1} P(a drawn x times) * E[ 1 / (1 + t) ; every other answer drawn <= x times ]

    with ``t`` the other answers drawn exactly ``x`` times. Given ``x``, the other samples are a
    uniform ``(k - x)``-subset of the remaining ``n - c_a``; the answers that can reach ``x``
    (``c_b >= x``) are visited one at a time with hypergeometric transitions over (samples drawn,
    ties), every state a probability (no overflow at any ``n``), and the answers that cannot are
    drawn from freely. maj@k is ``sum_a correctness(a) * P(a wins)``.

    Args:
        answers: the ``n`` samples' extracted answers (None: no answer, which never votes).
        correct: their verdicts, 1.0 correct and 0.0 wrong.
        k: the voters, ``1 <= k <= n``.

    Example:
        >>> round(majority_at_k([7, 7, 3, 3, 3], [1, 1, 0, 0, 0], 3), 4)  # 7 wins 3 of 10 triples
        0.3
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"majority_at_k: {n} answers but {len(correct)} verdicts.")
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs 1 <= k <= the samples per prompt ({n}): sample more, or "
                         "lower k.")
    if k == n:
        return majority_vote(answers, correct)
    votes = Counter(a for a in answers if a is not None)
    right = Counter()
    for a, ok in zip(answers, correct):
        if a is not None:
            right[a] += float(ok)
    if k == 1:  # each sample votes alone
        return sum(right.values()) / n
    # answers with the same count win with the same probability: once per count
    worth = Counter()  # count -> the summed correctness of the answers given that often
    for a, c in votes.items():
        worth[c] += right[a] / c
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    counts = list(votes.values())
    total = 0.0
    for c, value in worth.items():
        if value == 0:
            continue
        others = list(counts)
        others.remove(c)
        for x in range(1, min(c, k) + 1):
            drawn_x = math.exp(_log_comb(log_fact, c, x) + _log_comb(log_fact, n - c, k - x)
                               - _log_comb(log_fact, n, k))
            if drawn_x > 0:
                total += value * drawn_x * _tie_share(others, n - c, k - x, x, log_fact)
    return total


def _tie_share(others: list[int], pool: int, picks: int, x: int, log_fact: np.ndarray) -> float:
    """``E[1 / (1 + t)]``, 0 where an answer of ``others`` (their counts) is drawn more than ``x``
    times, over a uniform ``picks``-subset of the ``pool`` samples that ``others`` and the
    unanswered share; ``t``: the answers of ``others`` drawn exactly ``x`` times."""
    rivals = [c for c in others if c >= x]
    ties = min(len(rivals), picks // x)
    # state (t, j): t rivals tied at x, j samples drawn so far; each entry a probability
    prob = np.zeros((ties + 1, picks + 1))
    prob[0, 0] = 1.0
    j = np.arange(picks + 1)
    for c in rivals:
        left = picks - j  # (picks + 1,) samples still to draw, from `pool` on
        ways = _log_comb(log_fact, pool, left)  # -inf: more left than the pool (a state never reached)
        reached = np.isfinite(ways)
        step = np.zeros_like(prob)
        for y in range(min(c, x, picks) + 1):
            # P(this rival drawn y times | j drawn so far): hypergeometric
            log_p = _log_comb(log_fact, c, y) + _log_comb(log_fact, pool - c, left - y)
            p = np.where(reached, np.exp(log_p - np.where(reached, ways, 0.0)), 0.0)
            moved = prob[:, : picks + 1 - y] * p[: picks + 1 - y]
            if y < x:
                step[:, y:] += moved
            else:  # tied with the candidate
                step[1:, y:] += moved[:-1]
        prob, pool = step, pool - c
    # the rest of the draws come from answers that cannot reach x: any way is allowed
    return float((prob.sum(-1) / np.arange(1, ties + 2)).sum())


def _log_comb(log_fact: np.ndarray, a: int, b) -> np.ndarray | float:
    """``log C(a, b)`` (b a number or an array), ``-inf`` where ``b < 0`` or ``b > a``."""
    b = np.asarray(b)
    inside = (b >= 0) & (b <= a)
    bb = np.clip(b, 0, max(a, 0))
    out = np.where(inside, log_fact[max(a, 0)] - log_fact[bb] - log_fact[np.maximum(a - bb, 0)],
                   -np.inf)
    return out if out.ndim else float(out)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """The mean of per-prompt values and the half-width of its normal confidence interval, the
    prompts being the independent draws: ``z * s / sqrt(P)`` with ``s`` the sample standard
    deviation over the ``P`` prompts (``ddof = 1``) and ``z`` the normal quantile (1.96 at 95%).
    The samples of one prompt are not independent of each other (they share its difficulty), so
    the spread is taken between prompts, each prompt's value already averaging its own samples
    (Miller 2024, "Adding Error Bars to Evals", sections 2-3). None for the half-width with fewer
    than two prompts.

    Args:
        values: one value per prompt (pass@k, maj@k, a 0/1 accuracy).
        confidence: the interval's coverage, in (0, 1).

    Example:
        >>> mean, half = mean_interval([1.0, 0.0, 1.0, 0.0])  # 0.5 +- 1.96 * 0.577 / sqrt(4)
        >>> round(half, 3)
        0.566
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: a coverage in (0, 1), e.g. 0.95.")
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value.")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    return mean, z * statistics.stdev(values) / math.sqrt(len(values))
