"""The PPO update over one rollout: minibatches, exact micro-batches, critic-only passes.

- :func:`ppo_update`: ``num_ppo_epochs`` passes, each a shuffle into minibatches served by a
  TorchRL replay buffer, with gradient accumulation over equal or token-budget micro-batches that
  keeps the minibatch's average exact (:func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`), gradient-norm clipping, and data
  parallelism; then, with ``critic_epochs``, passes that train the value loss alone
  (:func:`critic_pass_loss`).
- How a minibatch splits into micro-batches: :mod:`rlhf_torchrl.trainers.micro_batches`; the loss it runs:
  :mod:`rlhf_torchrl.objectives.ppo`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from tensordict import TensorDict, TensorDictBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.trainers.micro_batches import micro_batches


def make_minibatch_buffer(batch_size: int, mini_batch_size: int | None = None,
                          seed: int | None = None):
    """TorchRL replay buffer that serves one rollout as shuffled minibatches, without replacement.

    ``LazyStackStorage`` because the padded widths change from one rollout to the next
    (``LazyTensorStorage`` fails then); :func:`ppo_update` empties and refills it every iteration.
    With ``seed`` the shuffle has its own generator: every data-parallel process draws the same
    minibatches, whatever else consumes torch's global random numbers.

    Args:
        batch_size: the rollout's rows (the storage's size).
        mini_batch_size: that of every minibatch :func:`ppo_update` draws (None: as its
            ``num_mini_batches`` gives, which a batch the group filter shrinks needs).
        seed: the shuffle's own generator's seed (None: torch's global generator).
    """
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return ReplayBuffer(storage=LazyStackStorage(batch_size), sampler=SamplerWithoutReplacement(),
                        batch_size=mini_batch_size, generator=generator)


def _tensors_only(td: TensorDictBase) -> TensorDictBase:
    """``td`` without its non-tensor entries (text, conversations, dataset fields)."""
    return td.select(*(k for k, v in td.items(True, True) if isinstance(v, torch.Tensor)))


_STATS = ("policy/clipfrac_avg", "policy/approxkl_avg", "loss/policy_avg", "loss/value_avg",
          "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "policy/tis_weight_avg",
          "policy/tis_capped_frac", "policy/kl_to_ref_avg", "policy/clipfrac_high_avg",
          "policy/clipfrac_low_avg", "policy/dual_clipfrac_avg", "loss/positive_nll_avg",
          "policy/positive_token_frac", "loss/value_critic_passes_avg", "policy/is_masked_frac",
          "policy/cispo_truncated_frac", "policy/cov_selected_frac")
#: metric <- the first of these a loss returns: :class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`'s
#: TRL-style diagnostic, then plain ``ClipPPOLoss``'s own (which averages over every position,
#: pads included)
_DIAGNOSTICS = {"policy/clipfrac_avg": ("pg_clipfrac", "clip_fraction"),
                "policy/approxkl_avg": ("approxkl", "kl_approx"),
                "val/ratio": ("ratio", "mean_ratio"),
                "val/clipfrac_avg": ("vf_clipfrac", "value_clip_fraction"),
                "policy/tis_weight_avg": ("tis_weight",), "policy/tis_capped_frac": ("tis_capped",),
                "policy/is_masked_frac": ("is_masked",),
                "policy/kl_to_ref_avg": ("kl_to_ref",),
                "policy/clipfrac_high_avg": ("pg_clipfrac_high",),
                "policy/clipfrac_low_avg": ("pg_clipfrac_low",),
                "policy/dual_clipfrac_avg": ("pg_clipfrac_dual",),
                "loss/positive_nll_avg": ("positive_nll",),
                "policy/positive_token_frac": ("positive_token_frac",),
                # the registered policy losses' own (objectives.policy_losses)
                "policy/cispo_truncated_frac": ("cispo_truncated_frac",),
                "policy/cov_selected_frac": ("cov_selected_frac",)}
#: the metrics of the critic-only passes (averaged over their optimiser steps; the others over
#: the PPO epochs' steps)
_CRITIC_PASS_STATS = ("loss/value_critic_passes_avg",)


def _record_diagnostics(totals: torch.Tensor, seen: torch.Tensor, out: TensorDictBase,
                        micro_batch: TensorDictBase, token_share: float, loss_share: float,
                        vf_coef: float, critic_pass: bool = False) -> None:
    """Add one micro-batch's metrics to ``totals`` (its minibatch's row of :data:`_STATS`): the
    losses weighted by its share of the minibatch's loss (:func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`), so that they add
    up to the minibatch's loss; the diagnostics, token-means, by its share of the valid tokens. A
    critic-only pass records its value loss alone."""
    out = out.detach()
    keys = set(out.keys())
    if critic_pass:
        values = {"loss/value_critic_passes_avg": out["loss_critic"] / vf_coef} if vf_coef > 0 else {}
    else:
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
            values["policy/entropy_avg"] = out["entropy"] * mask.numel() / mask.sum().clamp_min(1)
    for name, value in values.items():
        i = _STATS.index(name)
        totals[i] += value.double() * (loss_share if name.startswith("loss/") else token_share)
        seen[i] = True


@contextmanager
def _frozen(module):
    """``module``'s parameters held out of autograd (their ``requires_grad`` restored after)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def critic_pass_loss(loss_module, micro_batch: TensorDictBase, parallel=None) -> TensorDictBase:
    """The loss of a critic-only pass (``critic_epochs``): ``loss_critic`` alone, the loss module's
    value term (``vf_coef * 0.5 * max((V - R)^2, (clip(V) - R)^2)``) averaged as its
    ``loss_aggregation`` says (``token_mean`` for a plain ``ClipPPOLoss``).

    One process: the critic's forward alone (``ClipPPOLoss.loss_critic``) with the policy's
    parameters held out of autograd, so no policy forward runs and a shared trunk is read, not
    trained. Under DDP or FSDP2 every process's backward must reach the parameters the others'
    reach, so the whole loss runs (``parallel.loss``) and its other terms count 0;
    :func:`ppo_update` drops the policy's gradients before the step either way, so only the
    critic's own parameters (the value head, a separate critic's trunk) move.

    Args:
        loss_module (torch.nn.Module): the PPO loss, with a critic.
        micro_batch: one micro-batch of the rollout.
        parallel (rlhf_torchrl.distributed.DataParallel | None): this process's place in a torchrun
            job; None: one process.

    Returns a TensorDict with ``"loss_critic"``, and under DDP/FSDP2 the other ``loss_*`` at 0.
    """
    if parallel is not None and parallel.enabled:
        out = parallel.loss(loss_module, micro_batch)
        return TensorDict({k: v if k == "loss_critic" else 0.0 * v for k, v in out.items()
                           if k.startswith("loss_")})
    mask = micro_batch.get(K.RESPONSE_MASK)
    with _frozen(loss_module.actor_network):
        # a shallow copy: the critic writes its new values over the old ones
        per_token, _, _ = loss_module.loss_critic(micro_batch.clone(False))
    value = F.aggregate_loss(per_token.reshape(mask.shape), mask,
                             getattr(loss_module, "loss_aggregation", "token_mean"),
                             getattr(loss_module, "loss_aggregation_constant", None))
    return TensorDict({"loss_critic": value})


