"""The PPO loss (the update that runs it over a rollout: :mod:`rlhf_torchrl.trainers.update`; the advantage
estimators: :mod:`rlhf_torchrl.objectives.advantages`).

- :class:`TokenPPOLoss` / :func:`make_ppo_loss`: TorchRL's ``ClipPPOLoss`` on the token-level
  actor and critic (or no critic), averaged over valid response tokens (``loss_mask_key``) as
  ``loss_aggregation`` says, with TRL's diagnostics added, an optional KL-to-reference term (GRPO's
  k3, clamped as verl's: its gradient is that of KL(pi_ref || pi)), clip-higher (an asymmetric
  ``clip_epsilon``), dual-clip PPO and VAPO's positive-example NLL.
"""

from __future__ import annotations

import math

import torch
from torchrl.objectives import ClipPPOLoss

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError, MissingDependencyError
from rlhf_torchrl.objectives.loss_inputs import loss_input_keys
from rlhf_torchrl.objectives.policy_losses import PolicyLoss, SurrogateInputs, make_policy_loss
from rlhf_torchrl.upstream import TESTED_TORCHRL, check_private_api


def _log_weight_arities(loss_cls: type) -> tuple[set[int], set[int]]:
    """The tuple lengths ``loss_cls._log_weight`` returns and ``loss_cls.forward`` unpacks from
    it, read from their source (nothing is called)."""
    import ast
    import inspect
    import textwrap

    def nodes(fn):
        return ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn))))

    returned = {len(n.value.elts) if isinstance(n.value, ast.Tuple) else 1
                for n in nodes(loss_cls._log_weight) if isinstance(n, ast.Return) and n.value}
    unpacked = {len(n.targets[0].elts) for n in nodes(loss_cls.forward)
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
                and isinstance(n.value, ast.Call)
                and getattr(n.value.func, "attr", None) == "_log_weight"}
    return returned, unpacked


def check_torchrl_contract(loss_cls: type = ClipPPOLoss) -> None:
    """Refuse a torchrl whose ``ClipPPOLoss._log_weight`` is not the one :class:`TokenPPOLoss`
    extends: one line naming the installed version and the tested one.

    :meth:`TokenPPOLoss._log_weight` overrides a private method: it takes and returns
    ``(log_weight, dist, kl_approx, log_is_weight)``, four values in torchrl 0.14.1, and three on
    TorchRL's main branch, where the override would fail inside the first update or hand the
    surrogate the wrong values. Checked when this module is imported, from the source of
    ``_log_weight`` and of ``forward`` (what each returns and unpacks); where the source cannot be
    read, the version must be :data:`~rlhf_torchrl.upstream.TESTED_TORCHRL`.

    Args:
        loss_cls: the class whose ``_log_weight`` is overridden (``ClipPPOLoss``).
    """
    import torchrl

    try:
        returned, unpacked = _log_weight_arities(loss_cls)
    except (OSError, TypeError):  # no source (a frozen install): only the tested release passes
        returned = unpacked = {4} if torchrl.__version__ == TESTED_TORCHRL else set()
    if returned != {4} or unpacked != {4}:
        shape = ", ".join(str(n) for n in sorted(returned | unpacked)) or "an unknown number of"
        raise MissingDependencyError(
            f"rlhf_torchrl needs torchrl {TESTED_TORCHRL} (pip install 'torchrl=={TESTED_TORCHRL}'): "
            f"TokenPPOLoss extends ClipPPOLoss._log_weight, a private method that gives 4 values "
            f"there and {shape} in the installed torchrl {torchrl.__version__}.")


check_torchrl_contract()
check_private_api()


