"""What the PPO loss and :func:`~rlhf_torchrl.trainers.update.ppo_update` take from their caller, checked
before any work: a TorchRL PPO loss pointed at the rollout's keys and mask (or refused), the
rollout entries the loss reads, and the replay buffer that serves the minibatches.

TorchRL's ``ClipPPOLoss`` reads ``"action"`` and ``"action_log_prob"`` unless told otherwise, and
averages over every position unless ``loss_mask_key`` names a mask: on right-padded responses a
plain one is silently wrong (pads count in every mean). :func:`use_rollout_keys` sets what it
left at TorchRL's defaults and refuses a key set elsewhere, so the loss either reads the layout's
entries and the response mask, or does not run.
"""

from __future__ import annotations

import logging

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

#: a PPO loss's tensor key -> the rollout's entry (TorchRL's names: ``ClipPPOLoss.set_keys``)
LOSS_KEYS = {"action": K.RESPONSE_TOKENS, "sample_log_prob": K.LOG_PROB,
             "advantage": K.ADVANTAGE, "value": K.VALUE, "value_target": K.VALUE_TARGET}
#: ``loss_mask_key`` values that leave the pads in the means: TorchRL's ``"auto"`` (it looks for
#: ``("collector", "mask")``, which a rollout has not) and ``None`` (no mask)
_NO_MASK = ("auto", None)


def _is_ppo_loss(loss_module) -> bool:
    from torchrl.objectives import PPOLoss

    return isinstance(loss_module, PPOLoss)


def _key_name(key) -> str | None:
    """The :mod:`rlhf_torchrl.keys` constant naming a rollout entry (None: not one of them)."""
    key = key if isinstance(key, str) or len(key) > 1 else key[0]
    key = tuple(key) if not isinstance(key, str) else key
    return next((name for name, value in vars(K).items()
                 if name.isupper() and value == key), None)


def _wrong_key(name: str, current, expected) -> str:
    """What is wrong with a loss key pointed away from the rollout's entry: an entry of the
    rollout that is another thing (``("masks", "prompt")`` is the prompt's mask), or none."""
    held = _key_name(current)
    if held is None:
        return f"{name}={current!r}, which the rollout does not hold"
    words = held.lower().replace("_", " ")
    return (f"{name}={current!r}, which is the rollout's {words} (keys.{held}), not its "
            f"{_key_name(expected).lower().replace('_', ' ')} ({expected!r})")


def setup_lines(keys: dict | None = None) -> str:
    """The set-up a PPO loss needs for the rollout, as code (for the errors and the log).

    Args:
        keys: loss key name to rollout entry (None: :data:`LOSS_KEYS`).
    """
    keys = LOSS_KEYS if keys is None else keys
    pairs = ", ".join(f"{name}={key!r}" for name, key in keys.items())
    return f"loss.set_keys({pairs}); loss.loss_mask_key = {K.RESPONSE_MASK!r}"


def use_rollout_keys(loss_module, *, where: str = "ppo_update"):
    """Point a TorchRL PPO loss (``ClipPPOLoss`` or a subclass) at the rollout's keys and mask.

    Each of :data:`LOSS_KEYS` still at TorchRL's default (``"action"``, ``"action_log_prob"``) is
    set to the rollout's entry, and a ``loss_mask_key`` of ``"auto"`` or None to
    ``("masks", "response")``; a warning names what was set (``where`` says who set it). A key
    or mask pointed at another entry is refused with one :class:`ConfigError` line naming it and
    the set-up to use. :func:`~rlhf_torchrl.objectives.ppo.make_ppo_loss`'s loss is set up already,
    and a loss that is not a TorchRL PPO loss is left alone. Returns ``loss_module``.

    Args:
        loss_module (torch.nn.Module): the loss to set up, in place.
        where: who sets it up, named in the warning.

    Example:
        >>> loss = use_rollout_keys(ClipPPOLoss(actor, critic, functional=False))
        >>> loss.loss_mask_key
        ('masks', 'response')
    """
    if not _is_ppo_loss(loss_module):
        return loss_module
    defaults = type(loss_module)._AcceptedKeys()
    changes, wrong = {}, []
    for name, key in LOSS_KEYS.items():
        current = getattr(loss_module.tensor_keys, name)
        if current == key:
            continue
        if current == getattr(defaults, name):
            changes[name] = key
        else:
            wrong.append(_wrong_key(name, current, key))
    mask = loss_module.loss_mask_key
    if mask not in (*_NO_MASK, K.RESPONSE_MASK):
        wrong.append(_wrong_key("loss_mask_key", mask, K.RESPONSE_MASK))
    if wrong:
        raise ConfigError(f"{where}: this {type(loss_module).__name__} reads {'; '.join(wrong)}: "
                          f"set it up as {setup_lines()}.")
    if changes or mask in _NO_MASK:
        loss_module.set_keys(**changes)
        loss_module.loss_mask_key = K.RESPONSE_MASK
        log.warning("%s: set this %s's keys for the rollout (TorchRL's defaults read entries it "
                    "does not hold, and average over pads): %s.", where, type(loss_module).__name__,
                    setup_lines(changes))
    return loss_module


