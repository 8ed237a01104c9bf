"""The policy as a token-level TorchRL actor over (prompt, response) TensorDicts
(:class:`TokenLevelActor`), and the handoff of its trunk's hidden states to a critic on the same
trunk.

A critic on the policy's own trunk (``init="shared"``, :mod:`rlhf_torchrl.modules.critic`) has
the shape of TorchRL's ``ActorValueOperator``: one trunk, an LM head for the actor, a value head
for the critic. TorchRL's operator runs the trunk once per head; here the actor hands the trunk's
output to the critic through a :class:`HiddenStateHandoff` instead (one trunk forward and
backward per minibatch instead of two). The handoff is explicit and checked: the critic takes the
hidden states only if they were computed for the very same input tensors in the same grad mode,
and only once; otherwise it runs the trunk itself. Nothing is written into the caller's
TensorDict, and the result does not depend on which of the two a loss calls first. How the inputs
are laid out: :mod:`rlhf_torchrl.modules.sequences`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.distributions import Distribution

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules.compiled import compiled_region
from rlhf_torchrl.modules.models import lm_head_in_fp32
from rlhf_torchrl.modules.packing import head_inputs, packed_logits, packing_for, rows_for, to_rows
from rlhf_torchrl.modules.sequences import IN_KEYS, model_inputs
from rlhf_torchrl.runtime import autocast

if TYPE_CHECKING:
    from rlhf_torchrl.modules.critic import TokenCritic


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
        self._inputs = tuple(td.get(k) for k in IN_KEYS)
        self._hidden, self._grad = hidden, torch.is_grad_enabled()

    def take(self, td: TensorDictBase) -> torch.Tensor | None:
        hidden, inputs, grad = self._hidden, self._inputs, self._grad
        self._inputs = self._hidden = None
        if hidden is None or grad != torch.is_grad_enabled():
            return None
        if not all(a is td.get(k) for a, k in zip(inputs, IN_KEYS)):
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
        from rlhf_torchrl.modules.lora import is_peft, trunk

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
        self.in_keys = list(IN_KEYS)
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
