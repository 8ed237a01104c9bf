"""Token-level actor and critic over (prompt, response) TensorDicts.

Both read the same four keys: left-padded prompt tokens and mask, right-padded response tokens and
mask. The full sequence ``[prompt | response]`` is fed with ``position_ids`` counted from the first
real token, so left padding does not change a single logit. Response token ``t`` is predicted (and
valued) from position ``P - 1 + t``.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.distributions import Distribution

from .. import functional as F
from .. import keys as K

_IN_KEYS = [K.PROMPT_TOKENS, K.PROMPT_MASK, K.RESPONSE_TOKENS, K.RESPONSE_MASK]


def model_inputs(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of ``[prompt | response]``.

    Shapes: (B, P + R) each.
    """
    attention_mask = torch.cat([td.get(K.PROMPT_MASK), td.get(K.RESPONSE_MASK)], dim=1).long()
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

    Shapes: ``logits`` (B, R, V), the model's, before the sampling ``temperature``; ``mask`` (B, R).
    """

    arg_constraints: dict = {}
    has_rsample = False

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0):
        self.logits = logits
        self.temperature = temperature
        self.mask = mask.bool()
        super().__init__(batch_shape=mask.shape, validate_args=False)

    def log_prob(self, tokens: torch.Tensor) -> torch.Tensor:
        lp = F.log_probs_from_logits(self.logits, tokens, self.temperature)
        return torch.where(self.mask, lp, torch.zeros_like(lp))

    def entropy(self) -> torch.Tensor:
        ent = F.entropy_from_logits(self.logits.float() / self.temperature)
        return torch.where(self.mask, ent, torch.zeros_like(ent))

    def sample(self, sample_shape=torch.Size()):  # noqa: B008 - torch's signature
        logits = self.logits.float() / self.temperature
        return torch.distributions.Categorical(logits=logits).sample(sample_shape)


class TokenLevelActor(TensorDictModuleBase):
    """The policy as a TorchRL actor over response tokens (usable by ``ClipPPOLoss``).

    ``get_dist(td)`` runs the causal LM on ``[prompt | response]`` and returns a
    :class:`ResponseTokenDistribution` of the response tokens at the sampling ``temperature``
    (the distribution the tokens were drawn from; log-probs in fp32). The LM head runs only on the
    ``R`` positions that predict response tokens (``logits_to_keep``). ``forward`` writes the
    log-probs of the response tokens to ``out_key``. With ``write_hidden`` (a critic sharing the policy's trunk),
    it also leaves the last hidden states of the response positions under ``("hidden",
    "response")`` so that the critic skips its own forward.

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
        write_hidden: bool = False,
    ):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        self.model = model
        self.temperature = temperature
        self.write_hidden = write_hidden
        self.in_keys = list(_IN_KEYS)
        self.out_keys = [out_key] + ([K.HIDDEN] if write_hidden else [])

    def logits(self, td: TensorDictBase) -> torch.Tensor:
        """(B, R, V) logits of the response tokens, as the model gives them (before temperature)."""
        n_prompt = td.get(K.PROMPT_TOKENS).shape[1]
        n_response = td.get(K.RESPONSE_TOKENS).shape[1]
        # position P-1+t predicts response token t: the LM head runs on those R positions only
        positions = torch.arange(n_prompt - 1, n_prompt - 1 + n_response,
                                 device=td.get(K.PROMPT_TOKENS).device)
        out = self.model(
            **model_inputs(td),
            logits_to_keep=positions,
            use_cache=False,
            output_hidden_states=self.write_hidden,
        )
        if self.write_hidden:
            td.set(K.HIDDEN, out.hidden_states[-1][:, n_prompt - 1 : n_prompt - 1 + n_response])
        return out.logits

    def get_dist(self, td: TensorDictBase) -> ResponseTokenDistribution:
        return ResponseTokenDistribution(self.logits(td), td.get(K.RESPONSE_MASK), self.temperature)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        td.set(self.out_keys[0], self.get_dist(td).log_prob(td.get(K.RESPONSE_TOKENS)))
        return td


