"""Advantage estimators: TensorDict modules over one rollout layout, each writing ``"advantage"``.

Every estimator reads the per-token rewards the shaper wrote (``("next", "reward")``: the score at
the last response token, plus ``-kl_coef * KL`` on every token when the KL penalty sits in the
reward) and the response mask, and writes ``"advantage"`` (B, R, 1), 0 on pads:

================  =====================================================  ===============
estimator         advantage of token t of response i                     reads besides
================  =====================================================  ===============
``gae``           GAE over the response tokens, whitened over the batch  ``state_value``
``grpo``          ``(s_i - mean_g s) / (std_g s + eps) + N_it``          ``group``
``rloo``          ``s_i - mean_{j != i in g} s_j + N_it``                ``group``
``reinforce_pp``  ``G_it``, whitened over the batch's valid tokens       nothing
================  =====================================================  ===============

(Dr. GRPO: ``grpo`` with ``scale_by_std=False``, no division.) ``G_it`` is the return-to-go
from token t (:func:`~rlhf_torchrl.functional.returns_to_go`),
``s_i`` the response's score as shaped (its reward without the KL part: :func:`group_scores`),
``N_it`` the KL penalty's return-to-go (``("next", "non_score_reward")``) and ``g`` the group
of responses to the same prompt (``"group"``, written by the collector with
``samples_per_prompt``). The group baselines compare scores only (and DAPO's filter,
:func:`informative_groups`, the same scores); the per-token KL credit is added as it is. With
the KL penalty in the loss instead (``kl_coef=0``), ``N = 0``, and GRPO and RLOO give every
token of a response the same advantage, as in their papers. The critic-free estimators need no
value model and write no ``"value_target"``: the loss then has no value term.

Process rewards (one value per reasoning step, ``"step_reward"``, each at its step's last token)
are part of ``("next", "reward")``: GAE credits each step where it ends, and so do REINFORCE++'s
returns-to-go. The group baselines (GRPO, RLOO) compare one number per response, so they take
each response's step values summed (``s_i`` includes them): the step rewards still rank the
responses of a group, but every token of a response gets the same score advantage.

A new estimator is any module with this contract (``examples/custom_advantage.py``), registered
in :data:`ADVANTAGE_ESTIMATORS` to be a value of ``advantage.estimator``: its class attributes
``needs_critic`` (it reads ``"state_value"``: a value model is built) and ``compares_groups`` (it
baselines responses to the same prompt: ``generation.samples_per_prompt >= 2``) answer what the
run must provide, and its ``__init__`` receives the ``advantage.*`` settings it names.
"""

from __future__ import annotations

import inspect

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.registry import Registry

#: the values of ``advantage.estimator``: each a TensorDict module class writing ``"advantage"``
ADVANTAGE_ESTIMATORS: Registry[type[TensorDictModuleBase]] = Registry(
    "advantage.estimator", "advantage estimator")