class TokenPPOLoss(ClipPPOLoss):
    """TorchRL's ``ClipPPOLoss`` over response tokens, with TRL's diagnostics.

    The per-token losses are ``ClipPPOLoss``'s (see :func:`make_ppo_loss`; an asymmetric
    ``clip_epsilon=(low, high)`` is its own DAPO clip-higher). Two things it lacks are added here:

    - ``dual_clip``: :func:`~rlhf_torchrl.functional.dual_clip` on the per-token policy loss
      (``ClipPPOLoss`` has no dual clip; its surrogate is computed inside ``forward``, so the cap is
      applied to the per-token ``loss_objective`` it returns with ``reduction="none"``).
    - ``loss_aggregation``: ``ClipPPOLoss``'s ``reduction`` is a mean or a sum over the masked
      positions, with no per-sequence modes, so it runs with ``reduction="none"`` and every
      ``loss_*`` entry (policy, value, entropy, KL) is averaged by
      :func:`~rlhf_torchrl.functional.aggregate_loss` (``token_mean``: ``reduction="mean"``'s).
    - ``positive_nll_coef``: VAPO's positive-example LM loss, ``loss_positive_nll = coef *
      positive_nll`` over the responses whose ``"score"`` is at least ``positive_nll_threshold``
      (:func:`~rlhf_torchrl.functional.positive_nll`), normalised by the positive tokens of the
      whole minibatch however it is split (:meth:`prepare_minibatch`).
    - ``off_policy_correction``: with ``tis_cap``, the weight on each token's surrogate from the
      sampler's log-probs ``("log_probs", "behaviour")``, which the rollout must then hold (a loss
      asked to correct never runs uncorrected; :func:`~rlhf_torchrl.functional.off_policy_log_weight`:
      ``tis``, ``mis``, ``icepop``, ``seq_mask_tis``), passed to ``ClipPPOLoss`` as its
      ``log_is_weight``.

    Args:
        *args: ``ClipPPOLoss``'s positional arguments (the actor, the critic).
        tis_cap: the upper bound on the off-policy weight (None: no correction; set: the rollout
            must hold the sampler's log-probs).
        kl_loss_coef: the weight of the k3 term in the loss (0: off;
            :func:`~rlhf_torchrl.functional.clamped_k3`).
        dual_clip: the dual-clip cap ``c > 1`` (None: off).
        loss_aggregation: one of :data:`~rlhf_torchrl.functional.LOSS_AGGREGATIONS`.
        loss_aggregation_constant: ``seq_mean_token_sum_norm``'s ``C``, in tokens.
        positive_nll_coef: VAPO's positive-example LM loss weight (0: off).
        positive_nll_threshold: the ``"score"`` at or above which a response is positive.
        off_policy_correction: ``tis``, ``mis``, ``icepop`` or ``seq_mask_tis``.
        off_policy_low: the off-policy weight's lower bound (None: the correction's default).
        policy_loss: the per-token policy loss: a name in
            :data:`~rlhf_torchrl.objectives.policy_losses.POLICY_LOSSES` (``ppo``: ``ClipPPOLoss``'s
            clipped surrogate; ``gspo``, ``cispo``, ``clip_cov``, ``kl_cov``, a plugin's) or a
            :class:`~rlhf_torchrl.objectives.policy_losses.PolicyLoss`.
        policy_loss_args: the named policy loss's settings (``ppo.policy_loss_args``).
        **kwargs: ``ClipPPOLoss``'s keyword arguments, except ``reduction`` (always ``"none"``
            here).

    Its diagnostics are
    not TRL's quantities (``kl_approx`` is ``mean(old - new)`` and can be negative; its clip
    fractions count ratios and values outside the clip range whether or not the clip binds;
    all average over padded positions too), so these are added, each a mean over the valid
    response tokens, as TRL's ``PPOTrainer`` and open-instruct compute them:

    - ``approxkl``: ``0.5 * mean((log pi - log pi_old)^2)``
    - ``pg_clipfrac``: ``mean(pg_loss_clipped > pg_loss)`` with ``pg_loss = -A * ratio`` and
      ``pg_loss_clipped = -A * clip(ratio, 1 - eps, 1 + eps)`` (the clip binds)
    - ``vf_clipfrac``: ``mean(vf_loss_clipped > vf_loss)`` with ``vf_loss = (V - R)^2`` and
      ``vf_loss_clipped = (V_old + clip(V - V_old, -c, c) - R)^2`` (absent without value clip)
    - ``ratio``: ``mean(exp(log pi - log pi_old))``
    - ``pg_clipfrac_high`` / ``pg_clipfrac_low``: where the upper bound (``A > 0``, ``ratio > 1 +
      eps_high``) and the lower bound (``A < 0``, ``ratio < 1 - eps_low``) bind; they add up to
      ``pg_clipfrac`` (:func:`~rlhf_torchrl.functional.clip_binds`)
    - ``pg_clipfrac_dual``: where the dual clip binds (``A < 0``, ``ratio > dual_clip``; verl's
      ``pg_clipfrac_lower``), with ``dual_clip``
    - ``positive_nll`` (this part's share of the term before its coefficient) and
      ``positive_token_frac`` (the share of valid tokens in positive responses), with
      ``positive_nll_coef``
    - ``tis_weight`` (the mean correction weight) and ``tis_capped`` (the share whose ratio
      reaches the cap, ``pi_old / pi_behaviour >= tis_cap``, ``tis``; counted in log space before
      the clamp) or ``is_masked`` (the share the correction dropped, the masking corrections)

    The per-token log-ratio and new values are taken where ``ClipPPOLoss`` computes them
    (``_log_weight`` and ``loss_critic``), so no forward pass is added.
    """

    def __init__(self, *args, tis_cap: float | None = None, kl_loss_coef: float = 0.0,
                 dual_clip: float | None = None, loss_aggregation: str = "token_mean",
                 loss_aggregation_constant: float | None = None, positive_nll_coef: float = 0.0,
                 positive_nll_threshold: float = 1.0, off_policy_correction: str = "tis",
                 off_policy_low: float | None = None, policy_loss: str | PolicyLoss = "ppo",
                 policy_loss_args: dict | None = None, **kwargs):
        if kwargs.pop("reduction", None) not in (None, "none"):
            raise ConfigError("TokenPPOLoss averages its losses as loss_aggregation says "
                              f"({', '.join(F.LOSS_AGGREGATIONS)}), not with reduction=.")
        F.check_loss_aggregation(loss_aggregation, loss_aggregation_constant)
        if dual_clip is not None and not dual_clip > 1:
            raise ConfigError(f"dual_clip must be > 1 (or None), got {dual_clip}.")
        if positive_nll_coef < 0:
            raise ConfigError(f"positive_nll_coef must be >= 0 (VAPO uses 0.1), got {positive_nll_coef}.")
        if tis_cap is not None:
            F.check_off_policy_correction(off_policy_correction, tis_cap, off_policy_low)
        if not isinstance(policy_loss, PolicyLoss):
            policy_loss = make_policy_loss(policy_loss, policy_loss_args)
        policy_loss.check(loss_aggregation=loss_aggregation, dual_clip=dual_clip)
        super().__init__(*args, reduction="none", **kwargs)  # per-token loss_*, reduced in forward
        self.tis_cap = tis_cap
        self.off_policy_correction, self.off_policy_low = off_policy_correction, off_policy_low
        self.kl_loss_coef = kl_loss_coef
        self.dual_clip = dual_clip
        self.loss_aggregation = loss_aggregation
        self.loss_aggregation_constant = loss_aggregation_constant
        self.positive_nll_coef, self.positive_nll_threshold = positive_nll_coef, positive_nll_threshold
        self.policy_loss = policy_loss
        self._seen: dict[str, torch.Tensor] = {}  # per-token quantities of the current call

    def prepare_minibatch(self, td):
        """What the loss needs from a whole minibatch before :func:`~rlhf_torchrl.trainers.update.ppo_update`
        splits it into micro-batches and processes: with ``positive_nll_coef``, each response's
        weight in that term (:func:`~rlhf_torchrl.functional.positive_nll_weights`, written as
        ``"positive_nll_weight"``), so that the term is normalised once, by the positive tokens of
        the whole minibatch. Returns ``td``.

        Args:
            td (tensordict.TensorDictBase): the whole minibatch, written in place.
        """
        if self.positive_nll_coef:
            td.set(K.POSITIVE_NLL_WEIGHT, self._positive_weights(td))
        return self.policy_loss.prepare_minibatch(td)

    def _positive_weights(self, td):
        return F.positive_nll_weights(td.get(K.SCORE) >= self.positive_nll_threshold,
                                      td.get(K.RESPONSE_MASK), self.loss_aggregation,
                                      self.loss_aggregation_constant)

    def forward(self, tensordict):
        # a missing entry is named (ClipPPOLoss would try to estimate the advantages itself)
        K.require(tensordict, *loss_input_keys(self), what="TokenPPOLoss")
        self._seen = {}
        out = super().forward(tensordict)  # per-token loss_* entries, 0 on padding
        mask = tensordict.get(K.RESPONSE_MASK)  # (B, R)
        losses = {k: out.get(k).reshape(mask.shape) for k in out.keys() if k.startswith("loss_")}
        losses["loss_objective"], extra = self._policy_loss(tensordict, losses["loss_objective"])
        out.update(extra)
        if self.dual_clip is not None:
            adv = tensordict.get(self.tensor_keys.advantage).reshape(mask.shape)
            weight = self._seen.get("is_weight")
            losses["loss_objective"] = F.dual_clip(
                losses["loss_objective"], adv, self.dual_clip,
                None if weight is None else weight.reshape(mask.shape))
        if self.kl_loss_coef:
            losses["loss_kl"], out["kl_to_ref"] = self._kl_to_reference(tensordict,
                                                                        self._seen["log_weight"])
        for key, loss in losses.items():
            out.set(key, F.aggregate_loss(loss, mask, self.loss_aggregation,
                                          self.loss_aggregation_constant))
        if self.positive_nll_coef:
            out.update(self._positive_nll(tensordict, self._seen["log_weight"]))
        out.update(self._diagnostics(tensordict, self._seen))
        self._seen = {}
        return out

    def _policy_loss(self, td, clipped) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each token's policy loss (B, R), 0 on padding, from the registered policy loss (PPO's:
        ``ClipPPOLoss``'s ``clipped`` as it is), and that loss's own diagnostics."""
        mask = td.get(K.RESPONSE_MASK)
        weight = self._seen.get("is_weight")
        low, high = (float(b.exp()) for b in self._clip_bounds)
        loss, extra = self.policy_loss.per_token(SurrogateInputs(
            log_weight=self._seen["surrogate_log_weight"].reshape(mask.shape),
            advantage=td.get(self.tensor_keys.advantage).reshape(mask.shape), mask=mask,
            clip_low=low, clip_high=high, is_weight=None if weight is None else weight.reshape(mask.shape),
            clipped_loss=clipped, tensordict=td))
        return torch.where(mask, loss, torch.zeros_like(loss)), extra

    def _kl_to_reference(self, td, log_weight) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token ``kl_loss_coef * min(k3, 10)`` (B, R), k3 = ``(r - 1) - log r``, ``r = pi_ref
        / pi``, as GRPO puts it in the loss and verl clamps it
        (:func:`~rlhf_torchrl.functional.clamped_k3`), with the gradient of the new log-probs
        (``old + log_weight``): in expectation that of KL(pi_ref || pi), though its value estimates
        KL(pi || pi_ref). Also its token-mean over valid tokens (a diagnostic, clamped too)."""
        mask = td.get(K.RESPONSE_MASK)
        new = td.get(self.tensor_keys.sample_log_prob) + log_weight.reshape(mask.shape)
        kl = F.clamped_k3(new, td.get(K.REF_LOG_PROB))
        return self.kl_loss_coef * kl, F.masked_mean(kl.detach(), mask)

    def _positive_nll(self, td, log_weight) -> dict[str, torch.Tensor]:
        """``loss_positive_nll``: ``coef * sum_it m_it c_i (-log pi(y_it)) / size`` with the new
        log-probs (``old + log_weight``), ``c_i`` the minibatch's weights (:meth:`prepare_minibatch`;
        this batch's own when called on a whole batch) and ``size`` this batch's aggregation size:
        weighted by its share of the minibatch, as every term is, it adds up to ``coef *
        positive_nll`` of the minibatch. Also ``positive_nll`` (the term before ``coef``) and
        ``positive_token_frac``, diagnostics."""
        mask = td.get(K.RESPONSE_MASK)
        weights = (td.get(K.POSITIVE_NLL_WEIGHT) if K.POSITIVE_NLL_WEIGHT in td.keys()
                   else self._positive_weights(td))
        new = td.get(self.tensor_keys.sample_log_prob) + log_weight.reshape(mask.shape)
        per_token = torch.where(mask, -new * weights.to(new.dtype).unsqueeze(-1), torch.zeros_like(new))
        size = F.aggregation_size(mask, self.loss_aggregation, self.loss_aggregation_constant)
        nll = per_token.sum() / size.to(new.dtype)
        positive = (weights > 0).unsqueeze(-1).expand_as(mask).to(new.dtype)
        return {"loss_positive_nll": self.positive_nll_coef * nll, "positive_nll": nll.detach(),
                "positive_token_frac": F.masked_mean(positive, mask)}

    def _log_weight(self, tensordict, adv_shape):
        log_weight, dist, kl_approx, log_is_weight = super()._log_weight(tensordict, adv_shape)
        if self.kl_loss_coef or self.positive_nll_coef:
            self._seen["log_weight"] = log_weight  # with its gradient: the new log-probs of the
            # KL and NLL terms
        mask = tensordict.get(K.RESPONSE_MASK)
        # the ratio the surrogate is taken of (GSPO: the response's), clipped by ClipPPOLoss
        log_weight = self.policy_loss.log_weight(log_weight.reshape(mask.shape), mask).view_as(log_weight)
        self._seen["surrogate_log_weight"] = log_weight
        self._seen["log_ratio"] = log_weight.detach().squeeze(-1)  # (B, R)
        if self.tis_cap is not None:  # the sampler's log-probs: required (loss_input_keys)
            # the sampled tokens came from the behaviour policy, the ratio is taken against the
            # recomputed old policy; ClipPPOLoss weights both surrogate terms by exp(log_is_weight),
            # no gradient: tis's min(pi_old / pi_behaviour, cap), or a masking correction's weight
            # (-inf where it drops a token or a response)
            old = tensordict.get(self.tensor_keys.sample_log_prob)
            tis, keep = F.off_policy_log_weight(
                old - tensordict.get(K.BEHAVIOUR_LOG_PROB), tensordict.get(K.RESPONSE_MASK),
                self.off_policy_correction, cap=self.tis_cap, low=self.off_policy_low)
            self._seen["tis_weight"] = tis.exp()
            if self.off_policy_correction != "tis":
                self._seen["is_masked"] = ~keep
            else:  # counted before the clamp, in log space: exp(log C) rounds below C in fp32 for
                # many caps (1.32, 1.57, 1.99, 2.15), and the clamped weight would never reach it
                self._seen["tis_capped"] = (old - tensordict.get(K.BEHAVIOUR_LOG_PROB)
                                            >= math.log(self.tis_cap))
            tis = tis.view_as(log_weight)
            log_is_weight = tis if log_is_weight is None else log_is_weight + tis
        if log_is_weight is not None:  # the surrogate's weight: the dual clip's cap scales with it
            self._seen["is_weight"] = log_is_weight.detach().exp()
        return log_weight, dist, kl_approx, log_is_weight

    def loss_critic(self, tensordict):
        result = super().loss_critic(tensordict)
        # the critic wrote its new values over the old ones in ClipPPOLoss's working copy
        self._seen["value"] = tensordict.get(self.tensor_keys.value).detach().squeeze(-1)
        return result

    @torch.no_grad()
    def _diagnostics(self, td, seen) -> dict[str, torch.Tensor]:
        mask = td.get(K.RESPONSE_MASK)
        log_ratio = seen["log_ratio"]
        ratio = log_ratio.exp()
        adv = td.get(self.tensor_keys.advantage).squeeze(-1)
        low, high = (b.exp() for b in self._clip_bounds)
        pg_loss, pg_loss_clipped = -adv * ratio, -adv * ratio.clamp(low, high)
        binds_high, binds_low, binds_dual = F.clip_binds(ratio, adv, 1 - low, high - 1, self.dual_clip)
        out = {
            "approxkl": F.masked_mean(0.5 * log_ratio**2, mask),
            "pg_clipfrac": F.masked_mean((pg_loss_clipped > pg_loss).float(), mask),
            "pg_clipfrac_high": F.masked_mean(binds_high.to(ratio.dtype), mask),
            "pg_clipfrac_low": F.masked_mean(binds_low.to(ratio.dtype), mask),
            "ratio": F.masked_mean(ratio, mask),
        }
        if self.dual_clip is not None:
            out["pg_clipfrac_dual"] = F.masked_mean(binds_dual.to(ratio.dtype), mask)
        if "tis_weight" in seen:
            out["tis_weight"] = F.masked_mean(seen["tis_weight"], mask)
            if "is_masked" in seen:
                out["is_masked"] = F.masked_mean(seen["is_masked"].to(ratio.dtype), mask)
            else:
                out["tis_capped"] = F.masked_mean(seen["tis_capped"].to(ratio.dtype), mask)
        if "value" in seen and self.clip_value is not None:
            new = seen["value"]
            old = td.get(self.tensor_keys.value).squeeze(-1)
            ret = td.get(self.tensor_keys.value_target).squeeze(-1)
            clipped = old + (new - old).clamp(-self.clip_value, self.clip_value)
            out["vf_clipfrac"] = F.masked_mean(((clipped - ret) ** 2 > (new - ret) ** 2).float(), mask)
        return out