class TokenCritic(TensorDictModuleBase):
    """Token-level value model: a transformer backbone and a linear value head.

    ``V(s_t)`` for response token ``t`` is read from the hidden state at position ``P - 1 + t``
    (the state before the token is chosen). Writes ``"state_value"`` (B, R, 1) fp32, 0 on pads.
    The backbone is any HF base model returning ``last_hidden_state`` (a separate copy, or the
    policy's own backbone for a shared-trunk actor-critic). With ``read_hidden``, hidden states
    already left in the TensorDict by a shared-trunk actor (``("hidden", "response")``) are used
    instead of running the backbone again.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear | None = None, read_hidden: bool = False):
        super().__init__()
        self.read_hidden = read_hidden
        self.backbone = backbone
        if head is None:
            hidden = backbone.config.hidden_size
            head = nn.Linear(hidden, 1)
            # N+ details (Huang et al. 2024) / Stiennon et al. 2020 p.11: std = 1/sqrt(d + 1)
            nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden + 1))
            nn.init.zeros_(head.bias)
        self.head = head
        self.in_keys = list(_IN_KEYS)
        self.out_keys = [K.VALUE]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        hidden = td.get(K.HIDDEN, None) if self.read_hidden else None
        if hidden is None:
            n_prompt = td.get(K.PROMPT_TOKENS).shape[1]
            n_response = td.get(K.RESPONSE_TOKENS).shape[1]
            hidden = self.backbone(**model_inputs(td), use_cache=False).last_hidden_state
            hidden = hidden[:, n_prompt - 1 : n_prompt - 1 + n_response]  # (B, R, H)
        values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()
        values = torch.where(td.get(K.RESPONSE_MASK), values, torch.zeros_like(values))
        td.set(K.VALUE, values.unsqueeze(-1))
        return td


def make_critic(
    *,
    policy: nn.Module,
    tokenizer,
    init: str = "policy",
    name_or_path: str | None = None,
    dtype: str = "float32",
) -> TokenCritic:
    """Build the critic.

    ``init``:
      - ``"policy"``: a separate copy of the policy's weights (from ``name_or_path``) with a new head;
      - ``"reward_model"``/``"model"``: a separate network loaded from ``name_or_path`` (a sequence
        classifier's score head is reused as the value head, so values start at the RM's scores);
      - ``"shared"``: a value head on the policy's own backbone (one set of weights, trained by
        both losses).
    The value network must read the policy's tokens, so its vocabulary must match the tokenizer.
    """
    from .models import disable_dropout, match_vocab, resolve_model_path

    if init == "shared":
        return TokenCritic(policy.base_model, read_hidden=True)
    if init not in ("policy", "reward_model", "model"):
        raise ValueError(
            f"Unknown critic init {init!r}: choose 'policy' (copy of the policy), 'reward_model' "
            "or 'model' (load value_model.name_or_path), or 'shared' (head on the policy backbone)."
        )
    if not name_or_path:
        raise ValueError(f"critic init {init!r} needs a model path (value_model.name_or_path).")
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
        raise ValueError(
            f"Value model {name_or_path!r} ({config.model_type}) is bidirectional: a token-level "
            "critic must be a causal (decoder-only) model that reads the policy's tokens."
        )
    _check_same_vocab(path, tokenizer, name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=getattr(torch, dtype)
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
    return TokenCritic(model.base_model, head)


def _check_same_vocab(path: str, tokenizer, name: str) -> None:
    """A token-level critic reads the policy's token ids: its tokenizer must map them the same."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return  # no tokenizer files next to the weights: nothing to compare against
    ours = tokenizer.get_vocab()
    if any(ours.get(token) != index for token, index in theirs.items()):
        raise ValueError(
            f"Value model {name!r} uses a different vocabulary than the policy's tokenizer: a "
            "token-level critic must read the policy's token ids. Initialise it from the policy "
            "(value_model.init=policy or shared) or from a model sharing its tokenizer."
        )


@torch.no_grad()
def evaluate_rollout(
    rollout: TensorDictBase,
    *,
    actor: TokenLevelActor,
    reference: TokenLevelActor,
    critic: TokenCritic,
    chunk_size: int,
    exact_entropy: bool = True,
) -> TensorDictBase:
    """Old-policy log-probs and entropy, reference log-probs and values, without grad.

    Runs in chunks of ``chunk_size`` rows; writes ``("log_probs", "response")``,
    ``("entropy", "response")``, ``("ref_log_probs", "response")`` (B, R) and ``"state_value"``
    (B, R, 1), all fp32 and 0 on pads. The entropy is exact (a softmax over the vocabulary) or,
    with ``exact_entropy=False``, the one-sample estimate ``-log p(y_t)`` (unbiased, since ``y_t`` was
    drawn from that same distribution; what TRL logs), which costs nothing.

    Log-probs (and entropies) already in the rollout, recorded while sampling
    (:func:`~rlhf_torchrl.collectors.make_generation_policy` with ``record_log_probs``), are kept
    and the policy is not run: a shared-trunk critic then runs the trunk alone, without the LM head.
    Without recorded entropies the entropy is then the sample estimate, whatever ``exact_entropy``
    says (record them with ``record_entropy``).
    """
    have_log_probs = K.LOG_PROB in rollout.keys(True)
    have_entropy = K.ENTROPY in rollout.keys(True)
    outputs: dict = {K.REF_LOG_PROB: [], K.VALUE: []}
    if not have_log_probs:
        outputs.update({K.LOG_PROB: [], K.ENTROPY: []})
    for chunk in rollout.select(*_IN_KEYS).split(chunk_size):
        if not have_log_probs:
            dist = actor.get_dist(chunk)
            log_prob = dist.log_prob(chunk.get(K.RESPONSE_TOKENS))
            outputs[K.LOG_PROB].append(log_prob)
            outputs[K.ENTROPY].append(dist.entropy() if exact_entropy else -log_prob)
            del dist  # free the (b, R, V) logits before the next forward
        outputs[K.VALUE].append(critic(chunk).get(K.VALUE))  # reuses a shared trunk's hidden states
        outputs[K.REF_LOG_PROB].append(reference(chunk.clone(False)).get(reference.out_keys[0]))
    for key, parts in outputs.items():
        rollout.set(key, torch.cat(parts))
    if have_log_probs and not have_entropy:
        rollout.set(K.ENTROPY, -rollout.get(K.LOG_PROB))  # the one-sample estimate (0 on pads)
    return rollout
