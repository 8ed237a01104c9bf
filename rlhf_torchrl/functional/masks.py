"""Masks and token positions: masked statistics, the last valid token, position ids from an
attention mask, the packing order of a mask's tokens, truncation after a stop token."""

from __future__ import annotations

import torch


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
