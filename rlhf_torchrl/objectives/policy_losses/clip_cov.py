"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617): an entropy control.

The policy's entropy falls as fast as the covariance of a token's log-prob and its advantage is
positive: confident tokens with high advantage sharpen the distribution further. Clip-Cov takes
a small random share of the tokens whose covariance ``(log pi_t - mean log pi) (A_t - mean A)``
lies in ``[low, high]`` and detaches their gradient; the rest is PPO's clipped surrogate. The
paper's settings: ``ratio=2e-4``, ``low=1``, ``high=5``.

The covariance is taken once per minibatch, over its valid tokens, with the sampling policy's
log-probs (the log-probs the update starts from), so the choice does not depend on how the
minibatch is split into micro-batches; the random share is drawn from torch's generator, which the
run seeds and a checkpoint restores.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.policy_losses.base import POLICY_LOSSES, PolicyLoss, SurrogateInputs


@POLICY_LOSSES.register("clip_cov")
class ClipCovLoss(PolicyLoss):
    """Clip-Cov: PPO's clipped surrogate with the gradient of a few high-covariance tokens cut.

    Args:
        ratio: the share of the minibatch's valid tokens whose gradient is cut (at least one).
        low: the lower bound of the covariance of a token that may be cut.
        high: its upper bound.
    """

    def __init__(self, *, ratio: float = 2e-4, low: float = 1.0, high: float = 5.0):
        if not 0 < ratio <= 1 or not low < high:
            raise ConfigError(f"ppo.policy_loss_args for clip_cov: ratio must be in (0, 1] and "
                              f"low < high, got ratio={ratio}, low={low}, high={high}.")
        self.ratio, self.low, self.high = float(ratio), float(low), float(high)

    def prepare_minibatch(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(K.RESPONSE_MASK)
        cov = F.token_covariance(td.get(K.LOG_PROB), td.get(K.ADVANTAGE).squeeze(-1), mask)
        eligible = mask & (cov >= self.low) & (cov <= self.high)
        td.set(K.COV_SELECTED, F.random_subset(eligible, _count(self.ratio, mask)))
        return td

    def per_token(self, inputs: SurrogateInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        selected = inputs.tensordict.get(K.COV_SELECTED)
        loss = torch.where(selected, inputs.clipped_loss.detach(), inputs.clipped_loss)
        return loss, {"cov_selected_frac": F.masked_mean(selected.to(loss.dtype), inputs.mask)}


def _count(ratio: float, mask: torch.Tensor) -> int:
    """``max(1, int(ratio * valid tokens))``: the tokens a covariance control acts on."""
    return max(1, int(ratio * int(mask.sum())))
