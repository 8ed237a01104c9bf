"""The correction for tokens another policy sampled: each token's weight from the log-ratio of
the trainer's and the sampler's probabilities (TIS, MIS, IcePop, sequence-masked TIS)."""

from __future__ import annotations

import math

import torch

from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.masks import masked_mean

#: ``ppo.off_policy_correction``'s choices
OFF_POLICY_CORRECTIONS = ("tis", "mis", "icepop", "seq_mask_tis")


def check_off_policy_correction(mode: str, cap: float | None, low: float | None = None) -> str:
    """Return ``mode`` if it is one of :data:`OFF_POLICY_CORRECTIONS` and its bounds make a window,
    else raise naming the options or the bound to fix.

    Args:
        mode: the name to check.
        cap: the upper bound ``C`` on the importance weight.
        low: the lower bound ``c`` (None: the mode's default, see :func:`off_policy_log_weight`).
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ConfigError(
            f"Unknown off-policy correction {mode!r}: choose one of {OFF_POLICY_CORRECTIONS} (tis: "
            "truncate the ratio at the cap; mis: mask tokens whose ratio passes it; icepop: mask "
            "tokens whose ratio leaves [low, cap]; seq_mask_tis: mask responses whose geometric-mean "
            "ratio leaves [low, cap])."
        )
    if cap is None or not cap > 0:
        raise ConfigError(f"The off-policy correction {mode} needs its upper bound (tis_cap) > 0, "
                          f"got {cap}.")
    lower = low if low is not None else (1.0 / cap if mode in ("icepop", "seq_mask_tis") else None)
    if lower is not None and not 0 < lower < cap:
        given = f"low={low}" if low is not None else f"low = 1 / cap = {lower:g}"
        raise ConfigError(f"The off-policy correction {mode} keeps ratios in [low, cap]: {given} "
                          f"with cap={cap} leaves no room; give cap > 1, or 0 < low < cap.")
    return mode


def off_policy_log_weight(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str = "tis", *,
                          cap: float, low: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The log of each token's importance weight on the PPO surrogate, for tokens another policy
    sampled (older weights, other kernels), and which tokens it keeps.

    With ``delta_t = log pi_old(y_t) - log pi_sampler(y_t)``, ``rho_t = exp(delta_t)``, ``C = cap``
    and ``c = low``:

    - ``tis``: ``w_t = min(rho_t, C)``, also ``max(., c)`` when ``low`` is given. Truncated IS
      (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
      verl ``rollout_is=token``; OpenRLHF, NeMo-RL and slime ``tis``, whose ``[min, max]`` clamp
      ``low`` gives). Keeps every token.
    - ``mis``: ``w_t = rho_t [rho_t <= C]`` (and ``[rho_t >= c]`` when ``low`` is given): token-level
      masked IS, a token past the bound drops out rather than counting ``C`` (Liu, Li et al. 2025,
      "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch":
      rejection over truncation; verl ``rollout_rs=token_k1``, slime ``mis.py``'s mask mode).
    - ``icepop``: ``w_t = rho_t [c <= rho_t <= C]`` with ``c = 1 / C`` unless given: tokens on which
      the two policies disagree either way drop out (Ling Team 2025, "Every Step Evolves: Scaling
      Reinforcement Learning for Trillion-Scale Thinking Model", arXiv 2510.18855, IcePop, with
      [0.5, 5]; OpenRLHF, NeMo-RL and slime ``icepop``).
    - ``seq_mask_tis``: ``g_i = exp(mean_t delta_it)`` over response ``i``'s valid tokens (its
      geometric-mean ratio), ``w_it = rho_it [c <= g_i <= C]`` with ``c = 1 / C`` unless given: whole
      responses drop out, the kept ones' token ratios are not truncated (NeMo-RL's and OpenRLHF's
      ``seq-mask-tis``, NeMo-RL's bounds [0.999, 1.002]; verl's Geo-RS with token IS).

    A dropped token's log weight is ``-inf`` (weight 0, no gradient). It stays in the loss's
    denominator (IcePop's ``1 / |o_i|``, OpenRLHF's and NeMo-RL's weight 0; verl and slime's
    ``mis.py`` take it out of the loss mask instead), so :func:`aggregate_loss` and its exactness
    over micro-batches hold as they are. ``tis`` is ``delta.clamp_max(log C)``, bit for bit.

    Args:
        log_ratio: ``delta_t``, the old policy's log-probs minus the sampler's.
        mask: the valid response tokens.
        mode: one of :data:`OFF_POLICY_CORRECTIONS`, as above.
        cap: ``C``, the upper bound on the weight.
        low: ``c``, the lower bound (None: none for ``tis`` and ``mis``, ``1 / C`` for the others).

    Shapes: ``log_ratio``, ``mask`` (B, R). Returns the log weights (B, R) and the kept tokens
    (B, R) bool (padding counts as kept).

    Example:
        >>> log_ratio, mask = torch.tensor([[3.0, 1.5, 0.25]]).log(), torch.ones(1, 3, dtype=torch.bool)
        >>> [off_policy_log_weight(log_ratio, mask, m, cap=2.0)[0].exp().round(decimals=2).tolist()
        ...  for m in OFF_POLICY_CORRECTIONS]
        [[[2.0, 1.5, 0.25]], [[0.0, 1.5, 0.25]], [[0.0, 1.5, 0.0]], [[3.0, 1.5, 0.25]]]
    """
    check_off_policy_correction(mode, cap, low)
    high, mask = math.log(cap), mask.bool()
    # pads get weight 1 (log 0) whatever they hold: a non-finite pad would give the masked
    # surrogate a NaN gradient (0 * exp(nan))
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if mode == "tis":
        log_weight = log_ratio.clamp_max(high)
        if low is not None:
            log_weight = log_weight.clamp_min(math.log(low))
        return log_weight, torch.ones_like(log_ratio, dtype=torch.bool)
    if mode == "mis":
        keep = log_ratio <= high
        if low is not None:
            keep = keep & (log_ratio >= math.log(low))
    else:
        lower = math.log(low) if low is not None else -high
        statistic = log_ratio if mode == "icepop" else masked_mean(  # (B, 1): g_i's log
            log_ratio, mask, dim=-1).unsqueeze(-1)
        keep = ((statistic >= lower) & (statistic <= high)).expand_as(log_ratio)
    keep = keep | ~mask
    return torch.where(keep, log_ratio, torch.full_like(log_ratio, -math.inf)), keep