@ADVANTAGE_ESTIMATORS.register("gae")
class ResponseGAE(TensorDictModuleBase):
    """GAE over response tokens; writes ``"advantage"`` and ``"value_target"`` (B, R, 1).

    ``A = GAE(r, V; gamma, lmbda_policy)`` with the episode ending at the last response token
    (:func:`rlhf_torchrl.functional.gae`, TorchRL's ``generalized_advantage_estimate``), whitened
    over valid tokens when ``whiten_advantages`` (N+ details: advantage whitening);
    ``value_target = GAE(r, V; gamma, lmbda_critic) + V`` (before whitening).

    The two lambdas (decoupled GAE, Yuan et al. 2025, "VC-PPO", arXiv 2503.01491): ``lmbda_critic``
    (None: ``lmbda``) gives the value targets; VC-PPO uses 1, the Monte Carlo return, a target
    that does not lean on the critic's own (biased) values. ``lmbda`` gives the policy's advantages,
    or, with ``lmbda_length_alpha``, each response its own ``1 - 1 / (alpha * length)``
    (:func:`~rlhf_torchrl.functional.length_adaptive_lmbda`, VAPO). With neither set, one GAE
    pass serves both, as in PPO.

    Args:
        gamma: the discount.
        lmbda: the policy's GAE lambda.
        whiten_advantages: whiten the advantages over the batch's valid tokens.
        lmbda_critic: the value targets' lambda (None: ``lmbda``; VC-PPO: 1).
        lmbda_length_alpha: VAPO's ``alpha``, a length-adaptive policy lambda per response (None:
            ``lmbda``).
    """

    needs_critic = True
    compares_groups = False

    def __init__(self, *, gamma: float = 1.0, lmbda: float = 0.95, whiten_advantages: bool = True,
                 lmbda_critic: float | None = None, lmbda_length_alpha: float | None = None):
        super().__init__()
        for name, value in (("lmbda", lmbda), ("lmbda_critic", lmbda_critic)):
            if value is not None and not 0 <= value <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {value}.")
        if lmbda_length_alpha is not None and not lmbda_length_alpha > 0:
            raise ConfigError(f"lmbda_length_alpha must be > 0 (VAPO uses 0.05) or None, got "
                              f"{lmbda_length_alpha}.")
        self.gamma, self.lmbda, self.whiten_advantages = gamma, lmbda, whiten_advantages
        self.lmbda_critic, self.lmbda_length_alpha = lmbda_critic, lmbda_length_alpha
        self.in_keys = [K.REWARD, K.VALUE, K.RESPONSE_MASK]
        self.out_keys = [K.ADVANTAGE, K.VALUE_TARGET]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="ResponseGAE")
        mask = td.get(K.RESPONSE_MASK)
        rewards, values = td.get(K.REWARD).squeeze(-1), td.get(K.VALUE).squeeze(-1)
        lmbda_policy = (F.length_adaptive_lmbda(mask, self.lmbda_length_alpha)
                        if self.lmbda_length_alpha is not None else self.lmbda)
        adv, returns = F.gae(rewards, values, mask, self.gamma, lmbda_policy)
        if self.lmbda_critic is not None or self.lmbda_length_alpha is not None:
            lmbda_critic = self.lmbda if self.lmbda_critic is None else self.lmbda_critic
            _, returns = F.gae(rewards, values, mask, self.gamma, lmbda_critic)
        if self.whiten_advantages and mask.sum() > 1:
            adv = F.masked_whiten(adv, mask)
        td.set(K.ADVANTAGE, adv.unsqueeze(-1))
        td.set(K.VALUE_TARGET, returns.unsqueeze(-1))
        return td


class OnTokenView(TensorDictModuleBase):
    """A TorchRL value estimator (``torchrl.objectives.value.GAE``, ``TDLambdaEstimator``,
    ``TD0Estimator``, ``VTrace``) run on :func:`~rlhf_torchrl.data.trajectory.token_view` of the
    rollout, its ``"advantage"`` and ``"value_target"`` written back (0 on pads and the
    environment's tokens) with :func:`~rlhf_torchrl.data.trajectory.merge_token_view`.

    TorchRL's estimators read a trajectory whose last batch dimension is time, with ``("next",
    "state_value")`` beside ``"state_value"``; the rollout has one row per response, so run on it
    directly they stop at "The tensor with key ('next', 'state_value') is missing, and no value
    network was provided". :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer` wraps a TorchRL
    estimator given as its ``advantage`` in this module itself, with a warning.

    Args:
        estimator (torchrl.objectives.value.ValueEstimatorBase): built with
            ``value_network=None``: the critic's values are in the rollout already (the old
            quantities), and a value network would see the view's single tokens.
    """

    needs_critic = True
    compares_groups = False

    def __init__(self, estimator):
        super().__init__()
        name = type(estimator).__name__
        if getattr(estimator, "value_network", None) is not None:
            raise ConfigError(f"{name} has a value network, which on the rollout's token view "
                              f"would see single tokens: build it with value_network=None (the "
                              f"critic's values are in the rollout, {K.VALUE!r}).")
        keys = estimator.tensor_keys
        written = (keys.advantage, keys.value_target)
        if written != (K.ADVANTAGE, K.VALUE_TARGET) or keys.value != K.VALUE:
            raise ConfigError(f"{name} reads {keys.value!r} and writes {written!r}; the trainer's "
                              f"entries are {K.VALUE!r}, {K.ADVANTAGE!r} and {K.VALUE_TARGET!r}: "
                              f"leave its keys at TorchRL's defaults.")
        self.estimator = estimator
        self.in_keys = [K.REWARD, K.VALUE, K.RESPONSE_MASK]
        self.out_keys = [K.ADVANTAGE, K.VALUE_TARGET]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        from rlhf_torchrl.data.trajectory import merge_token_view, token_view

        K.require(td, *self.in_keys, what=f"OnTokenView({type(self.estimator).__name__})")
        view = token_view(td)
        self.estimator(view)
        return merge_token_view(td, view, keys=self.out_keys)