def _draw(replay_buffer, size: int) -> TensorDictBase:
    """The next minibatch of ``size`` rows (dense) from the rollout in ``replay_buffer`` (whose
    batch size is ``size`` or None: :func:`~rlhf_torchrl.objectives.loss_inputs.check_replay_buffer`)."""
    minibatch = replay_buffer.sample(None if size == replay_buffer.batch_size else size)
    return minibatch.contiguous()  # lazy stack -> dense (size, ...)


def _optimizer_step(optimizer, *, max_grad_norm, grad_scaler, scheduler, where: str,
                    losses) -> torch.Tensor:
    """Clip, check and take one optimiser step (and the scheduler's, when given); returns the
    gradient norm before clipping. A non-finite norm raises
    :class:`~rlhf_torchrl.trainers.guards.NonFiniteError` naming ``where`` and ``losses()`` (this step's
    losses) before the step, its gradients dropped (fp16: the scaler skips the step itself)."""
    from rlhf_torchrl.trainers.guards import NonFiniteError
    from rlhf_torchrl.trainers.optim import clip_grad_norm

    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    norm = clip_grad_norm(optimizer, max_grad_norm)  # over the groups this step moves
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double()
    if grad_scaler is None and not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)  # nothing non-finite reaches the weights
        raise NonFiniteError("gradients", f"norm {float(norm)} at {where} (this process's losses: "
                             + ", ".join(f"{k} {v:.4g}" for k, v in losses().items()) + ")")
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return norm


