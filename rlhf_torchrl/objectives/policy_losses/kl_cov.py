"""KL-Cov (Cui et al. 2025, arXiv 2505.22617): an entropy control.

The tokens of highest covariance between log-prob and advantage drive the entropy down (see
:mod:`.clip_cov`). KL-Cov leaves the surrogate unclipped, ``-r_t A_t``, and adds a KL penalty
``coef * |log pi_t - log pi_old_t|`` on the top ``ratio`` share of the minibatch's valid tokens
by covariance ``(log pi_t - mean log pi) (A_t - mean A)``. The paper's settings: ``ratio=2e-3``
(2e-4 for its larger models), ``coef=1``. The covariance is taken as Clip-Cov's is: once per
minibatch, with the sampling policy's log-probs.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.policy_losses.base import POLICY_LOSSES, PolicyLoss, SurrogateInputs
from rlhf_torchrl.objectives.policy_losses.clip_cov import _count


@POLICY_LOSSES.register("kl_cov")
class KLCovLoss(PolicyLoss):
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the tokens of highest covariance.

    Args:
        ratio: the share of the minibatch's valid tokens penalised (at least one).
        coef: the penalty's weight.
    """

    supports_dual_clip = False

    def __init__(self, *, ratio: float = 2e-3, coef: float = 1.0):
        if not 0 < ratio <= 1 or coef < 0:
            raise ConfigError(f"ppo.policy_loss_args for kl_cov: ratio must be in (0, 1] and "
                              f"coef >= 0, got ratio={ratio}, coef={coef}.")
        self.ratio, self.coef = float(ratio), float(coef)

    def prepare_minibatch(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(K.RESPONSE_MASK)
        cov = F.token_covariance(td.get(K.LOG_PROB), td.get(K.ADVANTAGE).squeeze(-1), mask)
        td.set(K.COV_SELECTED, F.top_k_tokens(cov, mask, _count(self.ratio, mask)))
        return td

    def per_token(self, inputs: SurrogateInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weight = inputs.log_weight.exp()
        if inputs.is_weight is not None:
            weight = weight * inputs.is_weight
        selected = inputs.tensordict.get(K.COV_SELECTED)
        penalty = self.coef * inputs.log_weight.abs()
        loss = -weight * inputs.advantage + torch.where(selected, penalty, torch.zeros_like(penalty))
        return loss, {"cov_selected_frac": F.masked_mean(selected.to(loss.dtype), inputs.mask)}
