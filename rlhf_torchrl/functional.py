"""Pure tensor math for token-level PPO-RLHF.

Conventions: response tensors are ``(B, R)``, right-padded; ``mask`` is True (or 1) on valid
response tokens. Prompts are ``(B, P)``, left-padded. Nothing here knows about TensorDicts.
"""

from __future__ import annotations

import math

import torch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from .errors import ConfigError

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


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true.

    ``sum(x * m) / sum(m)``; an all-false mask gives 0 rather than NaN.

    Args:
        x: the values.
        mask: where ``x`` counts (bool or 0/1).
        dim: the dim(s) to reduce; None: all.

    Shapes: ``x`` and ``mask`` broadcastable; reduces ``dim`` (all dims when None).

    Example:
        >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
        tensor(1.5000)
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked positions (all dims).

    ``sum(m * (x - mean)^2) / (n - 1)`` with Bessel's correction when ``unbiased``, else ``/ n``.

    Args:
        x: the values.
        mask: where ``x`` counts (bool or 0/1), broadcastable to ``x``.
        unbiased: divide by ``n - 1`` (Bessel's correction) rather than ``n``.

    Example:
        >>> masked_var(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]))
        tensor(2.)
    """
    mean = masked_mean(x, mask)
    n = mask.to(x.dtype).sum()
    sq = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        if n < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 valid elements, got {int(n)}."
            )
        sq = sq * n / (n - 1)
    return sq


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean) over the masked positions.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back, which is
    how rewards are whitened without changing their sign (N+ details, §whitening). Positions outside
    the mask are returned as 0.

    Args:
        x: the values.
        mask: where ``x`` counts (bool or 0/1), broadcastable to ``x``.
        shift_mean: subtract the mean (False: only scale, keeping the mean).
        eps: added to the variance before the square root.

    Example:
        >>> masked_whiten(torch.tensor([1.0, 3.0, 7.0]), torch.tensor([1, 1, 0]))
        tensor([-0.7071,  0.7071,  0.0000])
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


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


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid position in each row of a right-padded ``(B, R)`` mask.

    Rows with no valid token give index 0.

    Args:
        mask: (B, R) right-padded valid-token mask.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool (B, R): True only at the last valid position of each right-padded row (``done``).

    Args:
        mask: (B, R) right-padded valid-token mask.
    """
    done = torch.zeros_like(mask, dtype=torch.bool)
    done[torch.arange(mask.shape[0], device=mask.device), last_token_index(mask)] = True
    return done & mask.bool()


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


