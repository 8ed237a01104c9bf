"""Per-token rewards: ``r[t] = -kl_coef * KL[t]`` on response tokens plus the score at the last
one (:class:`KLRewardShaper`), with a constant or adaptive ``kl_coef`` (:func:`make_kl_controller`)."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError


class FixedKLController:
    """A constant KL coefficient (same interface as TorchRL's ``AdaptiveKLController``).

    Args:
        init_kl_coef: the coefficient.
    """

    def __init__(self, init_kl_coef: float):
        self.coef = init_kl_coef

    def update(self, kl_values=None) -> float:
        return self.coef


def make_kl_controller(kl_coef: float, target: float | None = None, horizon: int = 10000):
    """Constant ``kl_coef``, or TorchRL's ``AdaptiveKLController`` when ``target`` is set.

    Adaptive (Ziegler et al. 2019, §2.2): ``e = clip(KL / target - 1, -0.2, 0.2)``,
    ``kl_coef *= 1 + e * n / horizon`` with ``n`` the number of samples in the batch. TorchRL's
    ``update`` expects the per-sample KL *rewards* ``-kl_coef * KL``, which
    :class:`KLRewardShaper` passes.

    Args:
        kl_coef: the (initial) KL coefficient.
        target: the KL per response, in nats, the adaptive controller aims for (None: constant).
        horizon: the adaptive controller's horizon, in samples.
    """
    if target is None:
        return FixedKLController(kl_coef)
    from torchrl.data.llm.utils import AdaptiveKLController

    if kl_coef <= 0:
        raise ConfigError("The adaptive KL controller needs kl_coef > 0 to start from.")
    return AdaptiveKLController(init_kl_coef=kl_coef, target=target, horizon=horizon)


class KLRewardShaper(TensorDictModuleBase):
    """Per-token rewards from scores and the KL to the reference.

    ``KL[t] = estimator(log_prob[t], ref_log_prob[t])`` on response tokens,
    ``r[t] = -kl_coef * KL[t] + score * [t == last]``. Optionally whitens (``whiten_scores``, mean
    kept) and clips (``score_clip``) the scores first. Writes ``("kl", "response")`` (B, R),
    ``("next", "reward")``, ``("next", "non_score_reward")``, ``("next", "done")``,
    ``("next", "terminated")`` (B, R, 1), ready for GAE. A multi-turn rollout's
    ``"turn_reward"`` (B, R) (the tools' rewards, each at the last token of its turn) and a
    process reward's ``"step_reward"`` (B, R) (each step's value at its last token) are added to
    the reward as they are (neither whitened nor clipped). Also writes ``"shaped_score"`` (B,):
    the reward without its KL part, summed over the response (the whitened, clipped score plus
    the turn and step rewards), which the group baselines compare.

    On-policy distillation: where the rollout holds a teacher's log-probs of the sampled tokens
    (``("teacher_log_probs", "response")``, :class:`~rlhf_torchrl.rewards.distillation.TeacherLogProbs`),
    the reverse KL to the teacher is penalised the same way, per token:
    ``r[t] += -teacher_coef * KL_T[t]`` with ``KL_T[t] = teacher_kl_estimator(log_prob[t],
    teacher_log_prob[t])`` (:func:`~rlhf_torchrl.functional.distillation_rewards`); a teacher of
    another vocabulary gives one log-prob per response (``("teacher_log_probs", "sequence")``,
    :class:`~rlhf_torchrl.rewards.distillation.TextTeacherLogProbs`) and its sequence-level
    estimate lands on the last token (:func:`~rlhf_torchrl.functional.sequence_distillation_rewards`).
    ``("teacher_kl", "response")`` (B, R) holds ``KL_T``; the teacher's term is part of
    ``("next", "non_score_reward")`` (a KL term: the group baselines credit it per token, as the
    reference's), never of ``"shaped_score"``, and the adaptive KL controller sees the
    reference's KL alone.

    Args:
        kl_controller (FixedKLController | torchrl.data.llm.utils.AdaptiveKLController): owns
            ``kl_coef`` (:func:`make_kl_controller`).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:func:`~rlhf_torchrl.functional.kl_estimate`).
        whiten_scores: whiten the scores over the batch first, keeping their mean.
        score_clip: clip the scores to ``[-score_clip, score_clip]`` first (None: no clip).
        teacher_coef: the coefficient of the reverse KL to the teacher, where the rollout holds
            the teacher's log-probs (0: none).
        teacher_kl_estimator: ``k1``, ``k2`` or ``k3``, of the KL to the teacher.

    Unlike TorchRL's ``KLRewardTransform``, the score enters once, at the last response token, and
    nothing is put on prompt tokens.
    """

    def __init__(
        self,
        kl_controller,
        *,
        kl_estimator: str = "k1",
        whiten_scores: bool = False,
        score_clip: float | None = None,
        teacher_coef: float = 1.0,
        teacher_kl_estimator: str = "k1",
    ):
        super().__init__()
        self.kl_estimator = F.check_kl_estimator(kl_estimator)
        self.teacher_coef = teacher_coef
        self.teacher_kl_estimator = F.check_kl_estimator(teacher_kl_estimator)
        self.kl_controller = kl_controller
        self.whiten_scores = whiten_scores
        self.score_clip = score_clip
        self.in_keys = [K.LOG_PROB, K.REF_LOG_PROB, K.RESPONSE_MASK, K.SCORE]
        self.out_keys = [K.KL, K.REWARD, K.NON_SCORE_REWARD, K.DONE, K.TERMINATED, K.SHAPED_SCORE]

    @property
    def kl_coef(self) -> float:
        return float(self.kl_controller.coef)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="KLRewardShaper")
        mask = td.get(K.RESPONSE_MASK)
        score = td.get(K.SCORE)
        if self.whiten_scores and score.numel() > 1:
            score = F.masked_whiten(score, torch.ones_like(score, dtype=torch.bool), shift_mean=False)
        if self.score_clip is not None:
            score = score.clamp(-self.score_clip, self.score_clip)
        kl = F.kl_estimate(td.get(K.LOG_PROB), td.get(K.REF_LOG_PROB), self.kl_estimator) * mask
        reward, non_score = F.per_token_rewards(score, kl, mask, self.kl_coef)
        shaped_score = torch.where(mask.any(-1), score, torch.zeros_like(score))  # as in the reward
        # dense rewards: a multi-turn episode's tool rewards (turn by turn) and process rewards
        # (each step's value at its last token), as they are: not whitened, not clipped
        for key in (K.TURN_REWARD, K.STEP_REWARD):
            dense = td.get(key, None)
            if dense is not None:
                dense = torch.where(mask, dense, torch.zeros_like(dense))
                reward = reward + dense
                shaped_score = shaped_score + dense.sum(-1)
        teacher = self.teacher_rewards(td)  # on-policy distillation: -coef * KL to the teacher
        if teacher is not None:
            teacher_reward, teacher_kl = teacher
            reward, non_score = reward + teacher_reward, non_score + teacher_reward
            td.set(K.TEACHER_KL, teacher_kl)
        done = F.last_token_mask(mask).unsqueeze(-1)
        # summed here, not recovered as reward - KL: (s + k) - k rounds, and equal scores must stay
        # equal for the group baselines and the group filter
        td.set(K.SHAPED_SCORE, shaped_score)
        td.set(K.KL, kl)
        td.set(K.REWARD, reward.unsqueeze(-1))
        td.set(K.NON_SCORE_REWARD, non_score.unsqueeze(-1))
        td.set(K.DONE, done)
        td.set(K.TERMINATED, done.clone())
        return td

    def teacher_rewards(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(reward, KL_T)`` (B, R) of the teacher's log-probs the rollout holds, per token or,
        a teacher of another vocabulary, for the sequence at its last token; None: no teacher
        (or ``teacher_coef`` 0).

        Args:
            td: a rollout with the old log-probs.
        """
        keys = td.keys(True)
        if not self.teacher_coef:
            return None
        log_prob, mask = td.get(K.LOG_PROB), td.get(K.RESPONSE_MASK)
        if K.TEACHER_LOG_PROB in keys:
            return F.distillation_rewards(log_prob, td.get(K.TEACHER_LOG_PROB), mask,
                                          self.teacher_coef, self.teacher_kl_estimator)
        if K.TEACHER_SEQUENCE_LOG_PROB in keys:
            return F.sequence_distillation_rewards(log_prob, td.get(K.TEACHER_SEQUENCE_LOG_PROB),
                                                   mask, self.teacher_coef,
                                                   self.teacher_kl_estimator)
        return None

    def update_kl_coef(self, td: TensorDictBase) -> float:
        """Adapt ``kl_coef`` to the KL of this rollout (no-op for a constant coefficient).

        Args:
            td: the shaped rollout, with ``("kl", "response")``.
        """
        per_sample = td.get(K.NON_SCORE_REWARD).squeeze(-1).sum(-1)  # -kl_coef * KL(seq)
        if K.TEACHER_KL in td.keys(True):  # the reference's KL alone: the teacher's is not its
            per_sample = (-self.kl_coef * td.get(K.KL)).sum(-1)
        if not math.isfinite(float(per_sample.sum())):
            return self.kl_coef
        return float(self.kl_controller.update(per_sample.tolist()))
