"""The rollout's layout: one dense TensorDict per batch with the keys of :mod:`rlhf_torchrl.keys`
(prompt left-padded, response right-padded, a mask each), built from token lists, padded to a
width, concatenated, decoded; and the vocabulary of how a multi-turn episode ended.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.base import _is_leaf_nontensor

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.data.prompts import Prompt, prompt_token_ids, to_prompt

#: why an episode ended (``("episode", "end")``, as an index into this tuple)
END_REASONS = ("answer", "tool_stop", "max_turns", "max_tokens", "length")


def to_rollout(
    batch: TensorDictBase, *, pad_token_id: int, stop_token_ids: Sequence[int], tokenizer=None
) -> TensorDict:
    """Dense rollout from one ``LLMCollector`` batch of shape ``[B, 1]``.

    Keys written (see :mod:`rlhf_torchrl.keys`): prompt tokens/mask (B, P) left-padded, response
    tokens/mask (B, R) right-padded and truncated after the first stop token, ``has_stop_token``
    (B,), with ``tokenizer`` the decoded prompt and response text, and, when the env carries them
    (:func:`make_generation_env`), the prompt conversations and the dataset fields.

    Args:
        batch: one ``LLMCollector`` batch, shape ``[B, 1]``.
        pad_token_id: the pad id.
        stop_token_ids: the ids that end a response.
        tokenizer (transformers.PreTrainedTokenizerBase | None): decodes the text entries (None: no
            text).
    """
    batch = batch.reshape(-1)
    # dense already when the wrapper pads its outputs; padded here if the stack is ragged
    prompt = batch.get(K.PROMPT_TOKENS, as_padded_tensor=True, padding_side="left",
                       padding_value=pad_token_id)
    response = batch.get(K.RESPONSE_TOKENS, as_padded_tensor=True, padding_side="right",
                         padding_value=pad_token_id)
    full_mask = batch.get(("masks", "all_attention_mask"), as_padded_tensor=True,
                          padding_side="left", padding_value=0)
    keys = batch.keys()
    return build_rollout(
        prompt, full_mask[:, : prompt.shape[-1]].bool(), response,
        stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, tokenizer=tokenizer,
        messages=batch.get("query").tolist() if "query" in keys else None,
        fields=batch.get("fields").tolist() if "fields" in keys else None,
    )


def build_rollout(
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    response: torch.Tensor,
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    tokenizer=None,
    messages: list[list[dict]] | None = None,
    fields: list[dict] | None = None,
) -> TensorDict:
    """The rollout layout of :mod:`rlhf_torchrl.keys` from padded prompt and response tokens.

    Args:
        prompt: (B, P) prompt tokens, left-padded.
        prompt_mask: (B, P) their attention mask.
        response: (B, R) response tokens as generated, right-padded (cut here after the first of
            ``stop_token_ids``).
        stop_token_ids: the ids that end a response.
        pad_token_id: the pad id written after a stop token.
        tokenizer (transformers.PreTrainedTokenizerBase | None): decodes the prompt and response
            text (None: no text entries).
        messages: one conversation per row, to ``("messages", "prompt")`` (None: none).
        fields: one dict of dataset columns per row, to ``("data", <column>)`` (None: none).
    """
    response, response_mask, has_stop = F.truncate_after_stop(response, stop_token_ids, pad_token_id)
    # drop columns that are padding in every row (responses that all stopped early)
    width = int(response_mask.sum(-1).max().clamp_min(1))
    response, response_mask = response[:, :width], response_mask[:, :width]
    out = TensorDict(
        {
            K.PROMPT_TOKENS: prompt,
            K.PROMPT_MASK: prompt_mask,
            K.RESPONSE_TOKENS: response,
            K.RESPONSE_MASK: response_mask,
            K.HAS_STOP: has_stop,
            K.GROUP: torch.arange(prompt.shape[0]),  # one response per prompt (a collector of groups sets its own)
        },
        batch_size=[prompt.shape[0]],
    )
    if tokenizer is not None:
        out.set(K.PROMPT_TEXT, decode(tokenizer, prompt, prompt_mask))
        out.set(K.RESPONSE_TEXT, decode(tokenizer, response, response_mask, skip_special=True))
    if messages is not None:
        out.set(K.PROMPT_MESSAGES, NonTensorStack(*(NonTensorData(m) for m in messages)))
    if fields:
        for name in sorted({name for row in fields for name in row}):
            values = [row.get(name) for row in fields]
            out.set((K.DATA, name), NonTensorStack(*(NonTensorData(v) for v in values)))
    return out


def pad_rollout(rollout: TensorDictBase, prompt_width: int, response_width: int,
                pad_token_id: int) -> TensorDictBase:
    """``rollout`` with its prompt entries left-padded to ``prompt_width`` and its response-wide
    entries right-padded to ``response_width`` (pad token for tokens, False for masks, 0
    otherwise): the layout a collector of a wider batch would have produced. Non-tensor entries
    are kept.

    Args:
        rollout: a rollout in :func:`to_rollout`'s layout.
        prompt_width: the prompt width to pad to, ``>=`` the rollout's.
        response_width: the response width to pad to, ``>=`` the rollout's.
        pad_token_id: the pad id for token entries.
    """
    r_local = rollout.get(K.RESPONSE_MASK).shape[1]
    out = rollout.clone(False)
    for key, value in rollout.items(True, True):
        if not isinstance(value, torch.Tensor):
            continue
        fill = pad_token_id if key in (K.PROMPT_TOKENS, K.RESPONSE_TOKENS) else 0
        if key in K.PROMPT_WIDTH:
            out.set(key, _pad_dim1(value, prompt_width, fill, left=True))
        elif value.ndim >= 2 and value.shape[1] == r_local:
            out.set(key, _pad_dim1(value, response_width, fill, left=False))
    return out


def concat_rollouts(rollouts: Sequence[TensorDictBase], pad_token_id: int) -> TensorDict:
    """One rollout of all the rows of ``rollouts`` (in order), padded to the widest prompt and
    response; text and dataset fields included.

    Args:
        rollouts: rollouts in :func:`to_rollout`'s layout.
        pad_token_id: pads the narrower rollouts' tokens.
    """
    p_width = max(r.get(K.PROMPT_MASK).shape[1] for r in rollouts)
    r_width = max(r.get(K.RESPONSE_MASK).shape[1] for r in rollouts)
    padded = [pad_rollout(r, p_width, r_width, pad_token_id) for r in rollouts]
    out = TensorDict(batch_size=[sum(r.shape[0] for r in rollouts)])
    for key, value in padded[0].items(True, True, is_leaf=_is_leaf_nontensor):
        if isinstance(value, torch.Tensor):
            out.set(key, torch.cat([r.get(key) for r in padded]))
        else:
            rows = [v for r in padded for v in r.get(key).tolist()]
            out.set(key, NonTensorStack(*(NonTensorData(v) for v in rows)))
    return out


def _pad_dim1(value: torch.Tensor, width: int, fill, *, left: bool) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing <= 0:
        return value
    pad = torch.full((value.shape[0], missing, *value.shape[2:]), fill, dtype=value.dtype,
                     device=value.device)
    return torch.cat([pad, value] if left else [value, pad], dim=1)


def probe_rollout(
    prompts: Sequence[Prompt | str],
    tokenizer,
    responses: Sequence[str],
    *,
    stop_token_ids: Sequence[int] | None = None,
    stopped: Sequence[bool] | None = None,
    with_log_probs: bool = False,
    with_values: bool = False,
    multi_turn: bool = False,
) -> TensorDict:
    """A rollout in :class:`RolloutCollector`'s layout, made without a model.

    One row per prompt, at most ``len(responses)``: row ``i`` pairs ``prompts[i]`` (rendered and
    tokenised as the env does) with ``responses[i]``. Used to call every reward on the real
    rollout layout before any model is loaded.

    Args:
        prompts: the prompts, as :func:`make_generation_env` takes them.
        tokenizer (transformers.PreTrainedTokenizerBase): renders and tokenises them.
        responses: made-up response texts.
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        stopped: whether each response ends with the first stop token (None: rows 0, 2, ...).
        with_log_probs: also hold the sampler's records (zeros), as a recording collector's
            rollouts do.
        with_values: also hold a value recorder's values (zeros).
        multi_turn: also hold the entries of a
            :class:`~rlhf_torchrl.collectors.MultiTurnCollector`'s episodes (one turn each, no
            tool called).
    """
    rows = [to_prompt(p) for p in prompts[: len(responses)]]
    responses = list(responses)[: len(rows)]
    stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
    stopped = [i % 2 == 0 for i in range(len(rows))] if stopped is None else stopped
    if any(not text and not s for text, s in zip(responses, stopped)):
        raise ValueError("An empty response must end with the stop token (stopped=True).")
    prompt = tokenizer.pad({"input_ids": [prompt_token_ids(tokenizer, r) for r in rows]},
                           padding_side="left", return_tensors="pt")
    response = tokenizer.pad({"input_ids": [
        tokenizer(text, add_special_tokens=False)["input_ids"] + ([stop_token_ids[0]] if s else [])
        for text, s in zip(responses, stopped)]}, padding_side="right", return_tensors="pt")
    rollout = build_rollout(prompt["input_ids"], prompt["attention_mask"].bool(),
                            response["input_ids"], stop_token_ids=stop_token_ids,
                            pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                            messages=[r.messages for r in rows], fields=[r.fields for r in rows])
    if with_log_probs:
        zeros = torch.zeros(rollout.get(K.RESPONSE_MASK).shape)
        rollout.update({K.LOG_PROB: zeros, K.ENTROPY: zeros.clone()})
    if with_values:
        rollout.set(K.VALUE, torch.zeros(*rollout.get(K.RESPONSE_MASK).shape, 1))
    if multi_turn:
        mask = rollout.get(K.RESPONSE_MASK)
        n = mask.shape[0]
        rollout.update({K.OBSERVATION_MASK: torch.zeros_like(mask), K.TURN_REWARD: torch.zeros(mask.shape),
                        K.TURNS: torch.ones(n, dtype=torch.long),
                        K.TOOL_CALLS: torch.zeros(n, dtype=torch.long),
                        K.TOOL_ERRORS: torch.zeros(n, dtype=torch.long),
                        K.EPISODE_END: torch.full((n,), END_REASONS.index("answer"))})
    return rollout


def decode(tokenizer, tokens: torch.Tensor, mask: torch.Tensor, skip_special: bool = False) -> list[str]:
    """Decode the masked tokens of each row.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the tokenizer.
        tokens: (B, T) token ids.
        mask: (B, T) the tokens to decode.
        skip_special: leave special tokens out of the text.
    """
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=skip_special)
        for row, m in zip(tokens, mask.bool())
    ]