@dataclass(frozen=True)
class UpdateSettings:
    """How :func:`ppo_update` passes over one rollout: its epochs, minibatches and micro-batches,
    the gradient clip and the critic-only passes (the arguments of the same names).

    Example:
        >>> settings = UpdateSettings(num_ppo_epochs=2, num_mini_batches=4, micro_batch_tokens=4096)
        >>> stats = ppo_update(rollout, loss_module, optimizer, **settings.kwargs())
    """

    num_ppo_epochs: int = 1
    num_mini_batches: int = 1
    gradient_accumulation_steps: int = 1
    micro_batch_tokens: int | None = None
    max_grad_norm: float | None = 1.0
    critic_epochs: int | None = None

    def kwargs(self) -> dict:
        """The settings as :func:`ppo_update`'s keyword arguments."""
        return asdict(self)


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
    critic_epochs: int | None = None,
    packed: bool | None = None,
) -> dict[str, float]:
    """Run the PPO epochs over one rollout and return the averaged diagnostics.

    Each epoch the rollout is served by a TorchRL ``ReplayBuffer`` (``LazyStackStorage`` and
    ``SamplerWithoutReplacement``) in ``num_mini_batches`` shuffled minibatches, one optimiser step
    each (sizes as equal as the row count allows: a filtered batch need not divide evenly). A
    minibatch is split into micro-batches whose gradients add up before the step: either
    ``gradient_accumulation_steps`` equal row slices, or, with ``micro_batch_tokens``, groups of
    rows of similar length holding at most that many tokens (:func:`~rlhf_torchrl.trainers.micro_batches.token_budget_split`).
    Each micro-batch is cut to its own prompt and response widths (:func:`~rlhf_torchrl.trainers.micro_batches.trim_padding`). The loss
    of a minibatch is the loss module's ``loss_aggregation`` (``token_mean`` for a plain
    ``ClipPPOLoss``) over all its rows, whatever the split: micro-batch ``j``'s loss is weighted by
    its share of the minibatch's aggregation size (``token_mean``: ``n_j / n``, its share of the
    valid tokens; :func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`), so the split changes the memory, never the gradient. A
    loss with a ``prepare_minibatch(minibatch)`` method
    (:class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`: the positive-example NLL's per-response
    weights) sees each whole minibatch before it is split.

    With ``critic_epochs`` above ``num_ppo_epochs``, the passes after the PPO epochs train the
    value loss alone (:func:`critic_pass_loss`; several critic updates per policy update, slime's
    request): the policy's gradients are dropped before each of their steps, so only the value
    head and a separate critic's trunk move, and the learning-rate ``scheduler`` does not advance
    (its steps are the PPO epochs'). They draw new shuffles of the same rollout: no data from
    another iteration is kept.

    Data parallel: ``rollout`` is the global batch on every process (the same minibatches are
    drawn everywhere); process ``r`` runs the ``r``-th of ``world_size`` equal slices of each
    minibatch (``parallel.balance``: the ``r``-th of sets of rows of near-equal real tokens), its
    losses go through the DDP wrapper (or FSDP2-sharded modules) and the gradients are averaged
    across processes once per minibatch. The result equals the single-process update up to float
    rounding. (Slices differ by at most a row where a minibatch does not divide evenly, balanced
    sets by more: the token weights keep the gradient exact.) A missing entry is refused first.

    Args:
        rollout: the scored rollout with its advantages (and value targets, with a critic).
        loss_module (torch.nn.Module): :func:`~rlhf_torchrl.objectives.ppo.make_ppo_loss`'s, or any
            TorchRL ``ClipPPOLoss``, given the rollout's keys and mask or refused
            (:func:`~rlhf_torchrl.objectives.loss_inputs.use_rollout_keys`; its own diagnostics are then
            reported).
        optimizer: steps the policy and the critic.
        num_ppo_epochs: passes over the rollout.
        num_mini_batches: minibatches per epoch, one optimiser step each.
        gradient_accumulation_steps: equal row slices per minibatch (and process).
        micro_batch_tokens: instead, micro-batches of at most this many tokens (None: off).
        max_grad_norm: gradient-norm clip (None: none).
        scheduler (torch.optim.lr_scheduler.LRScheduler | None): stepped after each PPO optimiser
            step.
        replay_buffer (torchrl.data.ReplayBuffer | None): the minibatch sampler, kept as given or
            refused (:func:`~rlhf_torchrl.objectives.loss_inputs.check_replay_buffer`); None: one per call.
        grad_scaler (torch.amp.GradScaler | None): scales the loss for fp16 autocast.
        parallel (rlhf_torchrl.distributed.DataParallel | None): this process's place in a
            torchrun job; None: one process.
        critic_epochs: passes over the rollout that train the critic (None: ``num_ppo_epochs``).
        packed: ``micro_batch_tokens`` counts real tokens, not padded ones (None: as the actor
            runs, packed with ``packing=True``).

    Returned metrics, named and defined as in TRL's ``PPOTrainer``
    (:class:`~rlhf_torchrl.objectives.ppo.TokenPPOLoss`), each a mean over a minibatch's valid
    response tokens, averaged over the PPO epochs' minibatches: ``policy/approxkl_avg``,
    ``policy/clipfrac_avg``, ``loss/policy_avg``, ``loss/value_avg``, ``val/clipfrac_avg``,
    ``val/ratio`` and ``val/ratio_var`` (the variance of the minibatch ratio means),
    ``policy/entropy_avg`` with an entropy bonus, and ``grad_norm`` (before clipping, averaged
    over the PPO epochs' optimiser steps); ``policy/clipfrac_high_avg`` /
    ``policy/clipfrac_low_avg`` (where the upper / lower clip binds) and
    ``policy/dual_clipfrac_avg`` (with a dual clip); ``loss/positive_nll_avg`` and
    ``policy/positive_token_frac`` (with a positive-example NLL term);
    ``loss/value_critic_passes_avg`` (the critic-only passes' value loss). The ``loss/*`` values
    are aggregated as the loss is; the rest are token-means.

    A non-finite gradient norm raises :class:`~rlhf_torchrl.trainers.guards.NonFiniteError` before the step
    (the gradients are dropped; earlier steps of this update stay applied).
    """
    from rlhf_torchrl.distributed import DataParallel

    parallel = parallel or DataParallel()
    critic_epochs = _check_update(rollout, loss_module, num_ppo_epochs, critic_epochs)
    n_minibatches = min(num_mini_batches, rollout.shape[0])
    sizes = [len(part) for part in torch.arange(rollout.shape[0]).tensor_split(n_minibatches)]
    replay_buffer = _serve(rollout, replay_buffer, sizes)
    split = _split_settings(loss_module, parallel, gradient_accumulation_steps, micro_batch_tokens,
                            packed)
    prepare = getattr(loss_module, "prepare_minibatch", None) or (lambda minibatch: minibatch)
    policy_params = list(loss_module.actor_network.parameters()) if critic_epochs > num_ppo_epochs else []
    ppo_steps, steps = num_ppo_epochs * n_minibatches, critic_epochs * n_minibatches
    device = rollout.get(K.RESPONSE_MASK).device
    # each metric per minibatch, this process's share of it, summed over processes at the end
    sums = torch.zeros(steps, len(_STATS), dtype=torch.float64, device=device)
    seen = torch.zeros(len(_STATS), dtype=torch.bool)
    grad_norms = torch.zeros(steps, dtype=torch.float64, device=device)
    loss_module.train()
    for step in range(steps):
        critic_pass = step >= ppo_steps  # after the PPO epochs: the value loss alone
        minibatch = prepare(_draw(replay_buffer, sizes[step % n_minibatches]))
        optimizer.zero_grad(set_to_none=True)
        _accumulate_gradients(loss_module, minibatch, split, parallel, grad_scaler, critic_pass,
                              sums[step], seen)
        for p in policy_params if critic_pass else ():
            p.grad = None  # the critic's own parameters alone move (a shared trunk stays)
        grad_norms[step] = _optimizer_step(
            optimizer, max_grad_norm=max_grad_norm, grad_scaler=grad_scaler,
            scheduler=None if critic_pass else scheduler, losses=lambda row=sums[step]: {
                name: float(row[i]) for i, name in enumerate(_STATS)
                if name.startswith("loss/") and seen[i]},
            where=f"optimiser step {step + 1} of {steps}" + (" (a critic-only pass)" if critic_pass else ""))
    loss_module.eval()
    return _update_metrics(parallel.all_reduce(sums).cpu(), seen, grad_norms[:ppo_steps], ppo_steps)


