"""Pure tensor math for token-level PPO-RLHF, one module per concern, every name here.

Conventions: response tensors are ``(B, R)``, right-padded; ``mask`` is True (or 1) on valid
response tokens. Prompts are ``(B, P)``, left-padded. Nothing here knows about TensorDicts.
"""

from rlhf_torchrl.functional.advantages import (
    explained_variance,
    gae,
    group_index,
    group_mean,
    group_std,
    leave_one_out_mean,
    length_adaptive_lmbda,
    returns_to_go,
)
from rlhf_torchrl.functional.at_k import (
    majority_at_k,
    majority_vote,
    mean_interval,
    pass_at_k,
)
from rlhf_torchrl.functional.distillation import (
    distillation_rewards,
    sequence_distillation_rewards,
)
from rlhf_torchrl.functional.kl import (
    K3_LOSS_BOUND,
    KL_ESTIMATORS,
    check_kl_estimator,
    clamped_k3,
    kl_estimate,
    per_token_rewards,
)
from rlhf_torchrl.functional.length import batch_moments, merge_moments, overlong_penalty
from rlhf_torchrl.functional.log_probs import (
    entropy_from_logits,
    log_probs_from_logits,
)
from rlhf_torchrl.functional.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_size,
    check_loss_aggregation,
    clip_binds,
    dual_clip,
    positive_nll,
    positive_nll_weights,
    random_subset,
    sequence_log_ratio,
    token_covariance,
    top_k_tokens,
)
from rlhf_torchrl.functional.masks import (
    has_holes,
    last_token_index,
    last_token_mask,
    masked_mean,
    masked_var,
    masked_whiten,
    packing_order,
    position_ids_from_mask,
    truncate_after_stop,
    unpack,
)
from rlhf_torchrl.functional.matmul import LM_HEAD_MATMULS, split_bf16_linear
from rlhf_torchrl.functional.off_policy import (
    OFF_POLICY_CORRECTIONS,
    check_off_policy_correction,
    off_policy_log_weight,
)

__all__ = [
    "K3_LOSS_BOUND",
    "KL_ESTIMATORS",
    "LM_HEAD_MATMULS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "aggregate_loss",
    "aggregation_size",
    "batch_moments",
    "check_kl_estimator",
    "check_loss_aggregation",
    "check_off_policy_correction",
    "clamped_k3",
    "clip_binds",
    "distillation_rewards",
    "dual_clip",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_index",
    "group_mean",
    "group_std",
    "has_holes",
    "kl_estimate",
    "last_token_index",
    "last_token_mask",
    "leave_one_out_mean",
    "length_adaptive_lmbda",
    "log_probs_from_logits",
    "majority_at_k",
    "majority_vote",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mean_interval",
    "merge_moments",
    "off_policy_log_weight",
    "overlong_penalty",
    "packing_order",
    "pass_at_k",
    "per_token_rewards",
    "position_ids_from_mask",
    "positive_nll",
    "positive_nll_weights",
    "random_subset",
    "sequence_distillation_rewards",
    "sequence_log_ratio",
    "split_bf16_linear",
    "token_covariance",
    "top_k_tokens",
    "returns_to_go",
    "truncate_after_stop",
    "unpack",
]
