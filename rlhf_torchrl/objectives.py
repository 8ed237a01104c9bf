"""The PPO loss and the PPO update over a rollout (the advantage estimators: :mod:`.advantages`).

- :class:`TokenPPOLoss` / :func:`make_ppo_loss`: TorchRL's ``ClipPPOLoss`` on the token-level
  actor and critic (or no critic), token-mean over valid response tokens (``loss_mask_key``), with
  TRL's diagnostics added and an optional KL-to-reference term (GRPO's k3).
- :func:`ppo_update`: ``num_ppo_epochs`` passes, each a shuffle into minibatches served by a
  TorchRL replay buffer, with gradient accumulation over equal or token-budget micro-batches that
  keeps the minibatch's token-mean, gradient-norm clipping, and data parallelism.
"""

from __future__ import annotations

import math
import warnings

import torch
from tensordict import TensorDictBase
from torchrl.objectives import ClipPPOLoss

from . import functional as F
from . import keys as K
from .advantages import ResponseGAE  # noqa: F401 - its home before the estimators had their own
from .errors import ConfigError


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

    def __init__(self, *args, tis_cap: float | None = None, kl_loss_coef: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.tis_cap = tis_cap
        self.kl_loss_coef = kl_loss_coef
        self._seen: dict[str, torch.Tensor] = {}  # per-token quantities of the current call

    def forward(self, tensordict):
        self._seen = {}
        out = super().forward(tensordict)
        if self.kl_loss_coef:
            out.update(self._kl_to_reference(tensordict, self._seen["log_weight"]))
        out.update(self._diagnostics(tensordict, self._seen))
        self._seen = {}
        return out

    def _kl_to_reference(self, td, log_weight) -> dict[str, torch.Tensor]:
        """``loss_kl = kl_loss_coef * mean_t k3(pi, pi_ref)`` over valid response tokens, with the
        gradient of the new log-probs (``old + log_weight``); k3 = ``(r - 1) - log r``, ``r =
        pi_ref / pi``, as GRPO puts it in the loss."""
        mask = td.get(K.RESPONSE_MASK)
        new = td.get(self.tensor_keys.sample_log_prob) + log_weight.squeeze(-1)
        kl = F.kl_estimate(new, td.get(K.REF_LOG_PROB), "k3")
        return {"loss_kl": self.kl_loss_coef * F.masked_mean(kl, mask),
                "kl_to_ref": F.masked_mean(kl.detach(), mask)}

    def _log_weight(self, tensordict, adv_shape):
        log_weight, dist, kl_approx, log_is_weight = super()._log_weight(tensordict, adv_shape)
        self._seen["log_ratio"] = log_weight.detach().squeeze(-1)  # (B, R)
        if self.kl_loss_coef:
            self._seen["log_weight"] = log_weight  # with its gradient: the KL term's new log-probs
        if self.tis_cap is not None and K.BEHAVIOUR_LOG_PROB in tensordict.keys(True):
            # truncated importance sampling: the sampled tokens came from the behaviour policy, the
            # ratio is taken against the recomputed old policy; ClipPPOLoss weights both surrogate
            # terms by exp(log_is_weight) = min(pi_old / pi_behaviour, cap), no gradient
            old = tensordict.get(self.tensor_keys.sample_log_prob)
            tis = (old - tensordict.get(K.BEHAVIOUR_LOG_PROB)).clamp_max(math.log(self.tis_cap))
            self._seen["tis_weight"] = tis.exp()
            tis = tis.view_as(log_weight)
            log_is_weight = tis if log_is_weight is None else log_is_weight + tis
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
        out = {
            "approxkl": F.masked_mean(0.5 * log_ratio**2, mask),
            "pg_clipfrac": F.masked_mean((pg_loss_clipped > pg_loss).float(), mask),
            "ratio": F.masked_mean(ratio, mask),
        }
        if "tis_weight" in seen:
            out["tis_weight"] = F.masked_mean(seen["tis_weight"], mask)
            out["tis_capped"] = F.masked_mean((seen["tis_weight"] >= self.tis_cap).float(), mask)
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
):
    """TorchRL's ``ClipPPOLoss`` for token-level PPO (a :class:`TokenPPOLoss`).

    ``loss_objective = -mean_t min(ratio_t A_t, clip(ratio_t, 1 - eps, 1 + eps) A_t)``;
    ``loss_critic = vf_coef * mean_t 0.5 * max((V - R)^2, (clip(V, V_old +- clip_value) - R)^2)``
    (TorchRL's ``l2`` distance has no 1/2, so ``critic_coeff = vf_coef / 2``);
    ``loss_entropy = -entropy_coef * mean_t H_t`` when ``entropy_coef > 0``;
    ``loss_kl = kl_loss_coef * mean_t k3(pi, pi_ref)`` when ``kl_loss_coef > 0`` (the KL penalty in
    the loss, as GRPO has it, rather than, or beside, the per-token reward's; reads
    ``("ref_log_probs", "response")``). Means are over valid response tokens
    (``loss_mask_key = ("masks", "response")``).

    ``critic=None``: a critic-free loss (GRPO, RLOO, REINFORCE++ advantages): no value term, and
    ``clip_value``/``vf_coef`` are ignored.

    ``tis_cap``: truncated importance sampling (verl's and OpenRLHF's TIS) where the old log-probs
    were recomputed by the trainer and the sampler's are kept as ``("log_probs", "behaviour")``:
    each token's surrogate is weighted by ``min(pi_old / pi_behaviour, tis_cap)`` (no gradient),
    correcting for tokens sampled by a stale policy (asynchronous collection) or other kernels.
    """
    if tis_cap is not None and tis_cap <= 0:
        raise ConfigError(f"tis_cap must be > 0 (or None), got {tis_cap}.")
    if kl_loss_coef < 0:
        raise ConfigError(f"kl_loss_coef must be >= 0, got {kl_loss_coef}.")
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
        reduction="mean",
        tis_cap=tis_cap,
        kl_loss_coef=kl_loss_coef,
    )
    keys = {"value": K.VALUE, "value_target": K.VALUE_TARGET} if critic is not None else {}
    loss.set_keys(action=K.RESPONSE_TOKENS, sample_log_prob=K.LOG_PROB, advantage=K.ADVANTAGE,
                  **keys)
    loss.loss_mask_key = K.RESPONSE_MASK
    return loss


