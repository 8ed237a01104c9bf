"""The token-level critic (:class:`TokenCritic`): a transformer trunk and a value head, on the
policy's own trunk or a separate network (:func:`make_critic`)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules.actor import HiddenStateHandoff
from rlhf_torchrl.modules.compiled import compiled_region
from rlhf_torchrl.modules.packing import packed_hidden, packing_for, rows_for, to_rows
from rlhf_torchrl.modules.sequences import IN_KEYS, model_inputs
from rlhf_torchrl.runtime import autocast, quiet_loading_bars
from rlhf_torchrl.safe_loading import refusing_code


class TokenCritic(TensorDictModuleBase):
    """Token-level value model: a transformer backbone and a linear value head.

    ``V(s_t)`` for response token ``t`` is read from the hidden state at position ``P - 1 + t``
    (the state before the token is chosen). Writes ``"state_value"`` (B, R, 1) fp32, 0 on pads.

    Args:
        backbone: any HF base model returning ``last_hidden_state`` (a separate copy, or the
            policy's own backbone for a shared-trunk actor-critic).
        head: the value head, reading the hidden states in its own dtype (fp32); None: a new
            ``Linear(hidden_size, 1)``.
        shared_trunk: the critic owns a :class:`HiddenStateHandoff` through which a
            :class:`TokenLevelActor` on the same trunk hands over its hidden states; the critic
            uses them only when they match its inputs.
        autocast_dtype: run the backbone under ``torch.autocast`` in this dtype (None: no
            autocast).
        packing: packed forwards, as :class:`TokenLevelActor`'s.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Linear | None = None,
        shared_trunk: bool = False,
        autocast_dtype: torch.dtype | None = None,
        packing: bool | str = False,
    ):
        super().__init__()
        self.handoff = HiddenStateHandoff() if shared_trunk else None
        self.autocast_dtype = autocast_dtype
        self.backbone = backbone
        self.packing, self._cost = packing_for(backbone, packing, lm_head=False,
                                                  autocast_dtype=autocast_dtype)
        if head is None:
            hidden = backbone.config.hidden_size
            # on the trunk's device (a CUDA policy gets a CUDA head), in fp32 whatever its dtype
            head = nn.Linear(hidden, 1, device=next(backbone.parameters()).device)
            # zero: every value starts at 0, so the first advantages are the returns themselves.
            # A random head (N(0, 1/sqrt(d + 1)), the reward head's init) starts SmolLM2's values
            # ~1.3 rms away from scores of ~0.3 spread, and that noise swamps the advantages
            # until the head has unlearned it (value clipping slows that further).
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.head = head
        self.in_keys = list(IN_KEYS)
        self.out_keys = [K.VALUE]

    @property
    def shares_trunk(self) -> bool:
        return self.handoff is not None

    def modules_to_shard(self) -> list[nn.Module]:
        """The modules FSDP2 shards, each called with tensors: the head, and the backbone unless
        it is the policy's (sharded with the policy)."""
        return [self.head] if self.shares_trunk else [self.backbone, self.head]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        hidden = self.handoff.take(td) if self.handoff is not None else None
        if hidden is None:
            tokens = td.get(K.PROMPT_TOKENS)
            n_prompt, n_response = tokens.shape[1], td.get(K.RESPONSE_TOKENS).shape[1]
            rows = rows_for(td, self.packing, self._cost, self.backbone)
            with autocast(tokens.device, self.autocast_dtype), compiled_region():
                if rows is not None:
                    hidden = packed_hidden(self.backbone, rows)  # (n, H)
                else:
                    hidden = self.backbone(**model_inputs(td), use_cache=False).last_hidden_state
                    hidden = hidden[:, n_prompt - 1 : n_prompt - 1 + n_response]  # (B, R, H)
        # the head outside autocast: values in the head's dtype (fp32 unless built otherwise)
        values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)
        values = values.to(torch.promote_types(values.dtype, torch.float32))  # fp32 (fp64 kept)
        values = to_rows(values, td.get(K.RESPONSE_MASK))  # packed: (n,), the policy tokens'
        td.set(K.VALUE, values.unsqueeze(-1))
        return td


