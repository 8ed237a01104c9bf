"""Token-level actor and critic over (prompt, response) TensorDicts.

Both read the same four keys: left-padded prompt tokens and mask, right-padded response tokens and
mask. The full sequence ``[prompt | response]`` is fed with ``position_ids`` counted from the first
real token, so left padding does not change a single logit. Response token ``t`` is predicted (and
valued) from position ``P - 1 + t``.

A critic on the policy's own trunk (``init="shared"``) has the shape of TorchRL's
``ActorValueOperator``: one trunk, an LM head for the actor, a value head for the critic. TorchRL's
operator runs the trunk once per head; here the actor hands the trunk's output to the critic
through a :class:`HiddenStateHandoff` instead (one trunk forward and backward per minibatch
instead of two). The handoff is explicit and checked: the critic takes the hidden states only if
they were computed for the very same input tensors in the same grad mode, and only once; otherwise
it runs the trunk itself. Nothing is written into the caller's TensorDict, and the result does not
depend on which of the two a loss calls first.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.distributions import Distribution

from .. import functional as F
from .. import keys as K
from ..errors import ConfigError
from ..runtime import autocast
from .compiled import compiled_region
from .models import lm_head_in_fp32
from .packing import head_inputs, packed_hidden, packed_logits, packing_for, rows_for, to_rows

_IN_KEYS = [K.PROMPT_TOKENS, K.PROMPT_MASK, K.RESPONSE_TOKENS, K.RESPONSE_MASK]
_OPTIONAL_IN_KEYS = [K.OBSERVATION_MASK]  # multi-turn episodes: tokens the environment wrote


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
    return [*_IN_KEYS, *(k for k in _OPTIONAL_IN_KEYS if k in keys)]


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


class ResponseTokenDistribution(Distribution):
    """Categorical distributions over the vocabulary, one per response token, masked.

    ``log_prob(tokens)`` and ``entropy()`` are 0 on padded positions, so a mean over all positions
    times ``numel / n_valid`` is the mean over valid tokens. The log-prob is
    :func:`~rlhf_torchrl.functional.log_probs_from_logits` (no log-softmax, a hand-written
    backward).

    Args:
        logits: the model's logits, before the sampling ``temperature``.
        mask: the valid response tokens.
        temperature: the sampling temperature the logits are divided by.

    Shapes: ``logits`` (B, R, V), or (n, V) for the ``n`` valid tokens of ``mask`` alone (a packed
    forward); ``mask`` (B, R).
    """

    arg_constraints: dict = {}
    has_rsample = False

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0):
        self.logits = logits
        self.temperature = temperature
        self.mask = mask.bool()
        super().__init__(batch_shape=mask.shape, validate_args=False)

    def log_prob(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.logits.dim() == 2:  # packed: (1, n, V) and (1, n), the function's layout
            lp = F.log_probs_from_logits(self.logits.unsqueeze(0), tokens[self.mask].unsqueeze(0),
                                         self.temperature)[0]
        else:
            lp = F.log_probs_from_logits(self.logits, tokens, self.temperature)
        return to_rows(lp, self.mask)

    def entropy(self) -> torch.Tensor:
        return to_rows(F.entropy_from_logits(self.logits.float() / self.temperature), self.mask)

    def sample(self, sample_shape=torch.Size()):  # noqa: B008 - torch's signature
        logits = self.logits.float() / self.temperature
        if logits.dim() == 2:  # packed; pads: uniform (they are masked anyway)
            full = logits.new_zeros(*self.mask.shape, logits.shape[-1])
            full[self.mask] = logits
            logits = full
        return torch.distributions.Categorical(logits=logits).sample(sample_shape)


class HiddenStateHandoff:
    """Hands a trunk's hidden states from the actor to a critic on the same trunk, once.

    :meth:`put` keeps the hidden states ((B, R, H), or (n, H) of the policy tokens when packed)
    with the input tensors they were computed from and the grad mode; :meth:`take` returns them only for the same input tensors (identity, not equality: a
    stale rollout with equal tokens never matches) in the same grad mode, and forgets them, so a
    hidden state is never used twice or across an optimiser step.
    """

    def __init__(self):
        self._inputs: tuple | None = None
        self._hidden: torch.Tensor | None = None
        self._grad: bool = False

    def put(self, td: TensorDictBase, hidden: torch.Tensor) -> None:
        self._inputs = tuple(td.get(k) for k in _IN_KEYS)
        self._hidden, self._grad = hidden, torch.is_grad_enabled()

    def take(self, td: TensorDictBase) -> torch.Tensor | None:
        hidden, inputs, grad = self._hidden, self._inputs, self._grad
        self._inputs = self._hidden = None
        if hidden is None or grad != torch.is_grad_enabled():
            return None
        if not all(a is td.get(k) for a, k in zip(inputs, _IN_KEYS)):
            return None
        return hidden


class TokenLevelActor(TensorDictModuleBase):
    """The policy as a TorchRL actor over response tokens (usable by ``ClipPPOLoss``).

    ``get_dist(td)`` runs the causal LM on ``[prompt | response]`` and returns a
    :class:`ResponseTokenDistribution` of the response tokens at the sampling ``temperature``
    (the distribution the tokens were drawn from; log-probs in fp32). The LM head runs only on the
    ``R`` positions that predict response tokens (``logits_to_keep``). ``forward`` writes the
    log-probs of the response tokens to ``out_key``. Model calls run inside
    :func:`~rlhf_torchrl.modules.compiled.compiled_region` (compiled layers, where compiled).

    Args:
        model: the causal LM (plain or PEFT).
        temperature: the sampling temperature the logits are divided by.
        out_key (str | tuple[str, ...]): where ``forward`` writes the log-probs (default
            ``("log_probs", "response")``).
        trunk_critic: a :class:`TokenCritic` on this policy's own trunk
            (``make_critic(init="shared")``): the trunk's hidden states of the response positions
            are handed to it (:class:`HiddenStateHandoff`), which then skips its own trunk
            forward. None: none.
        autocast_dtype: (bf16/fp16) the trunk runs under ``torch.autocast``, the LM head and the
            log-probs in fp32 (:func:`~rlhf_torchrl.modules.models.lm_head_in_fp32`). None: no
            autocast.
        adapters_off: (a PEFT model) run with the LoRA adapters disabled: the base model, used as
            the reference without a second copy (:mod:`rlhf_torchrl.modules.lora`).
        packing: True, or ``"auto"`` (where the estimate says it is cheaper): the rows' real tokens
            run back to back, no padding computed, and the LM head runs on the policy tokens alone
            (:mod:`rlhf_torchrl.modules.packing`); a model that cannot run packed sequences is
            refused with True, kept padded with ``"auto"``.

    Shapes: reads (B, P) and (B, R) tokens/masks; writes (B, R) float32.

    Example:
        >>> actor = TokenLevelActor(model, temperature=0.7)
        >>> actor(rollout)[("log_probs", "response")].shape  # (B, R)
    """

    def __init__(
        self,
        model: nn.Module,
        temperature: float = 1.0,
        out_key=K.LOG_PROB,
        trunk_critic: TokenCritic | None = None,
        autocast_dtype: torch.dtype | None = None,
        adapters_off: bool = False,
        packing: bool | str = False,
    ):
        super().__init__()
        from .lora import is_peft, trunk

        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}.")
        if adapters_off and not is_peft(model):
            raise ConfigError("adapters_off=True needs a PEFT model (modules.lora.add_lora).")
        if autocast_dtype is not None:  # the trunk in bf16/fp16, the logits in fp32
            lm_head_in_fp32(model)
        self.model = model
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        self.adapters_off = adapters_off
        self.handoff = None
        self.packing, self._cost = packing_for(model, packing, lm_head=True,
                                                  autocast_dtype=autocast_dtype)
        if trunk_critic is not None:
            if trunk_critic.handoff is None or trunk_critic.backbone is not trunk(model):
                raise ConfigError(
                    "trunk_critic must be a critic on this policy's own trunk "
                    "(make_critic(policy=..., init='shared')); a separate critic runs its own."
                )
            self.handoff = trunk_critic.handoff
        self.in_keys = list(_IN_KEYS)
        self.out_keys = [out_key]

    def logits(self, td: TensorDictBase) -> torch.Tensor:
        """(B, R, V) logits of the response tokens, as the model gives them (before temperature);
        packed, (n, V) of the ``n`` policy tokens (``("masks", "response")``) alone.

        Args:
            td: a rollout or minibatch with the prompt and response tokens.
        """
        tokens = td.get(K.PROMPT_TOKENS)
        n_prompt, n_response = tokens.shape[1], td.get(K.RESPONSE_TOKENS).shape[1]
        rows = rows_for(td, self.packing, self._cost, self.model)
        adapters = self.model.disable_adapter() if self.adapters_off else nullcontext()
        with adapters, autocast(tokens.device, self.autocast_dtype), compiled_region():
            if rows is not None:
                logits, hidden = packed_logits(self.model, rows)
            else:
                # position P-1+t predicts response token t: the LM head runs on those R positions
                positions = torch.arange(n_prompt - 1, n_prompt - 1 + n_response, device=tokens.device)
                # a shared-trunk critic's input: what the head reads, (B, R, H)
                keep = head_inputs(self.model) if self.handoff is not None else nullcontext([])
                with keep as kept:
                    logits = self.model(**model_inputs(td), logits_to_keep=positions,
                                        use_cache=False).logits
                hidden = kept[0] if kept else None
        if self.handoff is not None:
            self.handoff.put(td, hidden)  # (B, R, H), or (n, H) packed
        return logits

    def get_dist(self, td: TensorDictBase) -> ResponseTokenDistribution:
        return ResponseTokenDistribution(self.logits(td), td.get(K.RESPONSE_MASK), self.temperature)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        td.set(self.out_keys[0], self.get_dist(td).log_prob(td.get(K.RESPONSE_TOKENS)))
        return td


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
        self.in_keys = list(_IN_KEYS)
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
    from .lora import add_lora, trunk
    from .models import disable_dropout, match_vocab, pretrained_kwargs, resolve_model_path

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
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, **pretrained_kwargs(dtype, attn_implementation)
    )
    match_vocab(model, tokenizer)
    disable_dropout(model)
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


@torch.no_grad()
def evaluate_rollout(
    rollout: TensorDictBase,
    *,
    actor: TokenLevelActor,
    reference: TokenLevelActor,
    critic: TokenCritic | None = None,
    chunk_size: int = 16,
    exact_entropy: bool = True,
    recompute_log_probs: bool = False,
) -> TensorDictBase:
    """Old-policy log-probs and entropy, reference log-probs and values, without grad.

    Runs in chunks of ``chunk_size`` rows; writes ``("log_probs", "response")``,
    ``("entropy", "response")``, ``("ref_log_probs", "response")`` (B, R) and ``"state_value"``
    (B, R, 1) (none without a ``critic``: the critic-free estimators), all fp32 and 0 on pads. The entropy is exact (a softmax over the vocabulary) or,
    with ``exact_entropy=False``, the one-sample estimate ``-log p(y_t)`` (unbiased, since ``y_t`` was
    drawn from that same distribution; what TRL logs), which costs nothing.

    Log-probs (and entropies) already in the rollout, recorded while sampling
    (:func:`~rlhf_torchrl.collectors.make_generation_policy` with ``record_log_probs``), are kept
    and the policy is not run, unless ``recompute_log_probs``: a shared-trunk critic then runs the
    trunk alone, without the LM head. Without recorded entropies the entropy is then the sample
    estimate, whatever ``exact_entropy`` says (record them with ``record_entropy``). Values
    recorded while sampling (``value_head``) are kept the same way, and then only the reference
    runs; ``recompute_log_probs`` recomputes them too.

    Args:
        rollout: the scored rollout, written in place.
        actor: the policy's actor.
        reference: the reference's actor.
        critic: the critic (None: no values).
        chunk_size: rows per forward.
        exact_entropy: the entropy from the softmax over the vocabulary (False: ``-log p(y_t)``).
        recompute_log_probs: run the policy even where log-probs were recorded while sampling.
    """
    keys = rollout.keys(True)
    run_actor = recompute_log_probs or K.LOG_PROB not in keys
    run_critic = critic is not None and (recompute_log_probs or K.VALUE not in keys)
    outputs: dict = {K.REF_LOG_PROB: []}
    if run_critic:
        outputs[K.VALUE] = []
    if run_actor:
        outputs.update({K.LOG_PROB: [], K.ENTROPY: []})
    for chunk in rollout.select(*model_input_keys(rollout)).split(chunk_size):
        if run_actor:
            dist = actor.get_dist(chunk)
            log_prob = dist.log_prob(chunk.get(K.RESPONSE_TOKENS))
            outputs[K.LOG_PROB].append(log_prob)
            outputs[K.ENTROPY].append(dist.entropy() if exact_entropy else -log_prob)
            del dist  # free the (b, R, V) logits before the next forward
        if run_critic:  # takes a shared trunk's hidden states
            outputs[K.VALUE].append(critic(chunk).get(K.VALUE))
        outputs[K.REF_LOG_PROB].append(reference(chunk.clone(False)).get(reference.out_keys[0]))
    for key, parts in outputs.items():
        rollout.set(key, torch.cat(parts))
    if not run_actor and K.ENTROPY not in keys:
        rollout.set(K.ENTROPY, -rollout.get(K.LOG_PROB))  # the one-sample estimate (0 on pads)
    return rollout