def make_ppo_loss(
    actor,
    critic=None,
    *,
    clip_epsilon: float = 0.2,
    clip_value: float | None = 0.2,
    vf_coef: float = 0.1,
    entropy_coef: float = 0.0,
    tis_cap: float | None = None,
    kl_loss_coef: float = 0.0,
    clip_epsilon_low: float | None = None,
    clip_epsilon_high: float | None = None,
    dual_clip: float | None = None,
    loss_aggregation: str = "token_mean",
    loss_aggregation_constant: float | None = None,
    positive_nll_coef: float = 0.0,
    positive_nll_threshold: float = 1.0,
    off_policy_correction: str = "tis",
    off_policy_low: float | None = None,
    policy_loss: str = "ppo",
    policy_loss_args: dict | None = None,
):
    """TorchRL's ``ClipPPOLoss`` for token-level PPO (a :class:`TokenPPOLoss`).

    ``loss_objective = -mean_t min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t)``;
    ``loss_critic = vf_coef * mean_t 0.5 * max((V - R)^2, (clip(V, V_old +- clip_value) - R)^2)``
    (TorchRL's ``l2`` distance has no 1/2, so ``critic_coeff = vf_coef / 2``);
    ``loss_entropy = -entropy_coef * mean_t H_t`` when ``entropy_coef > 0``;
    ``loss_kl = kl_loss_coef * mean_t min(k3_t, 10)`` when ``kl_loss_coef > 0``, ``k3_t = (r_t - 1)
    - log r_t`` with ``r_t = pi_ref / pi`` (the KL penalty in the loss, as GRPO has it, rather
    than, or beside, the per-token reward's; reads ``("ref_log_probs", "response")``). Its value
    estimates KL(pi || pi_ref), but its gradient is in expectation that of the reverse KL,
    KL(pi_ref || pi); each token is clamped at 10 as verl clamps it
    (:func:`~rlhf_torchrl.functional.clamped_k3`). ``mean_t`` is over valid response tokens
    (``loss_mask_key = ("masks", "response")``) as ``loss_aggregation`` says.
    :func:`ppo_update` keeps that average exact over a whole minibatch, however it is split into
    micro-batches and processes.

    Args:
        actor (torch.nn.Module): the policy's token-level log-probs
            (:class:`~rlhf_torchrl.modules.TokenLevelActor`).
        critic (torch.nn.Module | None): a :class:`~rlhf_torchrl.modules.TokenCritic`; None: a
            critic-free loss (GRPO, RLOO, REINFORCE++ advantages), no value term, and
            ``clip_value``/``vf_coef`` are ignored.
        clip_epsilon: the ratio's clip range ``eps`` (both sides, unless the next two are given).
        clip_value: the value clip ``c`` around the old values (None: no value clip).
        vf_coef: the value loss's weight.
        entropy_coef: the entropy bonus's weight (0: off).
        tis_cap: the upper bound on the off-policy weight ``pi_old / pi_behaviour`` (None: no
            correction). Used where the old log-probs were recomputed by the trainer and the
            sampler's are kept as ``("log_probs", "behaviour")``: tokens sampled by a stale policy
            (asynchronous collection) or other kernels (verl's and OpenRLHF's TIS).
        kl_loss_coef: the weight of the k3 term in the loss (0: off).
        clip_epsilon_low: DAPO's clip-higher lower bound (None: ``clip_epsilon``), passed to
            ``ClipPPOLoss`` as its asymmetric ``clip_epsilon=(low, high)``.
        clip_epsilon_high: the upper bound (None: ``clip_epsilon``; DAPO uses 0.2 / 0.28).
        dual_clip: ``c > 1``: the per-token policy loss on ``A < 0`` is capped at ``-A c``
            (:func:`~rlhf_torchrl.functional.dual_clip`; None: off).
        loss_aggregation: how every ``loss_*`` term (policy, value, entropy, KL) averages its
            per-token values (:func:`~rlhf_torchrl.functional.aggregate_loss`): ``token_mean``
            (over all valid tokens), ``seq_mean_token_mean``, ``seq_mean_token_sum``, or
            ``seq_mean_token_sum_norm`` (Dr. GRPO).
        loss_aggregation_constant: ``seq_mean_token_sum_norm``'s ``C``, the generation budget in
            tokens that each response's token sum is divided by.
        positive_nll_coef: VAPO's positive-example LM loss weight (0: off):
            ``loss_positive_nll = coef * mean_{t in T} -log pi(y_t)`` over the tokens of the
            positive responses (:func:`~rlhf_torchrl.functional.positive_nll`), normalised once
            per minibatch.
        positive_nll_threshold: the ``"score"`` at or above which a response is positive (VAPO:
            mu = 0.1 on the correct answers, score >= 1 for a verifier that gives 1).
        off_policy_correction: how the ratio ``pi_old / pi_behaviour`` becomes the weight:
            ``tis``, ``mis``, ``icepop`` or ``seq_mask_tis``
            (:func:`~rlhf_torchrl.functional.off_policy_log_weight`, each with its formula).
        off_policy_low: the weight's lower bound (None: none for ``tis`` and ``mis``,
            ``1 / tis_cap`` for ``icepop`` and ``seq_mask_tis``).
        policy_loss: the per-token policy loss, a name in
            :data:`~rlhf_torchrl.objectives.policy_losses.POLICY_LOSSES` (``ppo``: the clipped
            surrogate above; ``gspo``, ``cispo``, ``clip_cov``, ``kl_cov``).
        policy_loss_args: its settings (its ``__init__``'s keyword arguments).
    """
    if tis_cap is not None and tis_cap <= 0:
        raise ConfigError(f"tis_cap must be > 0 (or None), got {tis_cap}.")
    if kl_loss_coef < 0:
        raise ConfigError(f"kl_loss_coef must be >= 0, got {kl_loss_coef}.")
    if clip_epsilon_low is not None or clip_epsilon_high is not None:
        eps_low = clip_epsilon if clip_epsilon_low is None else clip_epsilon_low
        eps_high = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
        if not (0 < eps_low < 1 and eps_high > 0):
            raise ConfigError(f"clip_epsilon_low must be in (0, 1) and clip_epsilon_high > 0 (the "
                              f"ratio is clipped to [1 - low, 1 + high]), got {eps_low} and {eps_high}.")
        clip_epsilon = (eps_low, eps_high)  # ClipPPOLoss's asymmetric clip
    loss = TokenPPOLoss(
        actor,
        critic,
        clip_epsilon=clip_epsilon,
        entropy_bonus=entropy_coef > 0,
        entropy_coeff=entropy_coef if entropy_coef > 0 else None,
        critic_coeff=0.5 * vf_coef if critic is not None else None,
        loss_critic_type="l2",
        normalize_advantage=False,  # each advantage estimator normalises as its method says
        clip_value=clip_value if critic is not None else None,
        functional=False,
        log_explained_variance=False,
        tis_cap=tis_cap,
        kl_loss_coef=kl_loss_coef,
        dual_clip=dual_clip,
        loss_aggregation=loss_aggregation,
        loss_aggregation_constant=loss_aggregation_constant,
        positive_nll_coef=positive_nll_coef,
        positive_nll_threshold=positive_nll_threshold,
        off_policy_correction=off_policy_correction,
        off_policy_low=off_policy_low,
        policy_loss=policy_loss,
        policy_loss_args=policy_loss_args,
    )
    keys = {"value": K.VALUE, "value_target": K.VALUE_TARGET} if critic is not None else {}
    loss.set_keys(action=K.RESPONSE_TOKENS, sample_log_prob=K.LOG_PROB, advantage=K.ADVANTAGE,
                  **keys)
    loss.loss_mask_key = K.RESPONSE_MASK
    return loss
