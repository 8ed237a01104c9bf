"""Length shaping and score normalisation: DAPO's soft overlong punishment, and the running mean
and variance (Welford, merged a batch at a time) that normalise each source's scores."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), times ``penalty``.

    With ``L_max = max_length`` and ``L_cache = buffer``::

        R(y) = 0                                  |y| <= L_max - L_cache
               ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               -1                                 L_max < |y|

    so the penalty falls linearly from 0 (at ``L_max - L_cache`` tokens) to ``-penalty`` (at
    ``L_max``), and stays there beyond (verl's ``DAPORewardManager``, OpenRLHF's
    ``apply_overlong_penalty``: ``min(-exceed / buffer * factor, 0)``, the excess capped at the
    buffer).

    Args:
        lengths: each response's length in tokens.
        max_length: ``L_max``, the most tokens a response may have (``generation.max_new_tokens``).
        buffer: ``L_cache``, the tokens before ``L_max`` over which the penalty grows,
            ``0 < buffer < max_length``.
        penalty: the penalty at ``L_max`` (DAPO: 1).

    Shapes: ``lengths`` (B,); returns (B,) float32, in ``[-penalty, 0]``.

    Example:
        >>> overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_length=16, buffer=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    if not 0 < buffer < max_length:
        raise ValueError(f"The overlong buffer ({buffer} tokens) must be > 0 and below the "
                         f"longest response ({max_length} tokens).")
    exceed = (lengths.to(torch.float32) - (max_length - buffer)).clamp(0, buffer)
    return 0.0 - penalty * exceed / buffer  # (0.0 - 0: no -0.0 in the output)


def batch_moments(values: torch.Tensor, index: torch.Tensor, n_groups: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's count, mean and sum of squared deviations ``M2 = sum (x - mean)^2`` in one
    batch (float64; a group without values: 0, 0, 0).

    Args:
        values: the values.
        index: each value's group, in ``[0, n_groups)``.
        n_groups: the number of groups.

    Shapes: ``values``, ``index`` (B,); returns three (n_groups,) tensors.

    Example:
        >>> batch_moments(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 2)
        (tensor([2., 1.], dtype=torch.float64), tensor([2., 5.], dtype=torch.float64), tensor([2., 0.], dtype=torch.float64))
    """
    x, index = values.to(torch.float64), index.long()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(x))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, x)
    mean = total / count.clamp_min(1)
    m2 = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, (x - mean[index]) ** 2)
    return count, mean, m2


def merge_moments(count_a: torch.Tensor, mean_a: torch.Tensor, m2_a: torch.Tensor,
                  count_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and ``M2`` of two sets of values together, from each set's (Chan, Golub and
    LeVeque 1979, the pairwise form of Welford's algorithm): exact, whatever the split.

    ``n = n_a + n_b``, ``d = mean_b - mean_a``, ``mean = mean_a + d * n_b / n``,
    ``M2 = M2_a + M2_b + d^2 * n_a * n_b / n`` (a group with ``n = 0`` stays 0, 0, 0).

    Args:
        count_a, mean_a, m2_a: the first set's moments.
        count_b, mean_b, m2_b: the second set's.

    Shapes: all the same shape, e.g. (n_groups,); returns three of it.

    Example:
        >>> merge_moments(*[torch.tensor([v], dtype=torch.float64) for v in (2, 2, 2, 1, 5, 0)])
        (tensor([3.], dtype=torch.float64), tensor([3.], dtype=torch.float64), tensor([8.], dtype=torch.float64))
    """
    count = count_a + count_b
    safe = count.clamp_min(1)
    delta = mean_b - mean_a
    mean = mean_a + delta * count_b / safe
    m2 = m2_a + m2_b + delta**2 * count_a * count_b / safe
    return count, mean, m2
