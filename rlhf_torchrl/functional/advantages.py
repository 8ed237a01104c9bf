"""Advantages and returns: GAE, its length-adaptive lambda, returns-to-go, explained
variance, and the statistics of groups of responses to one prompt (mean, std, leave-one-out mean)."""

from __future__ import annotations

import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.masks import (
    has_holes,
    last_token_mask,
    masked_var,
    packing_order,
    unpack,
)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lmbda: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens of each row.

    ``delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t``,
    ``A_t = delta_t + gamma * lmbda * (1 - done_t) * A_{t+1}``, with ``done`` true at the last
    valid token (the episode ends there; nothing is bootstrapped past it). Returns
    ``(advantages, returns)`` with ``returns = advantages + values``, zero outside the mask.
    A thin layer over TorchRL's ``generalized_advantage_estimate`` (whose recursion broadcasts
    a per-row ``lmbda`` (B, 1, 1), as VAPO's length-adaptive lambda needs:
    :func:`length_adaptive_lmbda`). The steps are the valid tokens in order: where the mask has
    holes (the observation tokens of a multi-turn episode), ``t + 1`` is the policy's next token,
    after the hole.

    Args:
        rewards: the per-token rewards ``r_t``.
        values: the critic's values ``V_t``.
        mask: the valid response tokens (right-padded, or with holes).
        gamma: the discount.
        lmbda: the GAE lambda, one for all rows or one per row.

    Shapes: ``rewards``, ``values``, ``mask``: (B, R); ``lmbda`` a float or (B,), one per row.
    Returns two (B, R) tensors.
    """
    mask = mask.bool()
    if has_holes(mask):
        order = packing_order(mask)
        adv, returns = gae(rewards.gather(1, order), values.gather(1, order), mask.gather(1, order),
                           gamma, lmbda)
        return unpack(adv, order), unpack(returns, order)
    values = torch.where(mask, values, torch.zeros_like(values))
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    done = last_token_mask(mask) | ~mask  # pads are terminal too: they never feed back into valid tokens
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    if isinstance(lmbda, torch.Tensor):  # one per row: broadcast over (B, R, 1)
        lmbda = lmbda.to(device=values.device, dtype=values.dtype).reshape(-1, 1, 1)
    adv, _ = generalized_advantage_estimate(
        gamma,
        lmbda,
        values.unsqueeze(-1),
        next_values.unsqueeze(-1),
        rewards.unsqueeze(-1),
        done.unsqueeze(-1),
        done.unsqueeze(-1),
        time_dim=-2,
    )
    adv = torch.where(mask, adv.squeeze(-1), torch.zeros_like(values))
    return adv, torch.where(mask, adv + values, torch.zeros_like(values))


def length_adaptive_lmbda(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda of the policy, one per response.

    ``lmbda_i = 1 - 1 / (alpha * l_i)``, clamped to ``[0, 1]``, with ``l_i`` the response's valid
    tokens (Yue et al. 2025, "VAPO", arXiv 2504.05118, length-adaptive GAE: alpha = 0.05; NeMo-RL
    ``length_adaptive_alpha``, AReaL ``vapo_length_adaptive_gae``). The effective horizon
    ``1 / (1 - lmbda_i) = alpha * l_i`` grows with the response, so the score at the end of a long
    response still reaches its first tokens, while a short one leans on the critic. With alpha =
    0.05 every response of 20 tokens or fewer gets 0 (one-step TD).

    Args:
        mask: the valid response tokens; ``l_i`` is each row's count.
        alpha: VAPO's ``alpha``, in 1/tokens.

    Shapes: ``mask`` (B, R). Returns (B,) float32.

    Example:
        >>> length_adaptive_lmbda(torch.tensor([[1] * 40 + [0] * 60, [1] * 100]), 0.05)
        tensor([0.5000, 0.8000])
    """
    if not alpha > 0:
        raise ConfigError(f"lmbda_length_alpha must be > 0 (VAPO uses 0.05), got {alpha}.")
    lengths = mask.bool().sum(-1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths).clamp_min(1.0)).clamp(0.0, 1.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How much of the variance of the value targets the values explain, over the valid tokens.

    ``1 - Var(R - V) / Var(R)`` (population variances over the masked positions; CleanRL's
    ``explained_var``, VC-PPO's measure of a pretrained critic): 1 is a perfect critic, 0 one
    that predicts the mean, negative one worse than that. Targets without variance give 0.

    Args:
        values: the critic's values ``V``.
        returns: the value targets ``R``.
        mask: the valid response tokens.

    Shapes: ``values``, ``returns``, ``mask`` (B, R). Returns a scalar.

    Example:
        >>> explained_variance(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1.0, 3.0, 0.0]]),
        ...                    torch.tensor([[1, 1, 0]]))  # Var(R - V) = 0.25, Var(R) = 1
        tensor(0.7500)
    """
    total = masked_var(returns, mask, unbiased=False)
    resid = masked_var(returns - values, mask, unbiased=False)
    if total <= torch.finfo(total.dtype).eps:
        return torch.zeros_like(total)
    return 1.0 - resid / total


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted sum of the rewards from each response token to the end of its response.

    ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the valid tokens of the row (the episode ends
    at its last valid token); ``G_0`` is the row's whole return. A thin layer over TorchRL's
    ``reward2go``.

    Args:
        rewards: the per-token rewards ``r_t``.
        mask: the valid response tokens.
        gamma: the discount.

    Shapes: ``rewards``, ``mask`` (B, R). Returns (B, R), zero outside the mask. Holes in the
    mask (a multi-turn episode's observation tokens) are skipped: the sum runs over the valid
    tokens, discounted by their count.

    Example:
        >>> returns_to_go(torch.tensor([[0.1, 0.2, 1.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]))
        tensor([[1.3000, 1.2000, 1.0000, 0.0000]])
    """
    from torchrl.objectives.value.functional import reward2go

    mask = mask.bool()
    if has_holes(mask):
        order = packing_order(mask)
        return unpack(returns_to_go(rewards.gather(1, order), mask.gather(1, order), gamma), order)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    done = last_token_mask(mask) | ~mask
    out = reward2go(rewards.unsqueeze(-1), done.unsqueeze(-1), gamma, time_dim=-2).reshape(mask.shape)
    return torch.where(mask, out, torch.zeros_like(out))


