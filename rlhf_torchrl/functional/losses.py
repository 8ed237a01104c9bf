"""The PPO policy loss's variants and how a loss is averaged: the aggregation modes (token mean,
sequence means, a constant normaliser), the dual clip, where the clip binds, and VAPO's
positive-example NLL."""

from __future__ import annotations

import torch

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.masks import masked_mean

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


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) each response's length-normalised log-ratio, ``mean_t (log pi - log pi_old)`` over its
    valid tokens (0 for a response without any): the log of GSPO's sequence ratio ``s_i``.

    Args:
        log_ratio: (B, R) per-token ``log pi - log pi_old``.
        mask: (B, R) the valid response tokens.
    """
    m = mask.to(log_ratio.dtype)
    return (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)


def token_covariance(log_prob: torch.Tensor, advantage: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """(B, R) each valid token's share of the covariance of log-prob and advantage,
    ``(log pi_t - mean log pi) (A_t - mean A)``, the means over the valid tokens (0 on padding):
    what Clip-Cov and KL-Cov rank tokens by (Cui et al. 2025).

    Args:
        log_prob: (B, R) the tokens' log-probs.
        advantage: (B, R) their advantages.
        mask: (B, R) the valid response tokens.
    """
    cov = (log_prob - masked_mean(log_prob, mask)) * (advantage - masked_mean(advantage, mask))
    return torch.where(mask, cov, torch.zeros_like(cov))


def random_subset(eligible: torch.Tensor, count: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A bool mask of ``min(count, eligible.sum())`` of the ``True`` entries of ``eligible``,
    chosen uniformly at random (from ``generator``, or torch's default one).

    Args:
        eligible: a bool tensor.
        count: how many to choose.
        generator: the random stream (None: torch's default).
    """
    flat = eligible.flatten().nonzero().squeeze(-1)
    chosen = flat[torch.randperm(len(flat), generator=generator, device=flat.device)[:count]]
    out = torch.zeros(eligible.numel(), dtype=torch.bool, device=eligible.device)
    out[chosen] = True
    return out.view_as(eligible)


def top_k_tokens(score: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """A bool mask of the ``min(count, mask.sum())`` valid tokens of highest ``score`` (ties:
    the first in row-major order).

    Args:
        score: (B, R) a score per token.
        mask: (B, R) the valid tokens.
        count: how many to choose.
    """
    masked = torch.where(mask, score, torch.full_like(score, -torch.inf)).flatten()
    k = min(count, int(mask.sum()))
    out = torch.zeros(masked.numel(), dtype=torch.bool, device=score.device)
    out[torch.topk(masked, k, sorted=False).indices] = True
    return out.view_as(score)
