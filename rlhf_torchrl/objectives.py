"""Advantages, the PPO loss and the PPO update over a rollout.

- :class:`ResponseGAE`: TorchRL's GAE over response tokens (``done`` at the last one), returns =
  advantages + values, advantages whitened over valid tokens.
- :class:`TokenPPOLoss` / :func:`make_ppo_loss`: TorchRL's ``ClipPPOLoss`` on the token-level
  actor and critic, token-mean over valid response tokens (``loss_mask_key``), with TRL's
  diagnostics added.
- :func:`ppo_update`: ``num_ppo_epochs`` passes, each a shuffle into minibatches served by a
  TorchRL replay buffer, with gradient accumulation that keeps the minibatch's token-mean, and
  gradient-norm clipping.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives import ClipPPOLoss

from . import functional as F
from . import keys as K


class ResponseGAE(TensorDictModuleBase):
    """GAE over response tokens; writes ``"advantage"`` and ``"value_target"`` (B, R, 1).

    ``A = GAE(r, V; gamma, lmbda)`` with the episode ending at the last response token
    (:func:`rlhf_torchrl.functional.gae`, TorchRL's ``generalized_advantage_estimate``);
    ``value_target = A + V`` (before whitening); ``A`` whitened over valid tokens when
    ``whiten_advantages`` (N+ details: advantage whitening).
    """

    def __init__(self, *, gamma: float = 1.0, lmbda: float = 0.95, whiten_advantages: bool = True):
        super().__init__()
        self.gamma, self.lmbda, self.whiten_advantages = gamma, lmbda, whiten_advantages
        self.in_keys = [K.REWARD, K.VALUE, K.RESPONSE_MASK]
        self.out_keys = [K.ADVANTAGE, K.VALUE_TARGET]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        mask = td.get(K.RESPONSE_MASK)
        adv, returns = F.gae(
            td.get(K.REWARD).squeeze(-1), td.get(K.VALUE).squeeze(-1), mask, self.gamma, self.lmbda
        )
        if self.whiten_advantages and mask.sum() > 1:
            adv = F.masked_whiten(adv, mask)
        td.set(K.ADVANTAGE, adv.unsqueeze(-1))
        td.set(K.VALUE_TARGET, returns.unsqueeze(-1))
        return td


class TokenPPOLoss(ClipPPOLoss):
    """TorchRL's ``ClipPPOLoss`` over response tokens, with TRL's diagnostics.

    The losses are ``ClipPPOLoss``'s, unchanged (see :func:`make_ppo_loss`). Its diagnostics are
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

    The per-token log-ratio and new values are taken where ``ClipPPOLoss`` computes them
    (``_log_weight`` and ``loss_critic``), so no forward pass is added.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._seen: dict[str, torch.Tensor] = {}  # per-token quantities of the current call

    def forward(self, tensordict):
        self._seen = {}
        out = super().forward(tensordict)
        out.update(self._diagnostics(tensordict, self._seen))
        self._seen = {}
        return out

    def _log_weight(self, tensordict, adv_shape):
        result = super()._log_weight(tensordict, adv_shape)
        self._seen["log_ratio"] = result[0].detach().squeeze(-1)  # (B, R)
        return result

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
        out = {
            "approxkl": F.masked_mean(0.5 * log_ratio**2, mask),
            "pg_clipfrac": F.masked_mean((pg_loss_clipped > pg_loss).float(), mask),
            "ratio": F.masked_mean(ratio, mask),
        }
        if "value" in seen and self.clip_value is not None:
            new = seen["value"]
            old = td.get(self.tensor_keys.value).squeeze(-1)
            ret = td.get(self.tensor_keys.value_target).squeeze(-1)
            clipped = old + (new - old).clamp(-self.clip_value, self.clip_value)
            out["vf_clipfrac"] = F.masked_mean(((clipped - ret) ** 2 > (new - ret) ** 2).float(), mask)
        return out


def make_ppo_loss(
    actor,
    critic,
    *,
    clip_epsilon: float = 0.2,
    clip_value: float | None = 0.2,
    vf_coef: float = 0.1,
    entropy_coef: float = 0.0,
):
    """TorchRL's ``ClipPPOLoss`` for token-level PPO (a :class:`TokenPPOLoss`).

    ``loss_objective = -mean_t min(ratio_t A_t, clip(ratio_t, 1 - eps, 1 + eps) A_t)``;
    ``loss_critic = vf_coef * mean_t 0.5 * max((V - R)^2, (clip(V, V_old +- clip_value) - R)^2)``
    (TorchRL's ``l2`` distance has no 1/2, so ``critic_coeff = vf_coef / 2``);
    ``loss_entropy = -entropy_coef * mean_t H_t`` when ``entropy_coef > 0``. Means are over valid
    response tokens (``loss_mask_key = ("masks", "response")``).
    """
    loss = TokenPPOLoss(
        actor,
        critic,
        clip_epsilon=clip_epsilon,
        entropy_bonus=entropy_coef > 0,
        entropy_coeff=entropy_coef if entropy_coef > 0 else None,
        critic_coeff=0.5 * vf_coef,
        loss_critic_type="l2",
        normalize_advantage=False,  # whitened once per rollout by ResponseGAE
        clip_value=clip_value,
        functional=False,
        log_explained_variance=False,
        reduction="mean",
    )
    loss.set_keys(
        action=K.RESPONSE_TOKENS,
        sample_log_prob=K.LOG_PROB,
        value=K.VALUE,
        advantage=K.ADVANTAGE,
        value_target=K.VALUE_TARGET,
    )
    loss.loss_mask_key = K.RESPONSE_MASK
    return loss


def make_minibatch_buffer(batch_size: int, mini_batch_size: int):
    """TorchRL replay buffer that serves one rollout as shuffled minibatches, without replacement.

    ``LazyStackStorage`` because the padded widths change from one rollout to the next
    (``LazyTensorStorage`` fails then); :func:`ppo_update` empties and refills it every iteration.
    """
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    return ReplayBuffer(storage=LazyStackStorage(batch_size), sampler=SamplerWithoutReplacement(),
                        batch_size=mini_batch_size)


def _valid_fraction(td: TensorDictBase) -> float:
    mask = td.get(K.RESPONSE_MASK)
    return float(mask.sum()) / mask.numel()


def _tensors_only(td: TensorDictBase) -> TensorDictBase:
    """``td`` without its non-tensor entries (text, conversations, dataset fields)."""
    return td.select(*(k for k, v in td.items(True, True) if isinstance(v, torch.Tensor)))


def ppo_update(
    rollout: TensorDictBase,
    loss_module,
    optimizer: torch.optim.Optimizer,
    *,
    num_ppo_epochs: int,
    num_mini_batches: int,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = 1.0,
    scheduler=None,
    replay_buffer=None,
) -> dict[str, float]:
    """Run the PPO epochs over one rollout and return the averaged diagnostics.

    Each epoch the rollout is served by a TorchRL ``ReplayBuffer`` (``LazyStackStorage`` and
    ``SamplerWithoutReplacement``) in ``num_mini_batches`` shuffled minibatches; each minibatch is
    split into ``gradient_accumulation_steps`` micro-batches whose gradients add up before one
    optimiser step. The loss of a minibatch is the mean over all its valid tokens, whatever the
    split: micro-batch ``j``'s token-mean is weighted by ``n_j / n`` (its share of the minibatch's
    valid tokens), not ``1 / k``, so ``k`` changes the memory, never the gradient. ``rollout``
    rows must be divisible accordingly (checked up front by the recipe).

    Returned metrics, named and defined as in TRL's ``PPOTrainer`` (:class:`TokenPPOLoss`), each
    a mean over valid response tokens per micro-batch, averaged over micro-batches:
    ``policy/approxkl_avg``, ``policy/clipfrac_avg``, ``loss/policy_avg``, ``loss/value_avg``,
    ``val/clipfrac_avg``, ``val/ratio`` and ``val/ratio_var`` (the variance of the micro-batch
    ratio means), ``policy/entropy_avg`` with an entropy bonus, and ``grad_norm`` (before clipping,
    one per optimiser step).
    """
    n = rollout.shape[0]
    mini = n // num_mini_batches
    micro = mini // gradient_accumulation_steps
    if replay_buffer is None:
        replay_buffer = make_minibatch_buffer(n, mini)
    replay_buffer.empty()
    replay_buffer.extend(_tensors_only(rollout))
    critic_coeff = getattr(loss_module, "critic_coeff", None)
    vf_coef = 2 * float(critic_coeff) if critic_coeff is not None else 0.0
    stats: dict[str, list[float]] = defaultdict(list)
    ratios = []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    loss_module.train()
    for _ in range(num_ppo_epochs):
        for _ in range(num_mini_batches):
            minibatch = replay_buffer.sample().contiguous()  # lazy stack -> dense (b, ...)
            n_tokens = minibatch.get(K.RESPONSE_MASK).sum().clamp_min(1)
            optimizer.zero_grad(set_to_none=True)
            for micro_batch in minibatch.split(micro):
                out = loss_module(micro_batch)
                loss = sum(v for k, v in out.items() if k.startswith("loss_"))
                # every loss_* is a token-mean over this micro-batch: weight it by its token share
                (loss * micro_batch.get(K.RESPONSE_MASK).sum() / n_tokens).backward()
                out = out.detach()
                stats["policy/clipfrac_avg"].append(float(out["pg_clipfrac"]))
                stats["policy/approxkl_avg"].append(float(out["approxkl"]))
                stats["loss/policy_avg"].append(float(out["loss_objective"]))
                if vf_coef > 0:
                    stats["loss/value_avg"].append(float(out["loss_critic"]) / vf_coef)
                if "vf_clipfrac" in out.keys():
                    stats["val/clipfrac_avg"].append(float(out["vf_clipfrac"]))
                if "entropy" in out.keys():
                    # ClipPPOLoss averages the entropy over every position (0 on pads)
                    stats["policy/entropy_avg"].append(float(out["entropy"]) / _valid_fraction(micro_batch))
                ratios.append(float(out["ratio"]))
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, max_grad_norm if max_grad_norm else float("inf")
            )
            stats["grad_norm"].append(float(grad_norm))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    loss_module.eval()
    metrics = {k: sum(v) / len(v) for k, v in stats.items()}
    r = torch.tensor(ratios)
    metrics["val/ratio"] = float(r.mean())
    metrics["val/ratio_var"] = float(r.var()) if r.numel() > 1 else 0.0
    return metrics
