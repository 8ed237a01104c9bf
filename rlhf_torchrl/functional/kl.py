"""The KL to the reference, per token (the k1, k2 and k3 estimators), and the per-token reward
it shapes with the score."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .masks import last_token_index

KL_ESTIMATORS = ("k1", "k2", "k3")


def check_kl_estimator(estimator: str) -> str:
    """Return ``estimator`` if it is one of :data:`KL_ESTIMATORS`, else raise naming the options.

    Args:
        estimator: the name to check (``k1``, ``k2`` or ``k3``).
    """
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"Unknown KL estimator {estimator!r}: choose one of {KL_ESTIMATORS} "
            "(k1 = log-ratio, k2 = squared log-ratio / 2, k3 = (r - 1) - log r)."
        )
    return estimator


def kl_estimate(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of sampled tokens.

    With ``log r = ref_log_prob - log_prob`` (tokens sampled from ``pi``), after Schulman (2020),
    "Approximating KL divergence":

    - ``k1 = -log r``               (unbiased, can be negative)
    - ``k2 = (log r)^2 / 2``        (biased, low variance, >= 0)
    - ``k3 = (r - 1) - log r``      (unbiased, low variance, >= 0)

    Args:
        log_prob: ``log pi`` of the sampled tokens.
        ref_log_prob: ``log pi_ref`` of the same tokens.
        estimator: ``k1``, ``k2`` or ``k3``.

    Shapes: any; elementwise.

    Example:
        >>> kl_estimate(torch.tensor([0.0]), torch.tensor([0.0]), "k3")
        tensor([0.])
    """
    check_kl_estimator(estimator)
    log_r = ref_log_prob - log_prob
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.expm1(log_r) - log_r


def per_token_rewards(
    score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token RLHF reward: a KL penalty on every response token plus the score at the last.

    ``r[t] = -kl_coef * KL[t] * m[t] + score * [t == last valid token]``
    (Ziegler et al. 2019, §2.2; the score enters once, where the episode ends).

    Args:
        score: each response's scalar score.
        kl: the per-token KL estimate (:func:`kl_estimate`).
        mask: the valid response tokens (right-padded).
        kl_coef: the KL penalty's coefficient.

    Shapes: ``score`` (B,), ``kl`` and ``mask`` (B, R). Returns ``(reward, non_score_reward)``,
    both (B, R), zero outside the mask.

    Example:
        >>> r, _ = per_token_rewards(torch.tensor([1.0]), torch.tensor([[0.5, 0.5, 9.0]]),
        ...                          torch.tensor([[1, 1, 0]]), kl_coef=0.1)
        >>> r
        tensor([[-0.0500,  0.9500,  0.0000]])
    """
    mask_f = mask.to(kl.dtype)
    non_score = -kl_coef * kl * mask_f
    last = last_token_index(mask)
    has_any = mask.bool().any(-1)
    reward = non_score.clone()
    reward[torch.arange(reward.shape[0], device=reward.device), last] += torch.where(
        has_any, score.to(reward.dtype), torch.zeros_like(score, dtype=reward.dtype)
    )
    return reward, non_score
