"""What a policy loss is: a registered class that turns the new and old log-probs and the
advantages into each response token's loss, inside :class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`.

The loss around it stays one: the value, entropy and KL terms, the off-policy weight, the
aggregation over tokens and the diagnostics are :class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`'s
for every policy loss. A policy loss says three things, each a method with PPO's behaviour as
its default:

- :meth:`PolicyLoss.log_weight`: the log-ratio the surrogate is taken of (PPO: each token's own;
  GSPO: its response's);
- :meth:`PolicyLoss.per_token`: each token's loss (PPO: ``ClipPPOLoss``'s clipped surrogate);
- :meth:`PolicyLoss.prepare_minibatch`: what it reads off the whole minibatch before it is split
  into micro-batches (the covariance controls' token choice).

and its class attributes answer what the config may combine with it: :attr:`~PolicyLoss.aggregations`
and :attr:`~PolicyLoss.supports_dual_clip`. A new loss is one file:
``@POLICY_LOSSES.register("name")`` on a subclass; ``ppo.policy_loss=name`` selects it and
``ppo.policy_loss_args`` gives its ``__init__`` its settings.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.registry import Registry


@dataclass
class SurrogateInputs:
    """What a policy loss's :meth:`PolicyLoss.per_token` reads, all (B, R) over response tokens.

    Args:
        log_weight: ``log pi - log pi_old`` as :meth:`PolicyLoss.log_weight` made it, with the
            gradient of the new log-probs.
        advantage: the advantages.
        mask: the valid response tokens.
        clip_low: the ratio's lower bound, ``1 - eps_low``.
        clip_high: the ratio's upper bound, ``1 + eps_high``.
        is_weight: the off-policy weight ``pi_old / pi_sampler`` on each token's surrogate (no
            gradient; None: no correction).
        clipped_loss: ``ClipPPOLoss``'s per-token clipped surrogate
            ``-min(w r A, w clip(r) A)`` of the same ``log_weight``, ``w`` the off-policy weight.
        tensordict: the micro-batch (what :meth:`PolicyLoss.prepare_minibatch` wrote is in it).
    """

    log_weight: torch.Tensor
    advantage: torch.Tensor
    mask: torch.Tensor
    clip_low: float
    clip_high: float
    is_weight: torch.Tensor | None
    clipped_loss: torch.Tensor
    tensordict: TensorDictBase


class PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017), as TorchRL's ``ClipPPOLoss`` computes it:
    ``-min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)`` per token, ``r_t = pi / pi_old``."""

    name: str
    #: the ``ppo.loss_aggregation`` modes it is defined for (None: every one)
    aggregations: tuple[str, ...] | None = None
    #: ``ppo.dual_clip`` applies to its per-token loss
    supports_dual_clip: bool = True

    def log_weight(self, log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The log-ratio the surrogate is taken of, (B, R), from each token's ``log pi - log
        pi_old`` (with its gradient). PPO: as it is.

        Args:
            log_weight: each token's log-ratio.
            mask: the valid response tokens.
        """
        return log_weight

    def per_token(self, inputs: SurrogateInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, diagnostics)``: each token's loss (B, R; padding is masked out afterwards) and
        the loss's own diagnostics (scalars, logged as ``policy/<name>``). PPO: the clipped
        surrogate, no diagnostics of its own.

        Args:
            inputs: the surrogate's inputs.
        """
        return inputs.clipped_loss, {}

    def prepare_minibatch(self, td: TensorDictBase) -> TensorDictBase:
        """Write what the loss needs from the whole minibatch before it is split (in place;
        returns ``td``). PPO: nothing.

        Args:
            td: the whole minibatch: old log-probs, advantages, mask.
        """
        return td

    def check(self, *, loss_aggregation: str, dual_clip: float | None) -> None:
        """One line where the loss's settings cannot go with this policy loss."""
        if self.aggregations is not None and loss_aggregation not in self.aggregations:
            raise ConfigError(f"ppo.policy_loss={self.name} is defined for ppo.loss_aggregation="
                              f"{' or '.join(self.aggregations)} (now {loss_aggregation}): set it.")
        if dual_clip is not None and not self.supports_dual_clip:
            raise ConfigError(f"ppo.policy_loss={self.name} has no clipped surrogate for "
                              f"ppo.dual_clip={dual_clip} to cap: set ppo.dual_clip=null.")


#: the values of ``ppo.policy_loss``
POLICY_LOSSES: Registry[type[PolicyLoss]] = Registry("ppo.policy_loss", "policy loss")
POLICY_LOSSES.register("ppo")(PolicyLoss)


def make_policy_loss(name: str = "ppo", args: dict | None = None) -> PolicyLoss:
    """The policy loss registered as ``name``, made with ``args``; one line naming what it takes
    where an argument is not one of them.

    Args:
        name: a value of ``ppo.policy_loss``.
        args: ``ppo.policy_loss_args``: its ``__init__``'s keyword arguments.
    """
    cls = POLICY_LOSSES.get(name)
    args = dict(args or {})
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self")]
    unknown = sorted(set(args) - {p.name for p in params})
    if unknown:
        takes = ", ".join(p.name for p in params) or "no arguments"
        raise ConfigError(f"ppo.policy_loss_args: {', '.join(unknown)} is not a setting of "
                          f"ppo.policy_loss={name} (it takes {takes}).")
    return cls(**args)