def make_critic(
    *,
    policy: nn.Module,
    tokenizer,
    init: str = "policy",
    name_or_path: str | None = None,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    lora: dict | None = None,
    packing: bool | str = False,
) -> TokenCritic:
    """Build the critic.

    The value network must read the policy's tokens, so its vocabulary must match the tokenizer.

    Args:
        policy: the policy model (its backbone, for ``init="shared"``).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        init: ``"policy"``: a separate copy of the policy's weights (from ``name_or_path``) with a
            new head; ``"reward_model"``/``"model"``: a separate network loaded from
            ``name_or_path`` (a sequence classifier's score head is reused as the value head, so
            values start at the RM's scores); ``"shared"``: a value head on the policy's own
            backbone (one set of weights, trained by both losses).
        name_or_path: the separate network's checkpoint (unused with ``"shared"``).
        dtype: the separate network's dtype.
        attn_implementation: its attention kernel (None: transformers' default).
        autocast_dtype: run the backbone under ``torch.autocast`` (the value head stays fp32).
        lora: keyword arguments of :func:`~rlhf_torchrl.modules.lora.add_lora`: trains a separate
            critic's trunk through LoRA adapters (the head is trained in full); a shared trunk
            follows the policy's. None: full fine-tuning.
        packing: packed forwards (:class:`TokenCritic`).
    """
    from rlhf_torchrl.modules.lora import add_lora, trunk
    from rlhf_torchrl.modules.models import (
        disable_dropout,
        fuse_activations,
        match_vocab,
        pretrained_kwargs,
        resolve_model_path,
    )

    if init == "shared":
        return TokenCritic(trunk(policy), shared_trunk=True, autocast_dtype=autocast_dtype,
                           packing=packing)
    if init not in ("policy", "reward_model", "model"):
        raise ConfigError(
            f"Unknown critic init {init!r}: choose 'policy' (copy of the policy), 'reward_model' "
            "or 'model' (load name_or_path), or 'shared' (head on the policy backbone)."
        )
    if not name_or_path:
        raise ConfigError(f"critic init {init!r} needs a model path: name_or_path= (the recipe's "
                          "value_model.name_or_path).")
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    if config.is_encoder_decoder or getattr(config, "model_type", "") in (
        "bert",
        "roberta",
        "deberta",
        "deberta-v2",
        "distilbert",
        "electra",
    ):
        raise ConfigError(
            f"Value model {name_or_path!r} ({config.model_type}) is bidirectional: a token-level "
            "critic must be a causal (decoder-only) model that reads the policy's tokens."
        )
    _check_same_vocab(path, tokenizer, name_or_path)
    with refusing_code(path), quiet_loading_bars():  # a pickled .bin naming code: one line
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, **pretrained_kwargs(dtype, attn_implementation)
        )
    match_vocab(model, tokenizer)
    fuse_activations(disable_dropout(model))
    head = None
    score = getattr(model, "score", None)
    if init != "policy" and isinstance(score, nn.Linear) and score.out_features == 1:
        head = nn.Linear(score.in_features, 1)
        with torch.no_grad():
            head.weight.copy_(score.weight)
            if score.bias is not None:
                head.bias.copy_(score.bias)
            else:
                head.bias.zero_()
    backbone = model.base_model
    if lora:
        backbone = add_lora(backbone, task_type="FEATURE_EXTRACTION", **lora)
    return TokenCritic(backbone, head, autocast_dtype=autocast_dtype, packing=packing)


def _check_same_vocab(path: str, tokenizer, name: str) -> None:
    """A token-level critic reads the policy's token ids: its tokenizer must map them the same."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return  # no tokenizer files next to the weights: nothing to compare against
    ours = tokenizer.get_vocab()
    if any(ours.get(token) != index for token, index in theirs.items()):
        raise ConfigError(
            f"Value model {name!r} uses a different vocabulary than the policy's tokenizer: a "
            "token-level critic must read the policy's token ids. Initialise it from the policy "
            "(init='policy' or 'shared'; the recipe's value_model.init) or from a model sharing "
            "its tokenizer."
        )
