"""Config to the score transforms of ``reward.overlong_buffer`` (DAPO's soft overlong punishment)
and ``reward.normalize_per_source`` (:mod:`rlhf_torchrl.rewards.length`), and their checks."""

from __future__ import annotations

from omegaconf import DictConfig

from rlhf_torchrl.config.derived import overlong_limit
from rlhf_torchrl.config.distillation import has_score
from rlhf_torchrl.errors import ConfigError


def check_length_shaping(cfg: DictConfig) -> None:
    """The overlong buffer below the length limit it sits in; a score to normalise.

    Args:
        cfg: the composed PPO config.
    """
    r = cfg.reward
    if r.overlong_buffer is not None:
        limit, named = overlong_limit(cfg)
        if r.overlong_buffer >= limit:
            raise ConfigError(
                f"reward.overlong_buffer={r.overlong_buffer} must be below {named}, the most tokens "
                f"a response may have: the penalty grows over the buffer's tokens before that limit "
                f"(DAPO: 4096 of 20480). Lower the buffer, or raise the limit.")
    if r.normalize_per_source and not has_score(cfg):
        raise ConfigError("reward.normalize_per_source normalises the score, and this run has none "
                          "(reward.teacher alone): set reward.model or reward.functions, or drop it.")


def make_score_transform(cfg: DictConfig, parallel=None, user_transform=None):
    """The trainer's ``reward_transform``: per-source normalisation, then the overlong penalty,
    then ``user_transform`` (a transform of your own, last); None when there is none of them.

    Args:
        cfg: the composed PPO config.
        parallel (rlhf_torchrl.distributed.DataParallel | None): the run's processes, whose
            batches the normaliser's statistics sum over.
        user_transform (Callable | None): ``build_trainer``'s ``reward_transform``.
    """
    from rlhf_torchrl.rewards.length import OverlongPenalty, PerSourceScoreNorm, ScoreTransforms

    r = cfg.reward
    norm = penalty = None
    if r.normalize_per_source:
        norm = PerSourceScoreNorm(max(len(cfg.data.sources or []), 1), parallel=parallel)
    if r.overlong_buffer is not None:
        penalty = OverlongPenalty(overlong_limit(cfg)[0], r.overlong_buffer, r.overlong_penalty)
    if norm is None and penalty is None:
        return user_transform
    return ScoreTransforms(norm, penalty, user_transform)
