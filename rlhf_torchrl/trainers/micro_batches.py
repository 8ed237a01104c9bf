"""One minibatch split into micro-batches whose weighted losses add up to the minibatch's.

- :func:`micro_batches`: this process's slice of a minibatch, as ``gradient_accumulation_steps``
  equal row slices or token-budget groups, each with the weight of its loss.
- :func:`balanced_partition`: rows split over processes into sets of near-equal token sums
  (``distributed.balance``).
- :func:`token_budget_split`: rows grouped by length under a token budget (padded or packed).
- :func:`trim_padding`: a slice cut to its own prompt and response widths.

:func:`~rlhf_torchrl.trainers.update.ppo_update` runs them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K


def trim_padding(td: TensorDictBase) -> TensorDictBase:
    """``td`` cut to its own widths: prompt columns that are padding in every row (on the left) and
    response columns that are padding in every row (on the right) removed.

    Every entry whose second dimension is the response width is cut with the response. Left
    padding only shifts nothing (position ids count from the first real token) and right padding
    is never attended to, so a trimmed batch gives the same log-probs and values on its tokens.

    Args:
        td: a rollout or a slice of one.
    """
    from rlhf_torchrl.modules.sequences import response_attention

    prompt_mask, response_mask = td.get(K.PROMPT_MASK), response_attention(td)
    p_width, r_width = prompt_mask.shape[1], response_mask.shape[1]
    # at least one column each (a prompt predicts the first response token)
    p_keep = max(p_width - int(prompt_mask.any(0).long().argmax()), 1)  # from the first real column
    r_keep = max(int(F.last_token_index(response_mask.any(0, keepdim=True))) + 1, 1)
    if p_keep == p_width and r_keep == r_width:
        return td
    out = td.clone(False)
    for key in K.PROMPT_WIDTH:
        out.set(key, td.get(key)[:, p_width - p_keep :])
    for key, value in td.items(True, True):
        if key not in K.PROMPT_WIDTH and isinstance(value, torch.Tensor) and value.ndim >= 2 \
                and value.shape[1] == r_width:
            out.set(key, value[:, :r_keep])
    return out


def token_budget_split(mask_prompt: torch.Tensor, mask_response: torch.Tensor, max_tokens: int,
                       min_parts: int = 1, packed: bool = False) -> list[torch.Tensor]:
    """Rows grouped into micro-batches of at most ``max_tokens`` padded tokens each (``packed``:
    real tokens each).

    The padded cost of a micro-batch is ``rows * (longest prompt + longest response)`` in it, after
    :func:`trim_padding`; packed (:mod:`rlhf_torchrl.modules.packing`), the sum of its rows' real
    tokens. Rows are sorted by length (longest first) and packed greedily, so each
    micro-batch holds rows of similar length; a row longer than the budget goes alone. Then the
    costliest micro-batches are halved until there are ``min_parts`` (data-parallel processes must
    run the same number of micro-batches); where no micro-batch can be halved, empty ones (no rows)
    are added. Returns one index tensor per micro-batch, longest rows first.

    Args:
        mask_prompt: (B, P) the prompts' attention mask (left-padded).
        mask_response: (B, R) the valid response tokens.
        max_tokens: the token budget of a micro-batch.
        min_parts: the fewest micro-batches to return.
        packed: count real tokens (packed rows) instead of padded ones.
    """
    p_len, r_len = mask_prompt.sum(-1), mask_response.sum(-1)
    order = torch.argsort(p_len + r_len, descending=True, stable=True).tolist()
    p_len, r_len = p_len.tolist(), r_len.tolist()
    groups: list[list[int]] = []
    p_max = r_max = 0
    for i in order:
        p_new, r_new = max(p_max, p_len[i]), max(r_max, r_len[i])
        if packed:  # the sum of the real tokens, kept in p_max
            p_new, r_new = p_max + p_len[i] + r_len[i], 0
        if groups and (p_new if packed else (len(groups[-1]) + 1) * (p_new + r_new)) <= max_tokens:
            groups[-1].append(i)
            p_max, r_max = p_new, r_new
        else:
            groups.append([i])
            p_max, r_max = (p_len[i] + r_len[i], 0) if packed else (p_len[i], r_len[i])

    def cost(g):
        if packed:
            return sum(p_len[i] + r_len[i] for i in g)
        return len(g) * (max(p_len[i] for i in g) + max(r_len[i] for i in g)) if g else 0

    while len(groups) < min_parts:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.append([])
            continue
        g = max(splittable, key=cost)
        k = groups.index(g)
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def balanced_partition(costs: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """The indices of ``costs`` split into ``parts`` sets of near-equal sums, by Karmarkar and
    Karp's largest differencing method (1982), k-way, as verl's ``seqlen_balancing`` spreads
    sequence lengths over data-parallel ranks.

    Every item starts as a partial partition of ``parts`` sets: itself in one, the others empty.
    The two partial partitions of largest spread (heaviest set's sum minus lightest's) are merged,
    the heaviest set of one joined to the lightest of the other, the second heaviest to the second
    lightest, and so on, until one partition is left. A heuristic: ``[8, 7, 6, 5, 4]`` in two
    gives sums 16 and 14 where 15 and 15 exist, but its spread never exceeds the largest cost.
    ``equal_size``: the sorted items start in runs of ``parts``, one in each set, so every set gets
    as many items (one fewer in some, where ``parts`` does not divide their number). Deterministic:
    equal inputs give equal sets on every process.

    Args:
        costs: each item's cost (a row's real tokens).
        parts: the number of sets.
        equal_size: every set gets as many items (within one).

    Returns ``parts`` lists of indices, heaviest set first, each ascending.

    Example:
        >>> balanced_partition([8, 7, 6, 5, 4], 2)
        [[1, 3, 4], [0, 2]]
    """
    if parts < 1:
        raise ValueError(f"balanced_partition into {parts} sets: give at least 1.")
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    heap: list = []
    tie = itertools.count()  # equal spreads merge in the order they were made: deterministic

    def push(sets: list[tuple[int, list[int]]]) -> None:  # sets: (sum, indices)
        sets.sort(key=lambda s: -s[0])  # heaviest first (stable)
        heapq.heappush(heap, (sets[-1][0] - sets[0][0], next(tie), sets))  # largest spread on top

    if equal_size:
        order = [-1] * (-len(order) % parts) + order  # stand-ins of no cost, the lightest run
        for start in range(0, len(order), parts):
            push([(costs[i], [i]) if i >= 0 else (0, []) for i in order[start : start + parts]])
    else:
        for i in order:
            push([(costs[i], [i])] + [(0, []) for _ in range(parts - 1)])
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        push([(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))])
    return [sorted(indices) for _, indices in heap[0][2]]


def micro_batches(
    minibatch: TensorDictBase,
    *,
    rank: int = 0,
    world_size: int = 1,
    gradient_accumulation_steps: int = 1,
    micro_batch_tokens: int | None = None,
    loss_aggregation: str = "token_mean",
    loss_aggregation_constant: float | None = None,
    max_parts=None,
    packed: bool = False,
    balance: bool = False,
) -> list[tuple[TensorDictBase, float]]:
    """This process's micro-batches of one minibatch, each with the weight of its loss.

    Process ``rank`` takes the ``rank``-th of ``world_size`` near-equal row slices of
    ``minibatch`` (``balance``: the ``rank``-th set of rows of near-equal real tokens,
    :func:`balanced_partition`) and splits it into ``gradient_accumulation_steps`` equal row
    slices or, with ``micro_batch_tokens``, token-budget groups (:func:`token_budget_split`; ``packed``: of real
    tokens), each cut to its own widths (:func:`trim_padding`). A micro-batch's loss is aggregated over its own rows
    (:func:`~rlhf_torchrl.functional.aggregate_loss`); its weight is its share of the whole
    minibatch's :func:`~rlhf_torchrl.functional.aggregation_size` (every process's rows):

    ``w_j = size(micro-batch j) / size(minibatch)``, so ``sum_j w_j loss_j = loss(minibatch)``

    over all processes' micro-batches, whatever the split (``token_mean``: the share of the valid
    tokens; the ``seq_mean_*`` modes: the share of the responses). verl's bug #6957 and NeMo-RL's
    #3791 normalised per micro-batch instead, which changes the objective with the split.

    Args:
        minibatch: the whole minibatch (every process's rows).
        rank: this process's rank.
        world_size: the number of processes.
        gradient_accumulation_steps: equal row slices of this process's rows.
        micro_batch_tokens: instead, micro-batches of at most this many tokens (None: off).
        loss_aggregation: the loss's aggregation, one of
            :data:`~rlhf_torchrl.functional.LOSS_AGGREGATIONS`.
        loss_aggregation_constant: ``seq_mean_token_sum_norm``'s ``C``.
        max_parts (Callable | None): ``DataParallel.max_int``, which gives the most micro-batches
            any process has; every process runs as many (one with no rows runs a stand-in row
            with weight 0). None: this process's own count (one process).
        packed: ``micro_batch_tokens`` counts real tokens, not padded ones.
        balance: processes get rows of near-equal real tokens (prompt and response), not equal
            slices: sets of any size under a token budget or packed (micro-batches of real
            tokens), of equal row counts otherwise (equal row slices of a padded batch), each
            process's rows longest first. Changes which process runs a row, never the loss.

    Returns ``[(micro_batch, weight), ...]``, ``weight`` a float.
    """
    from rlhf_torchrl.modules.sequences import response_attention

    if balance and world_size > 1:
        # every attended token, as token_budget_split counts them; the same sets on every process
        lengths = (minibatch.get(K.PROMPT_MASK).sum(-1) + response_attention(minibatch).sum(-1)).tolist()
        chosen = balanced_partition(lengths, world_size,
                                    equal_size=not (micro_batch_tokens or packed))[rank]
        # longest first: equal row slices then hold rows of similar length (less padding), and
        # the j-th micro-batches of the processes similar work (FSDP2 gathers at each forward)
        chosen.sort(key=lambda i: -lengths[i])
        mine = minibatch[torch.tensor(chosen, dtype=torch.long, device=minibatch.device)]
    else:
        size = minibatch.shape[0]
        shares = [size // world_size + (r < size % world_size) for r in range(world_size)]
        start = sum(shares[:rank])
        mine = minibatch[start : start + shares[rank]]  # this process's slice (maybe no rows)
    if micro_batch_tokens:
        masks = mine.get(K.PROMPT_MASK), response_attention(mine)  # every attended token
        parts = token_budget_split(*masks, micro_batch_tokens, packed=packed)
        busiest = max_parts(len(parts)) if max_parts is not None else len(parts)
        if busiest > len(parts):
            parts = token_budget_split(*masks, micro_batch_tokens, min_parts=busiest, packed=packed)
    else:
        parts = list(torch.arange(len(mine)).tensor_split(gradient_accumulation_steps))
    whole = float(F.aggregation_size(minibatch.get(K.RESPONSE_MASK), loss_aggregation,
                                     loss_aggregation_constant))
    out = []
    for rows in parts:
        if rows.numel() == 0:  # keeps the collectives in step; contributes nothing
            source = mine if len(mine) else minibatch
            out.append((trim_padding(source[torch.zeros(1, dtype=torch.long, device=source.device)]),
                        0.0))
            continue
        micro_batch = trim_padding(mine[rows.to(mine.device)])
        part = F.aggregation_size(micro_batch.get(K.RESPONSE_MASK), loss_aggregation,
                                  loss_aggregation_constant)
        out.append((micro_batch, float(part) / whole))
    return out