def make_minibatch_buffer(batch_size: int, mini_batch_size: int, seed: int | None = None):
    """TorchRL replay buffer that serves one rollout as shuffled minibatches, without replacement.

    ``LazyStackStorage`` because the padded widths change from one rollout to the next
    (``LazyTensorStorage`` fails then); :func:`ppo_update` empties and refills it every iteration.
    With ``seed`` the shuffle has its own generator: every data-parallel process draws the same
    minibatches, whatever else consumes torch's global random numbers.
    """
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return ReplayBuffer(storage=LazyStackStorage(batch_size), sampler=SamplerWithoutReplacement(),
                        batch_size=mini_batch_size, generator=generator)


def _tensors_only(td: TensorDictBase) -> TensorDictBase:
    """``td`` without its non-tensor entries (text, conversations, dataset fields)."""
    return td.select(*(k for k, v in td.items(True, True) if isinstance(v, torch.Tensor)))


def trim_padding(td: TensorDictBase) -> TensorDictBase:
    """``td`` cut to its own widths: prompt columns that are padding in every row (on the left) and
    response columns that are padding in every row (on the right) removed.

    Every entry whose second dimension is the response width is cut with the response. Left
    padding only shifts nothing (position ids count from the first real token) and right padding
    is never attended to, so a trimmed batch gives the same log-probs and values on its tokens.
    """
    from .modules.actor_critic import response_attention

    prompt_mask, response_mask = td.get(K.PROMPT_MASK), response_attention(td)
    p_width, r_width = prompt_mask.shape[1], response_mask.shape[1]
    # at least one column each (a prompt predicts the first response token)
    p_keep = max(p_width - int(prompt_mask.any(0).long().argmax()), 1)  # from the first real column
    r_keep = max(int(F.last_token_index(response_mask.any(0, keepdim=True))) + 1, 1)
    if p_keep == p_width and r_keep == r_width:
        return td
    out = td.clone(False)
    for key in K.PROMPT_WIDTH:
        out.set(key, td.get(key)[:, p_width - p_keep :])
    for key, value in td.items(True, True):
        if key not in K.PROMPT_WIDTH and isinstance(value, torch.Tensor) and value.ndim >= 2 \
                and value.shape[1] == r_width:
            out.set(key, value[:, :r_keep])
    return out