def loss_input_keys(loss_module) -> list:
    """The rollout entries a PPO loss reads: the actor's prompt and response, the old log-probs,
    the advantages; with a critic the value targets (and the old values with ``clip_value``);
    :class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`'s KL term the reference log-probs, its
    positive-example term the scores, its off-policy correction (``tis_cap``) the sampler's
    log-probs.

    Args:
        loss_module (torch.nn.Module): a TorchRL PPO loss, set up for the rollout.
    """
    if not _is_ppo_loss(loss_module):
        return [K.PROMPT_TOKENS, K.PROMPT_MASK, K.RESPONSE_TOKENS, K.RESPONSE_MASK]
    keys = loss_module.tensor_keys
    needs = [K.PROMPT_TOKENS, K.PROMPT_MASK, keys.action, K.RESPONSE_MASK, keys.sample_log_prob,
             keys.advantage]
    if getattr(loss_module, "critic_network", None) is not None:
        needs.append(keys.value_target)
        if loss_module.clip_value is not None:
            needs.append(keys.value)
    if getattr(loss_module, "kl_loss_coef", 0):
        needs.append(K.REF_LOG_PROB)
    if getattr(loss_module, "positive_nll_coef", 0):
        needs.append(K.SCORE)
    if getattr(loss_module, "tis_cap", None) is not None:
        needs.append(K.BEHAVIOUR_LOG_PROB)  # the correction's ratio pi_old / pi_sampler
    return needs


def check_replay_buffer(replay_buffer, *, rows: int | None = None, sizes: list[int] | None = None,
                        filtered: bool = False, arg: str = "replay_buffer") -> None:
    """Refuse a replay buffer that cannot serve a rollout's minibatches as
    :func:`~rlhf_torchrl.trainers.update.ppo_update` draws them: every row once per epoch (a sampler
    without replacement), all ``rows`` of the rollout held (its storage's size), and minibatches
    of the ``sizes`` that ``num_mini_batches`` gives (its own ``batch_size``, when it has one,
    must be each of them; without one the sizes follow ``num_mini_batches``, as a batch that the
    group filter shrinks needs: with ``filtered`` it must have none). One :class:`ConfigError`
    line naming ``arg``.

    Args:
        replay_buffer (torchrl.data.ReplayBuffer): the buffer the caller passed.
        rows: the rollout's rows (None: not checked).
        sizes: the minibatch sizes ``num_mini_batches`` gives (None: not checked).
        filtered: the rollout may shrink (DAPO's group filter), so the buffer must have no batch
            size.
        arg: the caller's name for the buffer, used in the error.
    """
    from torchrl.data import SamplerWithoutReplacement

    sampler = getattr(replay_buffer, "sampler", None)
    if not isinstance(sampler, SamplerWithoutReplacement):
        raise ConfigError(
            f"{arg} samples with {type(sampler).__name__}: the PPO epochs serve every row once per "
            "epoch, which needs SamplerWithoutReplacement (make_minibatch_buffer builds one).")
    capacity = getattr(getattr(replay_buffer, "storage", None), "max_size", None)
    if rows is not None and capacity is not None and capacity < rows:
        raise ConfigError(f"{arg} holds {capacity} rows and the rollout has {rows}: the rest "
                          f"would overwrite them; use make_minibatch_buffer({rows}, ...).")
    size = getattr(replay_buffer, "batch_size", None)
    if filtered and size is not None:
        raise ConfigError(f"filter_groups leaves fewer rows to some updates, and {arg} has "
                          f"batch_size={size}: give one without a batch size "
                          "(make_minibatch_buffer(batch_size, seed=...)), whose minibatches "
                          "follow num_mini_batches.")
    if sizes is not None and size is not None and any(s != size for s in sizes):
        split = " and ".join(str(s) for s in sorted(set(sizes), reverse=True))
        raise ConfigError(
            f"{arg} has batch_size={size}, but num_mini_batches={len(sizes)} splits the {sum(sizes)} "
            f"rows into minibatches of {split}: give a buffer of that size, or one without a "
            f"batch size (make_minibatch_buffer({sum(sizes)}), the sizes then follow "
            "num_mini_batches).")
