"""Reward kinds: how one entry of ``reward.functions`` becomes a reward function, each a
registered :class:`RewardKind` (:data:`REWARD_KINDS`).

An entry is read by the kind registered last whose :meth:`RewardKind.matches` accepts it, so a
kind of your own (a judge, a process reward) claims its own form of entry (``judge:<rubric>``)
and every other entry goes on as before: ``function`` reads a dotted path or a file and a name
(:func:`~rlhf_torchrl.rewards.scoring.load_reward_function`), ``remote`` an ``http(s)://`` URL
(:class:`~rlhf_torchrl.rewards.remote.RemoteReward`). A kind's attributes say what the run must do
around it.
"""

from __future__ import annotations

from rlhf_torchrl.registry import Registry


class RewardKind:
    """A Python function ``fn(prompts, responses, ...) -> list[float]``, named by a dotted path
    (``my_pkg.rewards.fn``) or a file and a name in it (``./my_rewards.py:fn``)."""

    name: str
    #: it calls a service over the network: a deadline and retries per request
    remote: bool = False

    @classmethod
    def matches(cls, spec: str) -> bool:
        """Whether ``spec`` (an entry of ``reward.functions``) is of this kind."""
        return True

    @classmethod
    def short_name(cls, spec: str) -> str:
        """The metric name of ``spec``'s reward (``reward/<name>``)."""
        return spec.replace(":", ".").rsplit(".", 1)[-1]

    @classmethod
    def full_name(cls, spec: str) -> str:
        """The name where two rewards share :meth:`short_name`."""
        return spec

    @classmethod
    def check(cls, spec: str, cfg) -> None:
        """A one-line :class:`~rlhf_torchrl.errors.ConfigError` for settings of ``spec``'s kind
        that cannot work, from the config alone (no model loads, nothing is imported from the
        user); run by :func:`~rlhf_torchrl.config.checks.check_config`. By default: none.

        Args:
            spec: the entry of ``reward.functions``.
            cfg (omegaconf.DictConfig): the composed PPO config.
        """

    @classmethod
    def build(cls, spec: str, name: str, cfg):
        """The reward function of ``spec``, named ``name``, with the run's ``reward.*`` settings.

        Args:
            spec: the entry of ``reward.functions``.
            name: its metric name.
            cfg (omegaconf.DictConfig): the composed PPO config.
        """
        from rlhf_torchrl.rewards.scoring import load_reward_function

        return load_reward_function(spec)


#: the forms an entry of ``reward.functions`` may take
REWARD_KINDS: Registry[type[RewardKind]] = Registry("reward.functions", "reward kind")
REWARD_KINDS.register("function")(RewardKind)


@REWARD_KINDS.register("remote")
class RemoteRewardKind(RewardKind):
    """An ``http(s)://`` URL that scores responses (a verifier, a judge), with the
    ``reward.remote_*`` settings (:class:`~rlhf_torchrl.rewards.remote.RemoteReward`)."""

    remote = True

    @classmethod
    def matches(cls, spec: str) -> bool:
        from rlhf_torchrl.rewards.remote import is_url

        return is_url(spec)

    @classmethod
    def short_name(cls, spec: str) -> str:
        from rlhf_torchrl.rewards.remote import url_name

        return url_name(spec)

    @classmethod
    def full_name(cls, spec: str) -> str:
        from rlhf_torchrl.rewards.remote import url_name

        return url_name(spec, full=True)

    @classmethod
    def build(cls, spec: str, name: str, cfg):
        from rlhf_torchrl.rewards.remote import RemoteReward

        r = cfg.reward
        return RemoteReward(spec, name=name, token_env=r.remote_token_env, timeout=r.remote_timeout,
                            retries=r.remote_retries, batch_size=r.remote_batch_size,
                            concurrency=r.remote_concurrency, label_column=r.remote_label_column)


def reward_kind(spec: str) -> type[RewardKind]:
    """The kind that reads ``spec``: the last registered whose ``matches`` accepts it.

    Args:
        spec: an entry of ``reward.functions``.
    """
    for _, kind in reversed(REWARD_KINDS.items()):
        if kind.matches(spec):
            return kind
    return RewardKind
