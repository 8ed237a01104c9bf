"""Objectives: the PPO loss and what it consumes.

``ppo``: the token-level PPO loss over TorchRL's ``ClipPPOLoss``; ``advantages``: the advantage
estimators; ``kl_shaping``: the per-token reward from the KL to the reference; ``loss_inputs``: the
keys the loss takes, checked. The pure tensor math is :mod:`rlhf_torchrl.functional`'s.
"""


def __getattr__(name: str):
    """The names of the old ``rlhf_torchrl/objectives.py`` (now :mod:`.ppo`), for one release."""
    from rlhf_torchrl.deprecated import forward

    return forward(__name__, "rlhf_torchrl.objectives", "rlhf_torchrl.objectives.ppo", name)