def token_budget_split(mask_prompt: torch.Tensor, mask_response: torch.Tensor, max_tokens: int,
                       min_parts: int = 1) -> list[torch.Tensor]:
    """Rows grouped into micro-batches of at most ``max_tokens`` padded tokens each.

    The padded cost of a micro-batch is ``rows * (longest prompt + longest response)`` in it, after
    :func:`trim_padding`. Rows are sorted by length (longest first) and packed greedily, so each
    micro-batch holds rows of similar length; a row longer than the budget goes alone. Then the
    costliest micro-batches are halved until there are ``min_parts`` (data-parallel processes must
    run the same number of micro-batches); where no micro-batch can be halved, empty ones (no rows)
    are added. Returns one index tensor per micro-batch, longest rows first.
    """
    p_len, r_len = mask_prompt.sum(-1), mask_response.sum(-1)
    order = torch.argsort(p_len + r_len, descending=True, stable=True).tolist()
    p_len, r_len = p_len.tolist(), r_len.tolist()
    groups: list[list[int]] = []
    p_max = r_max = 0
    for i in order:
        p_new, r_new = max(p_max, p_len[i]), max(r_max, r_len[i])
        if groups and (len(groups[-1]) + 1) * (p_new + r_new) <= max_tokens:
            groups[-1].append(i)
            p_max, r_max = p_new, r_new
        else:
            groups.append([i])
            p_max, r_max = p_len[i], r_len[i]

    def cost(g):
        return len(g) * (max(p_len[i] for i in g) + max(r_len[i] for i in g)) if g else 0

    while len(groups) < min_parts:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.append([])
            continue
        g = max(splittable, key=cost)
        k = groups.index(g)
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


_STATS = ("policy/clipfrac_avg", "policy/approxkl_avg", "loss/policy_avg", "loss/value_avg",
          "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "policy/tis_weight_avg",
          "policy/tis_capped_frac", "policy/kl_to_ref_avg")
#: metric <- the first of these a loss returns: :class:`TokenPPOLoss`'s TRL-style diagnostic, then
#: plain ``ClipPPOLoss``'s own (which averages over every position, pads included)
_DIAGNOSTICS = {"policy/clipfrac_avg": ("pg_clipfrac", "clip_fraction"),
                "policy/approxkl_avg": ("approxkl", "kl_approx"),
                "val/ratio": ("ratio", "mean_ratio"),
                "val/clipfrac_avg": ("vf_clipfrac", "value_clip_fraction"),
                "policy/tis_weight_avg": ("tis_weight",), "policy/tis_capped_frac": ("tis_capped",),
                "policy/kl_to_ref_avg": ("kl_to_ref",)}


