"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585).

PPO's clip drops the gradient of a token whose ratio left the clip range: rare tokens that start
a reflection are clipped away after their first update. CISPO clips the importance weight instead
and keeps every token's gradient: ``loss_t = -sg(min(r_t, 1 + eps_high)) A_t log pi(y_t)``, the
REINFORCE term weighted by the truncated, stop-gradient ratio. Here its value is written as
``-sg(r_hat_t) A_t pi / sg(pi)``, which has the same gradient and reads as a surrogate (``-r_hat_t
A_t``). No lower bound by default, as in the paper (``truncate_low=true``: also ``1 - eps_low``).

TorchRL's ``CISPOLoss`` (torchrl 0.14.1) clamps the ratio with its gradient, so a clipped token
gets none, which is the failure CISPO is for (``tests/test_torchrl_upstream.py`` keeps it).
"""

from __future__ import annotations

import torch

from rlhf_torchrl.objectives.policy_losses.base import POLICY_LOSSES, PolicyLoss, SurrogateInputs


@POLICY_LOSSES.register("cispo")
class CISPOLoss(PolicyLoss):
    """CISPO: the REINFORCE term weighted by the truncated, stop-gradient importance ratio.

    Args:
        truncate_low: truncate the ratio at ``1 - eps_low`` too (the paper: no lower bound).
    """

    supports_dual_clip = False

    def __init__(self, *, truncate_low: bool = False):
        self.truncate_low = bool(truncate_low)

    def per_token(self, inputs: SurrogateInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_weight = inputs.log_weight
        ratio = log_weight.detach().exp()
        low = inputs.clip_low if self.truncate_low else 0.0
        truncated = ratio.clamp(min=low, max=inputs.clip_high)
        if inputs.is_weight is not None:
            truncated = truncated * inputs.is_weight
        with_grad = torch.exp(log_weight - log_weight.detach())  # 1, with grad log pi
        loss = -truncated * with_grad * inputs.advantage
        mask = inputs.mask
        cut = (ratio > inputs.clip_high) | (ratio < low)
        return loss, {"cispo_truncated_frac": (cut & mask).sum() / mask.sum().clamp(min=1)}