def _check_update(rollout: TensorDictBase, loss_module, num_ppo_epochs: int,
                  critic_epochs: int | None) -> int:
    """Refuse what :func:`ppo_update` cannot run (a missing entry, no rows, too few critic
    epochs, critic passes without a critic); returns the critic epochs."""
    from rlhf_torchrl.objectives.loss_inputs import loss_input_keys, use_rollout_keys

    use_rollout_keys(loss_module)  # a plain ClipPPOLoss: the layout's keys and mask, or refused
    K.require(rollout, *loss_input_keys(loss_module), what="ppo_update")
    if rollout.shape[0] == 0:
        raise ValueError("ppo_update got a rollout of 0 rows.")
    critic_epochs = num_ppo_epochs if critic_epochs is None else critic_epochs
    if critic_epochs < num_ppo_epochs:
        raise ConfigError(f"critic_epochs={critic_epochs}: the critic trains in each of the "
                          f"num_ppo_epochs={num_ppo_epochs} PPO epochs already; give at least that.")
    if critic_epochs > num_ppo_epochs and getattr(loss_module, "critic_network", None) is None:
        raise ConfigError(f"critic_epochs={critic_epochs} > num_ppo_epochs={num_ppo_epochs} adds "
                          "critic-only passes, and this loss has no critic (a critic-free estimator).")
    return critic_epochs


