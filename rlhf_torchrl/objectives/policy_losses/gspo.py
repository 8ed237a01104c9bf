"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

The importance ratio is the response's, not the token's: ``s_i = exp(mean_t log(pi / pi_old))``
over response ``i``'s valid tokens (a length-normalised sequence likelihood ratio), clipped as
PPO clips a token's, ``-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``. A token's ratio is
``sg(s_i) pi(y_t) / sg(pi(y_t))`` (GSPO-token): its value is ``s_i`` and its gradient ``s_i
grad log pi(y_t)``, so per-token advantages still reach their tokens, and with one advantage per
response it is GSPO's gradient exactly. The paper's objective averages over responses, so it is
defined for ``ppo.loss_aggregation=seq_mean_token_mean``, and its clip ranges are about 1000 times
smaller than PPO's (``ppo.clip_epsilon_low=3e-4 ppo.clip_epsilon_high=4e-4`` in the paper).
"""

from __future__ import annotations

import torch

from rlhf_torchrl import functional as F
from rlhf_torchrl.objectives.policy_losses.base import POLICY_LOSSES, PolicyLoss


@POLICY_LOSSES.register("gspo")
class GSPOLoss(PolicyLoss):
    """GSPO: PPO's clipped surrogate on each response's length-normalised likelihood ratio."""

    aggregations = ("seq_mean_token_mean",)

    def log_weight(self, log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        sequence = F.sequence_log_ratio(log_weight.detach(), mask)  # (B,)
        # value: the response's log-ratio; gradient: the token's own
        return log_weight - log_weight.detach() + sequence.unsqueeze(-1)