def ppo_update(
    rollout: TensorDictBase,
    loss_module,
    optimizer: torch.optim.Optimizer,
    *,
    num_ppo_epochs: int,
    num_mini_batches: int,
    gradient_accumulation_steps: int = 1,
    micro_batch_tokens: int | None = None,
    max_grad_norm: float | None = 1.0,
    scheduler=None,
    replay_buffer=None,
    grad_scaler=None,
    parallel=None,
) -> dict[str, float]:
    """Run the PPO epochs over one rollout and return the averaged diagnostics.

    Each epoch the rollout is served by a TorchRL ``ReplayBuffer`` (``LazyStackStorage`` and
    ``SamplerWithoutReplacement``) in ``num_mini_batches`` shuffled minibatches, one optimiser step
    each (sizes as equal as the row count allows: a filtered batch need not divide evenly). A
    minibatch is split into micro-batches whose gradients add up before the step: either
    ``gradient_accumulation_steps`` equal row slices, or, with ``micro_batch_tokens``, groups of
    rows of similar length holding at most that many padded tokens (:func:`token_budget_split`).
    Each micro-batch is cut to its own prompt and response widths (:func:`trim_padding`). The loss
    of a minibatch is the mean over all its valid tokens, whatever the split: micro-batch ``j``'s
    token-mean is weighted by ``n_j / n`` (its share of the minibatch's valid tokens), so the split
    changes the memory, never the gradient.

    Data parallel (``parallel``, a :class:`~rlhf_torchrl.distributed.DataParallel`): ``rollout`` is
    the global batch on every process (the same minibatches are drawn everywhere); process ``r``
    runs the ``r``-th of ``world_size`` equal slices of each minibatch, its losses go through the
    DDP wrapper (or FSDP2-sharded modules) and the gradients are averaged across processes once
    per minibatch. The result equals the single-process update up to float rounding. (Slices
    differ by at most a row where a minibatch does not divide evenly: the token weights keep the
    gradient exact.)

    ``loss_module``: :func:`make_ppo_loss`'s, or any TorchRL ``ClipPPOLoss`` set up for this
    layout (its own ``clip_fraction``/``kl_approx``/``mean_ratio`` are then reported).

    ``grad_scaler`` (a ``torch.amp.GradScaler``) scales the loss for fp16 autocast.

    Returned metrics, named and defined as in TRL's ``PPOTrainer`` (:class:`TokenPPOLoss`), each
    a mean over a minibatch's valid response tokens, averaged over minibatches:
    ``policy/approxkl_avg``, ``policy/clipfrac_avg``, ``loss/policy_avg``, ``loss/value_avg``,
    ``val/clipfrac_avg``, ``val/ratio`` and ``val/ratio_var`` (the variance of the minibatch
    ratio means), ``policy/entropy_avg`` with an entropy bonus, and ``grad_norm`` (before clipping,
    averaged over optimiser steps).

    A non-finite gradient norm raises :class:`~rlhf_torchrl.guards.NonFiniteError` before the step
    (the gradients are dropped; earlier steps of this update stay applied).
    """
    from .distributed import DataParallel
    from .guards import NonFiniteError
    from .modules.actor_critic import response_attention
    from .optim import clip_grad_norm

    parallel = parallel or DataParallel()
    world, rank = parallel.world_size, parallel.rank
    n = rollout.shape[0]
    if n == 0:
        raise ValueError("ppo_update got a rollout of 0 rows.")
    n_minibatches = min(num_mini_batches, n)
    sizes = [len(part) for part in torch.arange(n).tensor_split(n_minibatches)]
    if replay_buffer is None:
        replay_buffer = make_minibatch_buffer(n, sizes[0])
    replay_buffer.empty()
    replay_buffer.extend(_tensors_only(rollout))
    critic_coeff = getattr(loss_module, "critic_coeff", None)
    vf_coef = 2 * float(critic_coeff) if critic_coeff is not None else 0.0
    steps = num_ppo_epochs * n_minibatches
    device = rollout.get(K.RESPONSE_MASK).device
    # token-weighted sums of each diagnostic per minibatch, summed over processes at the end
    sums = torch.zeros(steps, len(_STATS), dtype=torch.float64, device=device)
    seen = torch.zeros(len(_STATS), dtype=torch.bool)
    grad_norms = torch.zeros(steps, dtype=torch.float64, device=device)
    loss_module.train()
    for step in range(steps):
        size = sizes[step % n_minibatches]
        with warnings.catch_warnings():  # a size other than the buffer's is on purpose here
            warnings.filterwarnings("ignore", "Got conflicting batch_sizes")
            minibatch = replay_buffer.sample(None if size == replay_buffer.batch_size else size)
        minibatch = minibatch.contiguous()  # lazy stack -> dense (size, ...)
        n_tokens = minibatch.get(K.RESPONSE_MASK).sum().clamp_min(1)  # the whole minibatch's
        shares = [size // world + (r < size % world) for r in range(world)]
        start = sum(shares[:rank])
        mine = minibatch[start : start + shares[rank]]  # this process's slice (maybe no rows)
        if micro_batch_tokens:
            masks = mine.get(K.PROMPT_MASK), response_attention(mine)  # every attended token
            parts = token_budget_split(*masks, micro_batch_tokens)
            busiest = parallel.max_int(len(parts))  # every process runs as many micro-batches
            if busiest > len(parts):
                parts = token_budget_split(*masks, micro_batch_tokens, min_parts=busiest)
        else:
            parts = list(torch.arange(len(mine)).tensor_split(gradient_accumulation_steps))
        optimizer.zero_grad(set_to_none=True)
        for j, rows in enumerate(parts):
            weight = world / n_tokens  # DDP/FSDP average over processes: scale back up to a sum
            source = mine
            if rows.numel() == 0:  # keeps the collectives in step; contributes nothing
                rows, weight = torch.zeros(1, dtype=torch.long), 0.0
                source = mine if len(mine) else minibatch
            micro_batch = trim_padding(source[rows.to(source.device)])
            n_micro = micro_batch.get(K.RESPONSE_MASK).sum()
            with parallel.accumulate(last=j == len(parts) - 1):
                out = parallel.loss(loss_module, micro_batch)
                loss = sum(v for k, v in out.items() if k.startswith("loss_"))
                # every loss_* is a token-mean over this micro-batch: weight it by its token share
                loss = loss * n_micro * weight
                (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
            if weight:
                out = out.detach()
                keys = set(out.keys())
                values = {"loss/policy_avg": out["loss_objective"]}
                for name, candidates in _DIAGNOSTICS.items():
                    found = next((k for k in candidates if k in keys), None)
                    if found is not None:
                        values[name] = out[found]
                if vf_coef > 0 and "loss_critic" in keys:
                    values["loss/value_avg"] = out["loss_critic"] / vf_coef
                if "entropy" in keys:
                    # ClipPPOLoss averages the entropy over every position (0 on pads)
                    mask = micro_batch.get(K.RESPONSE_MASK)
                    values["policy/entropy_avg"] = out["entropy"] * mask.numel() / n_micro.clamp_min(1)
                for name, value in values.items():
                    i = _STATS.index(name)
                    sums[step, i] += value.double() * n_micro
                    seen[i] = True
        if grad_scaler is not None:
            grad_scaler.unscale_(optimizer)
        norm = clip_grad_norm(optimizer, max_grad_norm)  # over the groups this step moves
        grad_norms[step] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double()
        # (fp16: the scaler skips steps with inf gradients itself, and lowers its scale)
        if grad_scaler is None and not torch.isfinite(grad_norms[step]):
            optimizer.zero_grad(set_to_none=True)  # nothing non-finite reaches the weights
            last = {name: float(sums[step, i] / n_tokens) for i, name in enumerate(_STATS)
                    if name.startswith("loss/") and seen[i]}
            raise NonFiniteError("gradients", f"norm {float(grad_norms[step])} at optimiser step "
                                 f"{step + 1} of {steps} (this process's losses: "
                                 + ", ".join(f"{k} {v:.4g}" for k, v in last.items()) + ")")
        if grad_scaler is not None:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        sums[step] /= n_tokens
    loss_module.eval()
    per_minibatch = parallel.all_reduce(sums).cpu()  # one collective for the whole update
    metrics = {name: float(per_minibatch[:, i].mean()) for i, name in enumerate(_STATS) if seen[i]}
    if "val/ratio" in metrics:
        ratios = per_minibatch[:, _STATS.index("val/ratio")]
        metrics["val/ratio_var"] = float(ratios.var()) if ratios.numel() > 1 else 0.0
    metrics["grad_norm"] = float(grad_norms.mean())
    return metrics
