"""The KL to the reference, per token (the k1, k2 and k3 estimators), and the per-token reward
it shapes with the score."""

from __future__ import annotations

import torch

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.masks import last_token_index

KL_ESTIMATORS = ("k1", "k2", "k3")
#: the per-token bound on the k3 term of the loss (verl's ``kl_penalty="low_var_kl"`` clamps it to
#: [-10, 10]; k3 >= 0, so the bound is 10 from above)
K3_LOSS_BOUND = 10.0
#: the log-ratio's bound before ``exp`` (verl's, for numerical stability: k3 passes
#: :data:`K3_LOSS_BOUND` well inside it, so it changes no value and no gradient)
_K3_LOG_RATIO_BOUND = 20.0


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

    These are values (the reward's penalty); a loss that takes k3's gradient descends another KL
    (:func:`clamped_k3`).

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


def clamped_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
               bound: float = K3_LOSS_BOUND) -> torch.Tensor:
    """The k3 term of a KL penalty in the loss (GRPO's), clamped per token as verl clamps its
    ``low_var_kl``.

    With ``log r = clamp(log pi_ref - log pi, -20, 20)`` and ``r = exp(log r)``:
    ``k = min((r - 1) - log r, bound)``, in ``[0, bound]``.

    What it is: its value is k3 (:func:`kl_estimate`), on tokens sampled from pi an unbiased
    estimate of KL(pi || pi_ref). Its gradient, taken through ``log pi`` as a loss takes it, is
    ``(1 - r) grad log pi``, whose mean over ``y ~ pi`` is ``-E_{y ~ pi_ref}[grad log pi] =
    grad KL(pi_ref || pi)``: as a loss term it descends the reverse KL, KL(pi_ref || pi), not
    KL(pi || pi_ref) (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation
    for RL"). The two agree to second order near pi = pi_ref.

    The bound: k3 reaches 10 at ``log r = 2.61`` (pi_ref / pi = 13.6) and ``log r = -11.0``; a
    token past it adds 10 and no gradient (verl ``kl_penalty``, ``torch.clamp(kld, -10, 10)``), so
    one token the reference finds very unlikely cannot dominate the loss.

    Args:
        log_prob: ``log pi`` of the sampled tokens (with its gradient).
        ref_log_prob: ``log pi_ref`` of the same tokens.
        bound: the per-token upper bound (verl's 10).

    Shapes: any; elementwise.

    Example:
        >>> clamped_k3(torch.tensor([0.0, -1.0, -5.0]), torch.tensor([0.0, 0.0, 0.0]))
        tensor([ 0.0000,  0.7183, 10.0000])
    """
    log_r = (ref_log_prob - log_prob).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return (torch.expm1(log_r) - log_r).clamp_max(bound)


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
