"""On-policy distillation's teacher from the ``reward.teacher*`` settings: its settings checked
against the rest of the config, its tokenizer against the policy's before any weights load, then
the teacher module the trainer runs with the old quantities
(:mod:`rlhf_torchrl.rewards.distillation`)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from rlhf_torchrl.config.derived import autocast_dtype
from rlhf_torchrl.config.model_checks import _model_config
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import load_tokenizer
from rlhf_torchrl.rewards.distillation import (
    TeacherLogProbs,
    TextTeacherLogProbs,
    check_same_vocabulary,
    load_teacher,
)


def has_score(cfg: DictConfig) -> bool:
    """Whether a reward besides the teacher gives each response a score (``reward.model``,
    ``reward.remote_url`` or ``reward.functions``).

    Args:
        cfg: the composed PPO config.
    """
    r = cfg.reward
    return bool(r.model or r.remote_url or r.functions)


def check_teacher_settings(cfg: DictConfig) -> None:
    """The ``reward.teacher*`` settings against the rest of the config, nothing read from disk:
    the text mapping reads single responses, and takes k1 or k2 (k3 exponentiates a whole
    sequence's log-ratio); the group filter needs a score that differs within a group.

    Args:
        cfg: the composed PPO config.
    """
    r = cfg.reward
    if not r.teacher:
        return
    if r.teacher_mapping == "text":
        if cfg.env.tools:
            raise ConfigError(
                "reward.teacher_mapping=text reads single responses, and env.tools makes "
                "multi-turn episodes (the tools' messages between the policy's turns): use a "
                "teacher with the policy's tokenizer (teacher_mapping=token), or no tools.")
        if r.teacher_kl_estimator == "k3":
            raise ConfigError(
                "reward.teacher_mapping=text with teacher_kl_estimator=k3: k3 = (r - 1) - log r "
                "exponentiates the whole response's log-ratio, which overflows past ~88 nats; "
                "use k1 (the log-ratio) or k2.")
    if cfg.advantage.filter_groups and not has_score(cfg):
        raise ConfigError(
            "advantage.filter_groups drops the groups whose scores are all equal, and with the "
            "teacher alone (no reward.model or reward.functions) every score is 0: every group "
            "would be dropped. Set advantage.filter_groups=false, or add a reward.")


def teacher_tokenizer(cfg: DictConfig, tokenizer):
    """The teacher's tokenizer (None without ``reward.teacher``), read before any weights load:
    its ``config.json`` must load and, with ``reward.teacher_mapping=token``, its token-to-id map
    must be the policy's (:func:`~rlhf_torchrl.rewards.distillation.check_same_vocabulary`; one
    line otherwise).

    Args:
        cfg: the composed PPO config.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's.
    """
    r = cfg.reward
    if not r.teacher:
        return None
    _model_config("reward.teacher", r.teacher)  # a clear line for a missing or broken model
    try:
        theirs = load_tokenizer(r.teacher, chat_template=cfg.data.chat_template)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"reward.teacher={r.teacher}: its tokenizer cannot be loaded "
                          f"({first}).") from None
    if r.teacher_mapping == "token":
        check_same_vocabulary(tokenizer, theirs, teacher=f"reward.teacher={r.teacher}")
    return theirs


def make_teacher(cfg: DictConfig, tokenizer, teacher_tokenizer, device: torch.device):
    """The teacher's module (None without ``reward.teacher``): its log-probs at the sampling
    temperature, ``ppo.forward_batch_size`` rows per forward, under the policy's autocast, as the
    reference's; :class:`~rlhf_torchrl.rewards.distillation.TeacherLogProbs`, or
    :class:`~rlhf_torchrl.rewards.distillation.TextTeacherLogProbs` with
    ``reward.teacher_mapping=text``.

    Args:
        cfg: the composed PPO config.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's.
        teacher_tokenizer (transformers.PreTrainedTokenizerBase): the teacher's
            (:func:`teacher_tokenizer`).
        device: where it runs.
    """
    r = cfg.reward
    if not r.teacher:
        return None
    text = r.teacher_mapping == "text"
    model = load_teacher(r.teacher, teacher_tokenizer if text else tokenizer, dtype=r.teacher_dtype,
                         attn_implementation=cfg.model.attn_implementation, device=device,
                         offload=r.teacher_offload)
    settings = dict(temperature=cfg.generation.temperature, chunk_size=cfg.ppo.forward_batch_size,
                    offload=r.teacher_offload, autocast_dtype=autocast_dtype(cfg))
    if text:
        return TextTeacherLogProbs(model, teacher_tokenizer, **settings)
    return TeacherLogProbs(model, packing=cfg.model.packing, **settings)