def on_token_view(advantage):
    """``advantage``, or a TorchRL value estimator wrapped in :class:`OnTokenView` (None when it
    is not one)."""
    from torchrl.objectives.value import ValueEstimatorBase

    return OnTokenView(advantage) if isinstance(advantage, ValueEstimatorBase) else None


class _CriticFree(TensorDictModuleBase):
    needs_critic = False
    compares_groups = False
    required = (K.REWARD, K.RESPONSE_MASK)  # the in_keys a rollout must hold (the others: optional)

    def __init__(self):
        super().__init__()
        self.in_keys = [K.REWARD, K.RESPONSE_MASK]
        self.out_keys = [K.ADVANTAGE]

    def _check(self, td: TensorDictBase) -> None:
        K.require(td, *self.required, what=type(self).__name__)

    @staticmethod
    def _write(td: TensorDictBase, adv: torch.Tensor, mask: torch.Tensor) -> TensorDictBase:
        td.set(K.ADVANTAGE, torch.where(mask, adv, torch.zeros_like(adv)).unsqueeze(-1))
        return td


class _GroupBaseline(_CriticFree):
    """A score baseline within each group of responses to one prompt, plus the KL credit."""

    required = (*_CriticFree.required, K.GROUP)
    compares_groups = True

    def __init__(self):
        super().__init__()
        self.in_keys = [*self.in_keys, K.NON_SCORE_REWARD, K.GROUP]

    @staticmethod
    def _score_and_kl_to_go(td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s, N, mask)``: each response's score as shaped (:func:`group_scores`, (B,)), the KL
        penalty's return-to-go ``N_it`` (B, R; 0 without a KL part
        ``("next", "non_score_reward")``) and the response mask."""
        mask = td.get(K.RESPONSE_MASK)
        return group_scores(td), F.returns_to_go(_kl_part(td), mask), mask


@ADVANTAGE_ESTIMATORS.register("grpo")
class GRPOAdvantage(_GroupBaseline):
    """GRPO's group-relative advantage (Shao et al. 2024), or Dr. GRPO's (Liu et al. 2025).

    ``A_it = (s_i - mean_g(s)) / (std_g(s) + eps) + N_it``: each response's score ``s_i`` against
    the scores of the responses ``g`` to the same prompt (``"group"``), plus the KL penalty's
    return-to-go ``N_it`` when the KL sits in the reward (``("next", "non_score_reward")``; 0
    with the KL in the loss only, GRPO's way). The baseline and the scale are the scores' alone:
    KL noise is never divided by a group's small spread. ``scale_by_std=False`` drops the division
    (Dr. GRPO: the standard deviation weights easy and hard prompts unequally). ``std`` is
    Bessel-corrected; a group of equal scores gets no score advantage. Reads
    ``("next", "reward")``, ``("next", "non_score_reward")``, ``("masks", "response")``,
    ``"group"``; writes ``"advantage"`` (B, R, 1).

    Args:
        scale_by_std: divide by the group's score std (False: Dr. GRPO).
        eps: added to the std before dividing.
    """

    def __init__(self, *, scale_by_std: bool = True, eps: float = 1e-6):
        super().__init__()
        self.scale_by_std, self.eps = scale_by_std, eps

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        self._check(td)
        score, kl_to_go, mask = self._score_and_kl_to_go(td)
        groups = td.get(K.GROUP)
        relative = score - F.group_mean(score, groups)
        if self.scale_by_std:
            relative = relative / (F.group_std(score, groups) + self.eps)
        return self._write(td, relative.unsqueeze(-1) + kl_to_go, mask)


@ADVANTAGE_ESTIMATORS.register("rloo")
class RLOOAdvantage(_GroupBaseline):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    ``A_it = s_i - mean_{j != i}(s_j) + N_it``: each response's score against the mean score of
    the other responses to the same prompt (a baseline that does not depend on response ``i``,
    so the estimate stays unbiased), plus the KL penalty's return-to-go ``N_it`` when the KL sits
    in the reward. Reads ``("next", "reward")``, ``("next", "non_score_reward")``,
    ``("masks", "response")``, ``"group"``; writes ``"advantage"``.
    """

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        self._check(td)
        score, kl_to_go, mask = self._score_and_kl_to_go(td)
        relative = score - F.leave_one_out_mean(score, td.get(K.GROUP))
        return self._write(td, relative.unsqueeze(-1) + kl_to_go, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
class ReinforcePPAdvantage(_CriticFree):
    """REINFORCE++ (Hu 2025): returns-to-go of the shaped per-token rewards, whitened over all
    valid tokens of the batch (the batch is the baseline). Needs no groups. Reads
    ``("next", "reward")``, ``("masks", "response")``; writes ``"advantage"``.

    Args:
        gamma: the discount of the returns-to-go.
    """

    def __init__(self, *, gamma: float = 1.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        self._check(td)
        mask = td.get(K.RESPONSE_MASK)
        returns = F.returns_to_go(td.get(K.REWARD).squeeze(-1), mask, self.gamma)
        adv = F.masked_whiten(returns, mask) if mask.sum() > 1 else returns
        return self._write(td, adv, mask)


def make_advantage(estimator: str = "gae", **settings) -> TensorDictModuleBase:
    """The module of ``estimator`` (a name in :data:`ADVANTAGE_ESTIMATORS`); each setting reaches
    the estimators whose ``__init__`` takes it and is ignored by the others.

    Args:
        estimator: ``gae`` (:class:`ResponseGAE`, needs a critic), ``grpo``, ``rloo``,
            ``reinforce_pp``, or one registered by a plugin.
        **settings: the ``advantage.*`` settings: ``gamma`` (the discount: GAE and REINFORCE++),
            ``lmbda`` (GAE's lambda), ``whiten_advantages`` (whiten GAE's advantages over the
            batch's valid tokens), ``scale_by_std`` (divide GRPO's advantages by the group's
            score std; False: Dr. GRPO), ``lmbda_critic`` (GAE's lambda for the value targets;
            None: ``lmbda``), ``lmbda_length_alpha`` (VAPO's length-adaptive policy lambda's
            ``alpha``; None: ``lmbda``).
    """
    cls = ADVANTAGE_ESTIMATORS.get(estimator)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cls(**settings)
    return cls(**{k: v for k, v in settings.items() if k in params})


def _kl_part(td: TensorDictBase) -> torch.Tensor:
    """(B, R): the KL part of the per-token reward (0 without ``("next", "non_score_reward")``)."""
    if K.NON_SCORE_REWARD in td.keys(True):
        return td.get(K.NON_SCORE_REWARD).squeeze(-1)
    return torch.zeros_like(td.get(K.REWARD).squeeze(-1))


def needs_critic(advantage) -> bool:
    """Whether ``advantage`` reads values (``"state_value"``): a module's ``needs_critic``, else
    whether ``"state_value"`` is one of its ``in_keys``.

    Args:
        advantage (torch.nn.Module): an advantage module (:func:`make_advantage`'s or your own).
    """
    flag = getattr(advantage, "needs_critic", None)
    return bool(flag) if flag is not None else K.VALUE in list(getattr(advantage, "in_keys", []))


def compares_groups(advantage) -> bool:
    """Whether ``advantage`` baselines each response against the responses to the same prompt
    (GRPO, RLOO, a group estimator of your own): where a group of equal scores has no signal, and
    DAPO's filter (:func:`informative_groups`) means something. A module's (or class's)
    ``compares_groups``, else whether ``"group"`` is one of its ``in_keys``.

    Args:
        advantage (torch.nn.Module | type): an advantage module (:func:`make_advantage`'s or your
            own), or its class.
    """
    flag = getattr(advantage, "compares_groups", None)
    return bool(flag) if flag is not None else K.GROUP in list(getattr(advantage, "in_keys", []))


# ---- groups ------------------------------------------------------------------------------------

def group_scores(td: TensorDictBase) -> torch.Tensor:
    """(B,) each response's score ``s_i`` as the group baselines compare it: its reward without
    the KL part, summed over the response (the score whitened and clipped as the shaper was told,
    plus a multi-turn episode's turn rewards and a process reward's step values).

    ``"shaped_score"`` where the shaper wrote it (:class:`~rlhf_torchrl.objectives.kl_shaping.KLRewardShaper`);
    else ``sum_t (r_it - N_it)`` from ``("next", "reward")`` and ``("next", "non_score_reward")``
    (a shaper of your own; float rounding may then tell equal scores apart); a rollout not shaped
    yet: its ``"score"``.

    Args:
        td: a scored rollout, shaped or not.
    """
    keys = td.keys(True)
    if K.SHAPED_SCORE in keys:
        return td.get(K.SHAPED_SCORE)
    if K.REWARD not in keys:
        return td.get(K.SCORE)
    mask = td.get(K.RESPONSE_MASK)
    reward = td.get(K.REWARD).squeeze(-1)
    return torch.where(mask, reward - _kl_part(td), torch.zeros_like(reward)).sum(-1)


def informative_groups(td: TensorDictBase) -> torch.Tensor:
    """Bool (B,): rows whose group's scores (:func:`group_scores`, as the group baseline compares
    them: clipped, with the turn rewards) are not all equal. Under a group baseline a group of
    equal scores has a score advantage of 0 (no signal) and only dilutes the token-mean loss;
    DAPO's dynamic sampling drops such groups (Yu et al. 2025).

    Args:
        td: a scored rollout with ``"group"`` ids.
    """
    score, groups = group_scores(td), td.get(K.GROUP)
    index, sizes = F.group_index(groups)
    high = torch.full((len(sizes),), -torch.inf, dtype=score.dtype, device=score.device)
    low = torch.full((len(sizes),), torch.inf, dtype=score.dtype, device=score.device)
    high = high.scatter_reduce(0, index, score, "amax")
    low = low.scatter_reduce(0, index, score, "amin")
    return (high > low)[index]


def group_metrics(td: TensorDictBase) -> dict[str, float]:
    """Statistics of the groups of a scored rollout (empty without groups of 2 or more):
    ``group/size`` (responses per prompt), ``group/score_std`` (the mean within-group standard
    deviation of the scores, as :func:`group_scores` reads them: the signal a group baseline
    works with), ``group/equal_score_frac`` (groups whose scores are all equal: no signal under a
    group baseline).

    Args:
        td: a scored rollout with ``"group"`` ids.
    """
    if K.GROUP not in td.keys():
        return {}
    groups, score = td.get(K.GROUP), group_scores(td).double()
    index, sizes = F.group_index(groups)
    if int(sizes.min()) < 2:
        return {}
    def per_group(values: torch.Tensor) -> torch.Tensor:  # one value per group (equal in it)
        out = torch.zeros(len(sizes), dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, index, values, "amax", include_self=False)

    return {"group/size": float(sizes.double().mean()),
            "group/score_std": float(per_group(F.group_std(score, groups)).mean()),
            "group/equal_score_frac": float(per_group((~informative_groups(td)).double()).mean())}