def truncate_after_stop(
    tokens: torch.Tensor, stop_token_ids: list[int] | torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token and fill the rest with pad.

    The stop token itself is kept and counts as a response token (the policy chose it; the
    reward model reads the sequence up to it). N+ details, §"truncate at EOS".

    Args:
        tokens: the sampled response tokens.
        stop_token_ids: the ids that end a response (EOS and any stop tokens).
        pad_token_id: the id written after the stop token.

    Shapes: ``tokens`` (B, R) right-padded. Returns ``(tokens, mask, has_stop)`` with shapes
    (B, R), (B, R) bool and (B,) bool.

    Example:
        >>> truncate_after_stop(torch.tensor([[5, 2, 7, 8]]), [2], pad_token_id=0)[0]
        tensor([[5, 2, 0, 0]])
    """
    stop = torch.as_tensor(stop_token_ids, device=tokens.device).reshape(-1)
    is_stop = torch.isin(tokens, stop)
    # number of stop tokens strictly before t; valid while none has occurred yet
    stops_before = torch.cumsum(is_stop.long(), dim=-1) - is_stop.long()
    mask = stops_before == 0
    has_stop = is_stop.any(-1)
    out = torch.where(mask, tokens, torch.full_like(tokens, pad_token_id))
    return out, mask, has_stop


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each left-padded row.

    ``pos[t] = (sum_{s<=t} m[s]) - 1`` clamped at 0; pads get 0 (they are masked anyway). With
    these, a left-padded row gets the same logits as the unpadded sequence.

    Args:
        attention_mask: (B, T) left-padded attention mask.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def log_probs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of the chosen tokens under ``softmax(logits / temperature)``, in fp32.

    ``log p(y_t) = z_t[y_t] - logsumexp(z_t)`` with ``z = logits / temperature``, without a
    log-softmax, and with a hand-written backward: ``d log p(y_t) / d logits_t = (onehot(y_t) -
    softmax(z_t)) / temperature``. Autograd through ``logits / T``, ``logsumexp`` and ``gather``
    allocates about five (B, R, V) tensors between forward and backward; this keeps one from the
    forward (``exp(z - max z)``) and allocates one in the backward, the gradient. The update phase
    is dominated by such vocabulary-sized passes on small models (``rlhf-torchrl bench
    ppo_iteration``).

    Args:
        logits: the model's logits at the positions that predict ``tokens``.
        tokens: the chosen token ids ``y_t``.
        temperature: the sampling temperature ``T`` the logits are divided by.

    Shapes: ``logits`` (B, R, V) any float dtype, ``tokens`` (B, R). Returns (B, R) float32
    (float64 for float64 logits).
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}.")
    return _TokenLogProb.apply(logits, tokens, float(temperature))


class _TokenLogProb(torch.autograd.Function):
    """Forward keeps ``exp(z - max z)`` (one vocabulary-sized buffer, instead of the logits);
    backward scales it into the gradient and adds the chosen-token term."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        work = logits if logits.dtype == torch.float64 else logits.float()
        shift = work.amax(-1, keepdim=True)
        weights = torch.sub(work, shift).mul_(1.0 / temperature).exp_()  # exp(z - max z)
        norm = weights.sum(-1, keepdim=True)
        chosen = (work.gather(-1, tokens.unsqueeze(-1)) - shift) / temperature
        ctx.save_for_backward(weights, tokens, norm)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return (chosen - norm.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        weights, tokens, norm = ctx.saved_tensors
        scale = (grad / ctx.temperature).unsqueeze(-1)
        # -softmax(z) * g / T everywhere, + g / T at the chosen token
        out = torch.mul(weights, -scale / norm).scatter_add_(-1, tokens.unsqueeze(-1), scale)
        return out.to(ctx.dtype), None, None


def entropy_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``, in fp32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args:
        logits: the unnormalised log-probabilities ``z``.
        logsumexp: ``logsumexp(z)`` over the last dim, if already computed (None: computed here).

    Shapes: (..., V) -> (...).
    """
    logits = logits.float()
    if logsumexp is None:
        logsumexp = torch.logsumexp(logits, dim=-1)
    return logsumexp - (torch.softmax(logits, -1) * logits).sum(-1)


def packing_order(mask: torch.Tensor) -> torch.Tensor:
    """(B, R) int64: per row, the positions of the valid tokens in order, then the others.

    ``x.gather(1, order)`` packs each row's valid tokens to the left (a multi-turn response
    has observation tokens between the policy's turns); :func:`unpack` puts them back. For a
    right-padded mask the order is the identity.

    Args:
        mask: (B, R) valid-token mask, possibly with holes.
    """
    return torch.sort((~mask.bool()).to(torch.uint8), dim=1, stable=True).indices


def has_holes(mask: torch.Tensor) -> bool:
    """Whether a valid token follows an invalid one in some row (not a right-padded mask).

    Args:
        mask: (B, R) valid-token mask.
    """
    mask = mask.bool()
    return bool((mask[:, 1:] & ~mask[:, :-1]).any())


def unpack(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``x_packed = x.gather(1, order)``.

    Args:
        x: (B, R) values in packed order.
        order: (B, R) the order they were packed with (:func:`packing_order`).
    """
    return torch.zeros_like(x).scatter_(1, order, x)


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


# ---- the PPO policy loss's variants and how a loss is averaged ------------------------------------

#: ``ppo.loss_aggregation``'s modes, verl's ``loss_agg_mode`` names with underscores
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                     "seq_mean_token_sum_norm")


def check_loss_aggregation(mode: str, constant: float | None = None) -> str:
    """Return ``mode`` if it is one of :data:`LOSS_AGGREGATIONS` (with the constant
    ``seq_mean_token_sum_norm`` needs), else raise naming the options.

    Args:
        mode: the name to check.
        constant: ``seq_mean_token_sum_norm``'s ``C``, which must then be a positive number.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ConfigError(
            f"Unknown loss aggregation {mode!r}: choose one of {LOSS_AGGREGATIONS} (token_mean: mean "
            "over all valid tokens; seq_mean_token_mean: mean over each response's tokens, then over "
            "responses; seq_mean_token_sum: sum over each response's tokens, then mean over "
            "responses; seq_mean_token_sum_norm: that sum divided by a constant, Dr. GRPO)."
        )
    if mode == "seq_mean_token_sum_norm" and (constant is None or not constant > 0):
        raise ConfigError(
            f"loss aggregation seq_mean_token_sum_norm divides each response's token sum by a "
            f"constant > 0 (Dr. GRPO: the generation budget, max_new_tokens); got {constant}."
        )
    return mode


def aggregation_size(mask: torch.Tensor, mode: str = "token_mean",
                     constant: float | None = None) -> torch.Tensor:
    """The denominator :func:`aggregate_loss` divides by, for the rows of ``mask``.

    ``token_mean``: ``N = sum_it m_it``, the valid tokens; ``seq_mean_token_mean`` and
    ``seq_mean_token_sum``: ``S = #{i : sum_t m_it > 0}``, the responses with a valid token;
    ``seq_mean_token_sum_norm``: ``S * C``. Each count is at least 1 (an empty mask's loss is 0).

    The loss of a batch split into parts ``j`` is ``sum_j (size_j / size) * loss_j``: a part's
    weight is its share of the whole batch's size, computed before the parts run (``ppo_update``).

    Args:
        mask: the valid response tokens.
        mode: one of :data:`LOSS_AGGREGATIONS`.
        constant: ``C`` of ``seq_mean_token_sum_norm``; unused by the other modes.

    Shapes: ``mask`` (B, R). Returns a float64 scalar.

    Example:
        >>> aggregation_size(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]), "seq_mean_token_mean")
        tensor(2., dtype=torch.float64)
    """
    check_loss_aggregation(mode, constant)
    mask = mask.bool()
    if mode == "token_mean":
        return mask.sum().clamp_min(1).double()
    sequences = mask.any(-1).sum().clamp_min(1).double()
    return sequences * constant if mode == "seq_mean_token_sum_norm" else sequences


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
                   constant: float | None = None) -> torch.Tensor:
    """Average a per-token loss ``l_it`` over a batch of responses, as ``mode`` says.

    With ``m_it`` the valid-token mask, ``n_i = sum_t m_it`` and ``S`` the responses with
    ``n_i > 0`` (after verl's ``agg_loss``, ``loss_agg_mode``):

    - ``token_mean``:              ``sum_it m_it l_it / sum_i n_i`` (every token weighs the same:
      DAPO §3.3, "token-level policy gradient loss"; PPO-RLHF's usual mean)
    - ``seq_mean_token_mean``:     ``(1/S) sum_i (1/n_i) sum_t m_it l_it`` (every response weighs
      the same: GRPO, Shao et al. 2024, eq. 3)
    - ``seq_mean_token_sum``:      ``(1/S) sum_i sum_t m_it l_it``
    - ``seq_mean_token_sum_norm``: ``(1/S) sum_i sum_t m_it l_it / C`` with a constant ``C``, the
      generation budget (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1:
      no length bias). verl divides by the padded width instead and by no sequence count.

    Masked positions are selected away (``where``), so a non-finite value there cannot leak.

    Args:
        loss: the per-token loss ``l_it``.
        mask: the valid response tokens ``m_it``.
        mode: one of :data:`LOSS_AGGREGATIONS`, as above.
        constant: ``C`` of ``seq_mean_token_sum_norm`` (the response budget, in tokens); unused by
            the other modes.

    Shapes: ``loss`` and ``mask`` (B, R). Returns a scalar in ``loss``'s dtype.

    Example:
        >>> loss = torch.tensor([[1.0, 3.0, 9.0], [4.0, 9.0, 9.0]])
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> [round(aggregate_loss(loss, mask, m, constant=4).item(), 4) for m in LOSS_AGGREGATIONS]
        [2.6667, 3.0, 4.0, 1.0]
    """
    mask = mask.bool()
    size = aggregation_size(mask, mode, constant).to(loss.dtype)
    per_token = torch.where(mask, loss, torch.zeros_like(loss))
    if mode == "seq_mean_token_mean":
        per_token = per_token / mask.sum(-1, keepdim=True).clamp_min(1).to(loss.dtype)
    return per_token.sum() / size


def dual_clip(pg_loss: torch.Tensor, advantage: torch.Tensor, c: float,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """Dual-clip PPO: bound the clipped surrogate's per-token loss on negative advantages.

    For ``A < 0`` the clipped loss ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` grows
    without bound in ``r``; dual clip caps it at ``-A c`` (``c > 1``):

    ``l = min(max(-A r, -A clip(r)), -A c)`` if ``A < 0``, else ``max(-A r, -A clip(r))``

    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
    eq. 5; verl's ``clip_ratio_c``, OpenRLHF's ``dual_clip``, NeMo-RL's ``ratio_clip_c``). The cap
    binds where ``A < 0`` and ``r > c``: a token the policy already made far likelier than the
    sampler did stops pushing the gradient. With an importance ``weight`` ``w`` on the surrogate
    (truncated importance sampling: ``pg_loss = w max(...)``), the cap is ``-A c w``.

    Args:
        pg_loss: the clipped surrogate's per-token loss ``max(-A r, -A clip(r))``.
        advantage: the advantage ``A``.
        c: the cap, ``c > 1``.
        weight: the importance weight ``w`` the surrogate was multiplied by (None: 1).

    Shapes: all broadcastable, elementwise.

    Example:
        >>> dual_clip(torch.tensor([5.0, 5.0, -4.0]), torch.tensor([-1.0, 1.0, 1.0]), 3.0)
        tensor([ 3.,  5., -4.])
    """
    if not c > 1:
        raise ConfigError(f"dual_clip must be > 1 (the ratio beyond which a negative-advantage "
                          f"token's loss stops growing), got {c}.")
    bound = -advantage * c if weight is None else -advantage * c * weight
    return torch.where(advantage < 0, torch.minimum(pg_loss, bound), pg_loss)


def clip_binds(ratio: torch.Tensor, advantage: torch.Tensor, clip_epsilon_low: float,
               clip_epsilon_high: float, dual_clip: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each bound of the (asymmetric, dual-) clipped surrogate binds: ``(high, low, dual)``.

    The per-token loss with DAPO's clip-higher (Yu et al. 2025, "DAPO", eq. 10: ``eps_high >
    eps_low`` lets unlikely tokens with ``A > 0`` grow further before the clip stops them) is
    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``. The upper bound binds where ``A > 0``
    and ``r > 1 + eps_high``, the lower where ``A < 0`` and ``r < 1 - eps_low`` (the two add up to
    TRL's ``pg_clipfrac``); dual clip (:func:`dual_clip`) where ``A < 0`` and ``r > c``.

    Args:
        ratio: the importance ratio ``r``.
        advantage: the advantage ``A``.
        clip_epsilon_low: ``eps_low``.
        clip_epsilon_high: ``eps_high``.
        dual_clip: the dual-clip cap ``c`` (None: no dual clip, ``dual`` all False).

    Shapes: ``ratio``, ``advantage`` broadcastable. Returns three bool tensors.

    Example:
        >>> high, low, dual = clip_binds(torch.tensor([1.5, 0.5, 4.0]), torch.tensor([1.0, -1.0, -1.0]),
        ...                              0.2, 0.28, dual_clip=3.0)
        >>> high.tolist(), low.tolist(), dual.tolist()
        ([True, False, False], [False, True, False], [False, False, True])
    """
    high = (advantage > 0) & (ratio > 1 + clip_epsilon_high)
    low = (advantage < 0) & (ratio < 1 - clip_epsilon_low)
    dual = (advantage < 0) & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(high)
    return high, low, dual


def positive_nll(log_prob: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """VAPO's positive-example language-model loss: the NLL of the responses that scored well.

    ``L_NLL = -(1 / sum_{i in T} n_i) sum_{i in T} sum_t m_it log pi(y_it)``, with ``T`` the
    responses whose score is at or above a threshold (VAPO: the correct answers), ``n_i`` their
    valid tokens: a token-mean over the positive responses' tokens, added to the PPO loss with a
    weight ``mu`` (Yue et al. 2025, "VAPO", arXiv 2504.05118, positive example LM loss: mu = 0.1;
    NeMo-RL ``positive_example_nll_weight``). 0 when no response is positive. The reference
    formula for a whole batch; :func:`positive_nll_weights` keeps it exact over a split batch.

    Args:
        log_prob: the policy's log-probs of the response tokens.
        mask: the valid response tokens.
        positive: which responses are in ``T`` (scored at or above the threshold).

    Shapes: ``log_prob``, ``mask`` (B, R); ``positive`` (B,) bool. Returns a scalar.

    Example:
        >>> positive_nll(torch.tensor([[-1.0, -3.0], [-9.0, -9.0]]), torch.tensor([[1, 1], [1, 1]]),
        ...              torch.tensor([True, False]))
        tensor(2.)
    """
    keep = mask.bool() & positive.bool().unsqueeze(-1)
    nll = torch.where(keep, -log_prob, torch.zeros_like(log_prob))
    return nll.sum() / keep.sum().clamp_min(1).to(log_prob.dtype)


def positive_nll_weights(positive: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
                         constant: float | None = None) -> torch.Tensor:
    """Per-response weights that keep :func:`positive_nll` exact however its batch is split.

    ``c_i = [i in T] * size / N_T``, with ``size`` the batch's :func:`aggregation_size` (``mode``:
    the denominator every loss term of a part is weighted by) and ``N_T = sum_{i in T} n_i`` the
    positive responses' valid tokens. A part ``j`` of the batch (a micro-batch, a process's slice)
    then computes ``sum_{i in j} sum_t m_it c_i (-log pi(y_it)) / size_j``; weighted by its share
    ``size_j / size``, as every loss term is, the parts add up to the whole batch's
    :func:`positive_nll`, normalised once by all its positive tokens (NeMo-RL normalised per
    micro-batch: the loss grew with the number of micro-batches).

    Args:
        positive: which responses are in ``T``.
        mask: the valid response tokens of the whole batch.
        mode: the loss's aggregation, one of :data:`LOSS_AGGREGATIONS`.
        constant: ``C`` of ``seq_mean_token_sum_norm``; unused by the other modes.

    Shapes: ``positive`` (B,) bool, ``mask`` (B, R). Returns (B,) float64.

    Example:
        >>> positive_nll_weights(torch.tensor([True, False]), torch.tensor([[1, 1], [1, 0]]))
        tensor([1.5000, 0.0000], dtype=torch.float64)
    """
    keep = mask.bool() & positive.bool().unsqueeze(-1)
    n_positive = keep.sum().clamp_min(1).double()
    size = aggregation_size(mask, mode, constant)
    return positive.bool().double() * size / n_positive


# ---- the correction for tokens another policy sampled ---------------------------------------------

#: ``ppo.off_policy_correction``'s choices
OFF_POLICY_CORRECTIONS = ("tis", "mis", "icepop", "seq_mask_tis")


def check_off_policy_correction(mode: str, cap: float | None, low: float | None = None) -> str:
    """Return ``mode`` if it is one of :data:`OFF_POLICY_CORRECTIONS` and its bounds make a window,
    else raise naming the options or the bound to fix.

    Args:
        mode: the name to check.
        cap: the upper bound ``C`` on the importance weight.
        low: the lower bound ``c`` (None: the mode's default, see :func:`off_policy_log_weight`).
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ConfigError(
            f"Unknown off-policy correction {mode!r}: choose one of {OFF_POLICY_CORRECTIONS} (tis: "
            "truncate the ratio at the cap; mis: mask tokens whose ratio passes it; icepop: mask "
            "tokens whose ratio leaves [low, cap]; seq_mask_tis: mask responses whose geometric-mean "
            "ratio leaves [low, cap])."
        )
    if cap is None or not cap > 0:
        raise ConfigError(f"The off-policy correction {mode} needs its upper bound (tis_cap) > 0, "
                          f"got {cap}.")
    lower = low if low is not None else (1.0 / cap if mode in ("icepop", "seq_mask_tis") else None)
    if lower is not None and not 0 < lower < cap:
        given = f"low={low}" if low is not None else f"low = 1 / cap = {lower:g}"
        raise ConfigError(f"The off-policy correction {mode} keeps ratios in [low, cap]: {given} "
                          f"with cap={cap} leaves no room; give cap > 1, or 0 < low < cap.")
    return mode


def off_policy_log_weight(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str = "tis", *,
                          cap: float, low: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The log of each token's importance weight on the PPO surrogate, for tokens another policy
    sampled (older weights, other kernels), and which tokens it keeps.

    With ``delta_t = log pi_old(y_t) - log pi_sampler(y_t)``, ``rho_t = exp(delta_t)``, ``C = cap``
    and ``c = low``:

    - ``tis``: ``w_t = min(rho_t, C)``, also ``max(., c)`` when ``low`` is given. Truncated IS
      (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
      verl ``rollout_is=token``; OpenRLHF, NeMo-RL and slime ``tis``, whose ``[min, max]`` clamp
      ``low`` gives). Keeps every token.
    - ``mis``: ``w_t = rho_t [rho_t <= C]`` (and ``[rho_t >= c]`` when ``low`` is given): token-level
      masked IS, a token past the bound drops out rather than counting ``C`` (Liu, Li et al. 2025,
      "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch":
      rejection over truncation; verl ``rollout_rs=token_k1``, slime ``mis.py``'s mask mode).
    - ``icepop``: ``w_t = rho_t [c <= rho_t <= C]`` with ``c = 1 / C`` unless given: tokens on which
      the two policies disagree either way drop out (Ling Team 2025, "Every Step Evolves: Scaling
      Reinforcement Learning for Trillion-Scale Thinking Model", arXiv 2510.18855, IcePop, with
      [0.5, 5]; OpenRLHF, NeMo-RL and slime ``icepop``).
    - ``seq_mask_tis``: ``g_i = exp(mean_t delta_it)`` over response ``i``'s valid tokens (its
      geometric-mean ratio), ``w_it = rho_it [c <= g_i <= C]`` with ``c = 1 / C`` unless given: whole
      responses drop out, the kept ones' token ratios are not truncated (NeMo-RL's and OpenRLHF's
      ``seq-mask-tis``, NeMo-RL's bounds [0.999, 1.002]; verl's Geo-RS with token IS).

    A dropped token's log weight is ``-inf`` (weight 0, no gradient). It stays in the loss's
    denominator (IcePop's ``1 / |o_i|``, OpenRLHF's and NeMo-RL's weight 0; verl and slime's
    ``mis.py`` take it out of the loss mask instead), so :func:`aggregate_loss` and its exactness
    over micro-batches hold as they are. ``tis`` is ``delta.clamp_max(log C)``, bit for bit.

    Args:
        log_ratio: ``delta_t``, the old policy's log-probs minus the sampler's.
        mask: the valid response tokens.
        mode: one of :data:`OFF_POLICY_CORRECTIONS`, as above.
        cap: ``C``, the upper bound on the weight.
        low: ``c``, the lower bound (None: none for ``tis`` and ``mis``, ``1 / C`` for the others).

    Shapes: ``log_ratio``, ``mask`` (B, R). Returns the log weights (B, R) and the kept tokens
    (B, R) bool (padding counts as kept).

    Example:
        >>> log_ratio, mask = torch.tensor([[3.0, 1.5, 0.25]]).log(), torch.ones(1, 3, dtype=torch.bool)
        >>> [off_policy_log_weight(log_ratio, mask, m, cap=2.0)[0].exp().round(decimals=2).tolist()
        ...  for m in OFF_POLICY_CORRECTIONS]
        [[[2.0, 1.5, 0.25]], [[0.0, 1.5, 0.25]], [[0.0, 1.5, 0.0]], [[3.0, 1.5, 0.25]]]
    """
    check_off_policy_correction(mode, cap, low)
    high, mask = math.log(cap), mask.bool()
    # pads get weight 1 (log 0) whatever they hold: a non-finite pad would give the masked
    # surrogate a NaN gradient (0 * exp(nan))
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if mode == "tis":
        log_weight = log_ratio.clamp_max(high)
        if low is not None:
            log_weight = log_weight.clamp_min(math.log(low))
        return log_weight, torch.ones_like(log_ratio, dtype=torch.bool)
    if mode == "mis":
        keep = log_ratio <= high
        if low is not None:
            keep = keep & (log_ratio >= math.log(low))
    else:
        lower = math.log(low) if low is not None else -high
        statistic = log_ratio if mode == "icepop" else masked_mean(  # (B, 1): g_i's log
            log_ratio, mask, dim=-1).unsqueeze(-1)
        keep = ((statistic >= lower) & (statistic <= high)).expand_as(log_ratio)
    keep = keep | ~mask
    return torch.where(keep, log_ratio, torch.full_like(log_ratio, -math.inf)), keep