def _serve(rollout: TensorDictBase, replay_buffer, sizes: list[int]):
    """The minibatch sampler, holding this rollout alone: ``replay_buffer`` (kept as given, or
    refused: its sampler, its rows, its minibatch size) or a new one."""
    from rlhf_torchrl.objectives.loss_inputs import check_replay_buffer

    if replay_buffer is None:
        replay_buffer = make_minibatch_buffer(rollout.shape[0])
    else:
        check_replay_buffer(replay_buffer, rows=rollout.shape[0], sizes=sizes)
    replay_buffer.empty()  # this rollout alone: nothing piles up across iterations
    replay_buffer.extend(_tensors_only(rollout))
    return replay_buffer


def _split_settings(loss_module, parallel, gradient_accumulation_steps: int,
                    micro_batch_tokens: int | None, packed: bool | None) -> dict:
    """:func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`' settings for this loss and process."""
    packed = getattr(loss_module.actor_network, "packing", False) is True if packed is None else packed
    # balance="auto": where micro-batches count real tokens, or where a process's padded rows are
    # several micro-batches (longest first, each pads less): where it measured faster
    # (benchmarks/README.md, balance)
    balance = parallel.balance is True or (parallel.balance == "auto" and bool(
        packed or micro_batch_tokens or gradient_accumulation_steps > 1))
    return dict(rank=parallel.rank, world_size=parallel.world_size, balance=balance,
                gradient_accumulation_steps=gradient_accumulation_steps,
                micro_batch_tokens=micro_batch_tokens, max_parts=parallel.max_int, packed=packed,
                loss_aggregation=getattr(loss_module, "loss_aggregation", "token_mean"),
                loss_aggregation_constant=getattr(loss_module, "loss_aggregation_constant", None))


def _accumulate_gradients(loss_module, minibatch: TensorDictBase, split: dict, parallel,
                          grad_scaler, critic_pass: bool, totals: torch.Tensor,
                          seen: torch.Tensor) -> None:
    """One minibatch's gradients, summed over this process's micro-batches (each loss weighted by
    its share of the minibatch's, :func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`), its metrics
    added to ``totals`` (:func:`_record_diagnostics`)."""
    critic_coeff = getattr(loss_module, "critic_coeff", None)
    vf_coef = 2 * float(critic_coeff) if critic_coeff is not None else 0.0
    n_tokens = int(minibatch.get(K.RESPONSE_MASK).sum().clamp_min(1))  # the whole minibatch's
    parts = micro_batches(minibatch, **split)
    for j, (micro_batch, weight) in enumerate(parts):
        with parallel.accumulate(last=j == len(parts) - 1):
            out = (critic_pass_loss(loss_module, micro_batch, parallel) if critic_pass
                   else parallel.loss(loss_module, micro_batch))
            # every loss_* is aggregated over this micro-batch: weight it by its share of the
            # minibatch's loss; DDP/FSDP average over processes: scale back up to a sum
            loss = sum(v for k, v in out.items() if k.startswith("loss_")) * (weight * split["world_size"])
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        if weight:
            n_micro = int(micro_batch.get(K.RESPONSE_MASK).sum())
            _record_diagnostics(totals, seen, out, micro_batch, n_micro / n_tokens, weight, vf_coef,
                                critic_pass)


def _update_metrics(per_minibatch: torch.Tensor, seen: torch.Tensor, grad_norms: torch.Tensor,
                    ppo_steps: int) -> dict[str, float]:
    """The update's metrics from each optimiser step's row of :data:`_STATS` (summed over
    processes): each averaged over the PPO epochs' steps, the critic passes' over theirs."""
    metrics = {}
    for i, name in enumerate(_STATS):
        if seen[i]:
            rows = per_minibatch[ppo_steps:] if name in _CRITIC_PASS_STATS else per_minibatch[:ppo_steps]
            metrics[name] = float(rows[:, i].mean())
    if "val/ratio" in metrics:
        ratios = per_minibatch[:ppo_steps, _STATS.index("val/ratio")]
        metrics["val/ratio_var"] = float(ratios.var()) if ratios.numel() > 1 else 0.0
    metrics["grad_norm"] = float(grad_norms.mean())
    return metrics
