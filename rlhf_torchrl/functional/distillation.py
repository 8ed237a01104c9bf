"""On-policy distillation's reward: minus the reverse KL to a teacher, per token, or for the whole
response where the teacher reads another vocabulary."""

from __future__ import annotations

import torch

from rlhf_torchrl.functional.kl import kl_estimate
from rlhf_torchrl.functional.masks import last_token_index


def distillation_rewards(
    log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reward of on-policy distillation: minus the reverse KL to the teacher.

    ``KL_T[t] = estimator(log pi(y_t), log pi_T(y_t)) * m[t]`` (:func:`kl_estimate`, with the
    teacher in the reference's place), ``r[t] = -coef * KL_T[t]``. With ``k1``:
    ``r[t] = -coef * (log pi(y_t) - log pi_T(y_t))``, the per-token reverse KL of on-policy
    distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD);
    Lu et al. 2025, Thinking Machines' "On-Policy Distillation"), sampled by the policy itself.

    Args:
        log_prob: ``log pi`` of the sampled tokens (the old policy's, fp32, at the sampling
            temperature).
        teacher_log_prob: ``log pi_T`` of the same tokens under the teacher.
        mask: the valid response tokens (right-padded).
        coef: the reward's coefficient (``reward.teacher_coef``).
        estimator: ``k1``, ``k2`` or ``k3``.

    Shapes: all (B, R). Returns ``(reward, kl)``, both (B, R), 0 outside the mask.

    Example:
        >>> r, kl = distillation_rewards(torch.tensor([[-1.0, -2.0, 0.0]]),
        ...                              torch.tensor([[-0.5, -3.0, 9.0]]),
        ...                              torch.tensor([[1, 1, 0]]), coef=2.0)
        >>> r  # k1: -1 - (-0.5) = -0.5 and -2 - (-3) = 1
        tensor([[ 1., -2.,  0.]])
    """
    valid = mask.bool()
    estimate = kl_estimate(log_prob, teacher_log_prob, estimator)
    zero = torch.zeros_like(estimate)
    return torch.where(valid, -coef * estimate, zero), torch.where(valid, estimate, zero)


def sequence_distillation_rewards(
    log_prob: torch.Tensor,
    teacher_sequence_log_prob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level reward of on-policy distillation, at the last response token: for a teacher
    that reads another vocabulary, whose log-probs cannot be matched token by token.

    ``log pi(y) = sum_t m[t] log pi(y_t)`` (the policy's tokens) and ``log pi_T(y)`` (the same
    text in the teacher's tokens) are two log-probabilities of one string, so
    ``KL_T = estimator(log pi(y), log pi_T(y))`` estimates the sequence-level reverse KL
    ``KL(pi || pi_T)`` from the one sample; ``r[last] = -coef * KL_T``, 0 elsewhere. With a
    discount of 1 the return of every token is then the same as a per-token reward summing to it
    would give at the response's end.

    Args:
        log_prob: ``log pi`` of the sampled tokens.
        teacher_sequence_log_prob: ``log pi_T`` of each response's text.
        mask: the valid response tokens (right-padded).
        coef: the reward's coefficient.
        estimator: ``k1``, ``k2`` or ``k3`` (``k3`` takes ``exp`` of a whole sequence's
            log-ratio: it overflows past ~88 nats).

    Shapes: ``log_prob`` and ``mask`` (B, R), ``teacher_sequence_log_prob`` (B,). Returns
    ``(reward, kl)``, both (B, R): the values at each row's last valid token, 0 elsewhere (a row
    without one: 0).

    Example:
        >>> r, kl = sequence_distillation_rewards(torch.tensor([[-1.0, -2.0, 0.0]]),
        ...                                       torch.tensor([-3.5]),
        ...                                       torch.tensor([[1, 1, 0]]), coef=1.0)
        >>> r  # log pi(y) = -3, log pi_T(y) = -3.5: k1 = 0.5
        tensor([[ 0.0000, -0.5000,  0.0000]])
    """
    mask_f = mask.to(log_prob.dtype)
    sequence = (log_prob * mask_f).sum(-1)  # (B,)
    has_any = mask.bool().any(-1)
    value = torch.where(has_any, kl_estimate(sequence, teacher_sequence_log_prob.to(sequence.dtype),
                                             estimator), torch.zeros_like(sequence))
    rows, last = torch.arange(log_prob.shape[0], device=log_prob.device), last_token_index(mask)
    kl, reward = torch.zeros_like(log_prob), torch.zeros_like(log_prob)
    kl[rows, last] = value
    reward[rows, last] = -coef * value
    return reward, kl
