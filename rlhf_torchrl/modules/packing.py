"""Packed (padding-free) forwards: a batch's real tokens laid end to end, no padding computed.

The padded forward runs ``[prompt | response]`` rows of width ``T = P + R``, left-padded prompts
and right-padded responses, so every row costs ``T`` positions whatever its own length. Packed,
each row's attended tokens (its prompt, its response and, in a multi-turn episode, the
observation tokens between its turns) are copied back to back into ``K`` rows of ``C`` tokens,
with position ids restarting at 0 on each sequence and no attention mask.

transformers does the rest (``masking_utils.find_packed_sequence_indices``, read by
``create_causal_mask`` when the attention mask is None and no cache is used): restarting position
ids mark sequence boundaries, and sdpa, eager and flex attention get a causal mask that never
crosses them; a flash-attention implementation runs its variable-length kernel instead, but only
for one row (``modeling_flash_attention_utils._is_packed_sequence`` needs batch 1), so there
``K = 1``. Nothing here writes a block-diagonal mask. A model whose positions do not come from
``position_ids`` (ALiBi: Bloom, MPT) has no packed path upstream; :func:`packing_unsupported`
finds that with a two-sequence probe, and such a model keeps the padded forward.

The row width ``C`` is chosen by a cost estimate (:class:`SequenceCost`): attention is computed
over all ``C x C`` pairs of a packed row (masked, not skipped, on CPU and by sdpa on CUDA), so one
long row of the whole batch would trade the padding's linear cost for a quadratic one. Rows as
wide as the longest sequence cost no more attention per token than the padded batch; wider ones
(2, 4 ... times, up to one row) are chosen where the estimate says the padding they save pays for
their attention. Sequences are placed first-fit decreasing; a row's unused tail holds token 0 at
position 0, each such token a sequence of its own that nothing reads.

Only the positions that predict a policy token reach the LM head and the value head: ``n``
hidden states, gathered by :attr:`PackedRows.index`, and scattered back to the ``(B, R)`` layout
with zeros elsewhere (:meth:`PackedRows.scatter`), as the padded path leaves its pads.

Example:
    >>> rows = pack_rows(td, cost=SequenceCost.of(model))  # None: run the padded forward
    >>> logits, hidden = packed_logits(model, rows)  # (n, V), (n, H)
    >>> tokens = td.get(K.RESPONSE_TOKENS)[rows.response_mask]  # (n,)
    >>> log_probs = rows.scatter(log_probs_from_logits(logits[None], tokens[None])[0])  # (B, R)
    >>> actor = TokenLevelActor(model, packing=True)  # the same, inside get_dist
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

#: ``model.packing``: off (the padded forward), on (packed wherever the layout allows it), or
#: auto (packed where :class:`SequenceCost` estimates it at most :data:`AUTO_SAVING` of the padded)
PACKING = (False, True, "auto")
#: ``auto`` packs a batch when its estimated cost is at most this share of the padded one: the
#: packing itself (index building, a mask per row) is not free. A first guess, to be measured.
AUTO_SAVING = 0.9


def check_packing(packing: bool | str) -> None:
    """A :data:`PACKING` value, or a ConfigError naming the three.

    Args:
        packing: the value to check.
    """
    if packing not in PACKING or isinstance(packing, int) and not isinstance(packing, bool):
        raise ConfigError(f"packing={packing!r}: choose false (padded rows), true (packed rows) "
                          "or auto (packed where the estimated cost is lower).")


@dataclass(frozen=True)
class SequenceCost:
    """FLOPs of a forward per position, per attended (query, key) pair and per LM-head position;
    the backward scales all three alike, so their ratio is what the layout choice needs.

    Args:
        token: FLOPs per position: the trunk's matrix products.
        pair: FLOPs per attended (query, key) pair: ``QK^T`` and ``AV``.
        head: FLOPs per LM-head position (0: no head).
    """

    token: float
    pair: float
    head: float = 0.0

    @classmethod
    def of(cls, model: nn.Module, lm_head: bool = True) -> SequenceCost:
        """The costs of ``model`` (a causal LM, or a bare trunk with ``lm_head=False``) from its
        config and its parameter count.

        Args:
            model: a causal LM, or a bare trunk.
            lm_head: count the LM head (False: a bare trunk).
        """
        config = model.config
        layers = config.num_hidden_layers
        embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                      for p in m.parameters()}
        head = model.get_output_embeddings() if lm_head else None
        head_params = {id(p) for p in head.parameters()} if head is not None else set()
        trunk = sum(p.numel() for p in model.parameters()
                    if id(p) not in embeddings and id(p) not in head_params)
        width = config.hidden_size
        vocab = config.vocab_size if head is not None else 0
        return cls(token=2.0 * trunk, pair=4.0 * width * layers, head=2.0 * width * vocab)

    def padded(self, rows: int, width: int, response_width: int) -> float:
        """The padded batch: ``rows x width`` positions, ``rows x response_width`` at the head.

        Args:
            rows: the batch's rows.
            width: the padded width, prompt and response.
            response_width: the padded response width (the head's positions per row).
        """
        return rows * width * (self.token + width * self.pair) + rows * response_width * self.head

    def packed(self, n_rows: int, row_width: int, n_predicted: int) -> float:
        return n_rows * row_width * (self.token + row_width * self.pair) + n_predicted * self.head


def plan_rows(lengths: list[int], capacity: int) -> tuple[list[int], list[int], int]:
    """First-fit decreasing: each sequence's packed row and offset in it, and the row count.

    Sequences longer than ``capacity`` are not expected (``capacity`` is at least the longest).

    Args:
        lengths: each sequence's length, in tokens.
        capacity: a packed row's length, in tokens.
    """
    row, offset, room = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, free in enumerate(room) if free >= lengths[i]), len(room))
        if k == len(room):
            room.append(capacity)
        row[i], offset[i] = k, capacity - room[k]
        room[k] -= lengths[i]
    return row, offset, max(len(room), 1)


def _row_width(lengths: list[int], cost: SequenceCost, one_row: bool) -> tuple[int, float]:
    """The packed rows' width with the lowest estimated cost, and that cost (LM head excluded):
    the longest sequence times 1, 2, 4 ... up to one row of everything."""
    total, longest = sum(lengths), max(max(lengths), 1)
    if one_row:  # flash attention's varlen kernel: each sequence's own pairs only
        return total, total * cost.token + sum(n * n for n in lengths) * cost.pair
    best = None
    width = longest
    while True:
        width = min(width, total)
        n_rows = plan_rows(lengths, width)[2]
        estimate = cost.packed(n_rows, width, 0)
        if best is None or estimate < best[1]:
            best = (width, estimate)
        if width >= total:
            return best
        width *= 2


@dataclass
class PackedRows:
    """A batch's attended tokens in ``K`` packed rows of ``C``, and where its predictions go.

    Args:
        input_ids: (K, C) sequences back to back, token 0 on each row's tail.
        position_ids: (K, C) 0, 1, ... per sequence; 0 on the tail.
        index: (n,) positions in the flattened ``(K * C)`` rows whose hidden states predict the
            ``n`` policy tokens of ``response_mask``, in row-major order over ``(B, R)``.
        response_mask: (B, R) bool, where the ``n`` predictions go.
    """

    input_ids: torch.Tensor  # (K, C), sequences back to back, token 0 on each row's tail
    position_ids: torch.Tensor  # (K, C), 0, 1, ... per sequence; 0 on the tail
    index: torch.Tensor  # (n,)
    response_mask: torch.Tensor  # (B, R) bool: where the n predictions go

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, C, H) hidden states -> (n, H) of the predicting positions.

        Args:
            hidden: (K, C, H) the packed rows' hidden states.
        """
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(n,) values of the policy tokens -> (B, R), 0 elsewhere (as the padded path gives).

        Args:
            values: (n,) one value per policy token.
        """
        return to_rows(values, self.response_mask)


def to_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) from the (n,) values of ``mask``'s valid tokens (a packed forward's) or from (B, R)
    values; 0 wherever ``mask`` is False, as the padded path leaves its pads.

    Args:
        values: (n,) values of the valid tokens, or (B, R).
        mask: (B, R) the valid tokens.
    """
    if values.dim() == 1:
        return values.new_zeros(mask.shape).masked_scatter(mask, values)
    return torch.where(mask, values, torch.zeros_like(values))


def pack_rows(td: TensorDictBase, *, cost: SequenceCost, one_row: bool = False,
              auto: bool = False) -> PackedRows | None:
    """``td``'s ``[prompt | response]`` rows packed (:class:`PackedRows`), or None where the
    padded forward must run: a policy token whose predicting position is not attended (no
    packed position holds its state), or, with ``auto``, a packing estimated to save less than
    ``1 - AUTO_SAVING`` of the padded cost.

    Args:
        td: a rollout or minibatch.
        cost: the model's costs, to size the rows and estimate the saving.
        one_row: pack into a single row (a flash-attention kernel reads any length).
        auto: return None where packing saves too little.

    Shapes: reads (B, P) prompt tokens/mask, left-padded, and (B, R) response tokens/masks,
    right-padded (observation tokens between turns attended).
    """
    from rlhf_torchrl.modules.sequences import response_attention

    prompt_mask, response_mask = td.get(K.PROMPT_MASK).bool(), td.get(K.RESPONSE_MASK).bool()
    n_prompt, n_response = prompt_mask.shape[1], response_mask.shape[1]
    attended = torch.cat([prompt_mask, response_attention(td).bool()], dim=1)  # (B, T)
    predicting = attended[:, n_prompt - 1 : n_prompt - 1 + n_response]  # state before token t
    if n_prompt == 0 or bool((response_mask & ~predicting).any()):
        return None
    lengths = attended.sum(1).tolist()
    if not any(lengths):
        return None
    width, estimate = _row_width(lengths, cost, one_row)
    n_predicted = int(response_mask.sum())
    if auto and estimate + n_predicted * cost.head > AUTO_SAVING * cost.padded(
            len(lengths), attended.shape[1], n_response):
        return None
    row, offset, n_rows = plan_rows(lengths, width)
    device = attended.device
    start = torch.tensor(row, device=device) * width + torch.tensor(offset, device=device)  # (B,)
    position = attended.long().cumsum(1) - 1  # (B, T): each attended token's position id
    target = start.unsqueeze(1) + position  # (B, T): its place in the flattened rows
    tokens = torch.cat([td.get(K.PROMPT_TOKENS), td.get(K.RESPONSE_TOKENS)], dim=1)
    input_ids = tokens.new_zeros(n_rows * width)
    input_ids[target[attended]] = tokens[attended]
    position_ids = torch.zeros(n_rows * width, dtype=torch.long, device=device)
    position_ids[target[attended]] = position[attended]
    index = target[:, n_prompt - 1 : n_prompt - 1 + n_response][response_mask]
    return PackedRows(input_ids.view(n_rows, width), position_ids.view(n_rows, width), index,
                      response_mask)


def packing_for(model: nn.Module, packing: bool | str, *, lm_head: bool,
                autocast_dtype: torch.dtype | None = None) -> tuple[bool | str, SequenceCost | None]:
    """``packing`` as ``model`` allows it (:func:`packing_unsupported`: True refused with the
    reason, ``"auto"`` turned off), and the model's :class:`SequenceCost` when on.

    Args:
        model: the model that would run packed.
        packing: False, True or ``"auto"``.
        lm_head: the model runs its LM head (a policy), or is a bare trunk (a critic).
        autocast_dtype: the autocast it runs under (None: none).
    """
    check_packing(packing)
    if not packing:
        return False, None
    reason = packing_unsupported(model, autocast_dtype)
    if reason is not None:
        if packing is True:
            raise ConfigError(f"packing=true: {type(model).__name__} cannot run packed sequences: "
                              f"{reason}. Use packing=false (the recipe's model.packing).")
        return False, None
    return packing, SequenceCost.of(model, lm_head=lm_head)


def rows_for(td: TensorDictBase, packing: bool | str, cost: SequenceCost | None,
             model: nn.Module) -> PackedRows | None:
    """``td`` packed for ``model`` as ``packing`` says (:func:`pack_rows`), or None: padded.

    Args:
        td: a rollout or minibatch.
        packing: as :func:`packing_for` returned it.
        cost: the model's costs (None: packing off).
        model: the model that runs.
    """
    if not packing:
        return None
    return pack_rows(td, cost=cost, one_row=uses_varlen_attention(model), auto=packing == "auto")


def uses_varlen_attention(model: nn.Module) -> bool:
    """Whether ``model`` attends through a flash-attention kernel (variable-length sequences in
    one row) rather than a mask (sdpa, eager, flex).

    Args:
        model: the model.
    """
    from rlhf_torchrl.modules.lora import hf_model

    return "flash" in str(getattr(hf_model(model).config, "_attn_implementation", "") or "")


@contextmanager
def head_inputs(model: nn.Module, select=None):
    """Collects what ``model``'s output embeddings (its LM head) are called with, in a list, for
    the duration of the block: the final hidden states of the positions the head runs on, without
    ``output_hidden_states`` (every layer's states kept, and a graph break in a compiled layer).

    Args:
        model: a causal LM.
        select (Callable | None): hidden -> hidden, replaces the head's input first (None: kept).
    """
    from rlhf_torchrl.modules.lora import hf_model

    kept = []

    def hook(module, args):
        hidden = args[0] if select is None else select(args[0])
        kept.append(hidden)
        return (hidden, *args[1:])

    handle = hf_model(model).get_output_embeddings().register_forward_pre_hook(hook)
    try:
        yield kept
    finally:
        handle.remove()


def packed_logits(model: nn.Module, rows: PackedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM's logits (n, V) at the predicting positions of ``rows``, and the final hidden
    states (n, H) there (a shared-trunk critic's input).

    The model runs as a whole (its own head, any logit scaling, FSDP's hooks); its head is handed
    the ``n`` gathered positions instead of all ``K x C`` (:func:`head_inputs`).

    Args:
        model: the causal LM.
        rows: the packed batch.
    """
    with head_inputs(model, lambda hidden: rows.gather(hidden).unsqueeze(0)) as kept:
        out = model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None,
                    use_cache=False)
    return out.logits[0], kept[0][0]


def packed_hidden(backbone: nn.Module, rows: PackedRows) -> torch.Tensor:
    """A trunk's final hidden states (n, H) at the predicting positions of ``rows``.

    Args:
        backbone: the trunk.
        rows: the packed batch.
    """
    out = backbone(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None,
                   use_cache=False)
    return rows.gather(out.last_hidden_state)


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def packing_unsupported(model: nn.Module, autocast_dtype: torch.dtype | None = None) -> str | None:
    """None if ``model`` computes packed sequences as separate ones, else why not.

    A probe of two sequences packed in one row, under the autocast the model will run in: the
    second's final hidden states must not change when the first does (attention never crosses),
    and must equal those of the second alone (the positions restart). Checked once per model.

    Args:
        model: the model to probe.
        autocast_dtype: the autocast it runs under (None: none).
    """
    from rlhf_torchrl.runtime import autocast

    checked = _CHECKED.setdefault(model, {})
    if autocast_dtype in checked:
        return checked[autocast_dtype]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    generator = torch.Generator().manual_seed(0)
    first, other, second = (torch.randint(0, vocab, (n,), generator=generator) for n in (5, 5, 4))
    device = next(model.parameters()).device
    positions = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0).to(device)

    def last_hidden(ids, pos):
        out = model(input_ids=ids.unsqueeze(0).to(device), position_ids=pos, attention_mask=None,
                    use_cache=False, output_hidden_states=True)
        return out.hidden_states[-1][0].float()

    was_training = model.training
    model.eval()
    try:
        with autocast(device, autocast_dtype):
            a = last_hidden(torch.cat([first, second]), positions)[5:]
            b = last_hidden(torch.cat([other, second]), positions)[5:]
            alone = last_hidden(second, positions[:, :4])
    except (TypeError, ValueError, RuntimeError) as error:  # no position ids, a kernel refused
        reason = f"its forward refused packed inputs ({type(error).__name__}: {error})"
    else:
        scale = float(alone.abs().max().clamp_min(1e-6))
        exact = autocast_dtype is None and next(model.parameters()).dtype == torch.float32
        reason = None
        if not torch.allclose(a, b, rtol=0, atol=1e-5 * scale):
            reason = ("attention crosses packed sequences (its masks do not follow restarting "
                      "position ids: ALiBi models such as Bloom and MPT)")
        elif not torch.allclose(a, alone, rtol=0, atol=(1e-3 if exact else 5e-2) * scale):
            reason = "a packed sequence is not computed as the same sequence alone"
    finally:
        model.train(was_training)
    checked[autocast_dtype] = reason
    return reason
