"""A rollout's ``[prompt | response]`` as a model reads it.

Both the actor and the critic read the same four keys: left-padded prompt tokens and mask,
right-padded response tokens and mask (and, in a multi-turn episode, the observation mask). The
full sequence is fed with ``position_ids`` counted from the first real token, so left padding does
not change a single logit. Response token ``t`` is predicted (and valued) from position
``P - 1 + t``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K

IN_KEYS = [K.PROMPT_TOKENS, K.PROMPT_MASK, K.RESPONSE_TOKENS, K.RESPONSE_MASK]
OPTIONAL_IN_KEYS = [K.OBSERVATION_MASK]  # multi-turn episodes: tokens the environment wrote


def response_attention(td: TensorDictBase) -> torch.Tensor:
    """(B, R) bool: the response-width tokens the model attends to, the policy's
    (``("masks", "response")``) and, in a multi-turn episode, the environment's
    (``("masks", "observation")``).

    Args:
        td: a rollout or minibatch.
    """
    mask = td.get(K.RESPONSE_MASK)
    observed = td.get(K.OBSERVATION_MASK, None)
    return mask if observed is None else mask | observed


def model_input_keys(td: TensorDictBase) -> list:
    """The keys :func:`model_inputs` reads that ``td`` has.

    Args:
        td: a rollout or minibatch.
    """
    keys = td.keys(True)
    return [*IN_KEYS, *(k for k in OPTIONAL_IN_KEYS if k in keys)]


def model_inputs(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of ``[prompt | response]``.

    The response part attends to the policy's tokens and, in a multi-turn episode, the
    observation tokens between its turns (:func:`response_attention`).

    Args:
        td: a rollout or minibatch with the prompt and response tokens and masks.

    Shapes: (B, P + R) each.
    """
    attention_mask = torch.cat([td.get(K.PROMPT_MASK), response_attention(td)], dim=1).long()
    return {
        "input_ids": torch.cat([td.get(K.PROMPT_TOKENS), td.get(K.RESPONSE_TOKENS)], dim=1),
        "attention_mask": attention_mask,
        "position_ids": F.position_ids_from_mask(attention_mask),
    }
