"""Policy losses: how each response token's loss is made from the ratio and the advantage, one
registered class per file (:data:`POLICY_LOSSES`, selected by ``ppo.policy_loss``).

``ppo``: PPO's clipped surrogate (``base``); ``gspo``: the clipped surrogate of each response's
ratio; ``cispo``: the REINFORCE term weighted by the truncated, stop-gradient ratio;
``clip_cov`` and ``kl_cov``: entropy controls on the tokens whose log-prob and advantage covary
most.
"""

from rlhf_torchrl.objectives.policy_losses import cispo, clip_cov, gspo, kl_cov  # noqa: F401 - they register
from rlhf_torchrl.objectives.policy_losses.base import (
    POLICY_LOSSES,
    PolicyLoss,
    SurrogateInputs,
    make_policy_loss,
)

__all__ = ["POLICY_LOSSES", "PolicyLoss", "SurrogateInputs", "make_policy_loss"]