def group_index(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, sizes)``: each row's group as ``0..G-1`` (in order of first appearance in
    sorted group ids) and the number of rows of each group. ``groups`` (B,) holds any integer
    ids; rows sharing an id answer the same prompt.

    Args:
        groups: (B,) integer group ids.
    """
    _, index, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
    return index, sizes


def group_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` (B,) over each row's group, per row (B,).

    Args:
        values: (B,) one value per row.
        groups: (B,) integer group ids; rows sharing an id answer the same prompt.
    """
    index, sizes = group_index(groups)
    sums = torch.zeros(len(sizes), dtype=values.dtype, device=values.device).index_add_(0, index, values)
    return (sums / sizes.to(values.dtype))[index]


def group_std(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Standard deviation of ``values`` (B,) over each row's group (Bessel-corrected, as GRPO
    uses it), per row (B,). Groups of one row have none: ``ValueError``.

    Args:
        values: (B,) one value per row.
        groups: (B,) integer group ids; rows sharing an id answer the same prompt.
    """
    index, sizes = group_index(groups)
    if bool((sizes < 2).any()):
        raise ValueError("A group standard deviation needs at least 2 rows per group; some group "
                         "has 1: samples_per_prompt >= 2 (the recipe's generation.samples_per_prompt).")
    centred = values - group_mean(values, groups)
    sq = torch.zeros(len(sizes), dtype=values.dtype, device=values.device).index_add_(0, index, centred**2)
    return (sq / (sizes - 1).to(values.dtype)).sqrt()[index]


def leave_one_out_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """For each row, the mean of ``values`` (B,) over the *other* rows of its group (RLOO's
    baseline): ``(sum_group - v_i) / (n - 1)``. Groups of one row have none: ``ValueError``.

    Args:
        values: (B,) one value per row.
        groups: (B,) integer group ids; rows sharing an id answer the same prompt.
    """
    index, sizes = group_index(groups)
    if bool((sizes < 2).any()):
        raise ValueError("A leave-one-out baseline needs at least 2 rows per group; some group "
                         "has 1: samples_per_prompt >= 2 (the recipe's generation.samples_per_prompt).")
    sums = torch.zeros(len(sizes), dtype=values.dtype, device=values.device).index_add_(0, index, values)
    return (sums[index] - values) / (sizes[index] - 1).to(values.dtype)
