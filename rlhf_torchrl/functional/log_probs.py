"""Log-probs and entropies of tokens from logits, in fp32 and at a temperature."""

from __future__ import annotations

import torch

from rlhf_torchrl.errors import ConfigError


def log_probs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of the chosen tokens under ``softmax(logits / temperature)``, in fp32.

    ``log p(y_t) = z_t[y_t] - logsumexp(z_t)`` with ``z = logits / temperature``, without a
    log-softmax, and with a hand-written backward: ``d log p(y_t) / d logits_t = (onehot(y_t) -
    softmax(z_t)) / temperature``. Autograd through ``logits / T``, ``logsumexp`` and ``gather``
    allocates about five (B, R, V) tensors between forward and backward; this keeps one from the
    forward (``exp(z - max z)``) and allocates one in the backward, the gradient. The update phase
    is dominated by such vocabulary-sized passes on small models (``rlhf-torchrl bench
    ppo_iteration``).

    Args:
        logits: the model's logits at the positions that predict ``tokens``.
        tokens: the chosen token ids ``y_t``.
        temperature: the sampling temperature ``T`` the logits are divided by.

    Shapes: ``logits`` (B, R, V) any float dtype, ``tokens`` (B, R). Returns (B, R) float32
    (float64 for float64 logits).
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}.")
    return _TokenLogProb.apply(logits, tokens, float(temperature))


class _TokenLogProb(torch.autograd.Function):
    """Forward keeps ``exp(z - max z)`` (one vocabulary-sized buffer, instead of the logits);
    backward scales it into the gradient and adds the chosen-token term."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        work = logits if logits.dtype == torch.float64 else logits.float()
        shift = work.amax(-1, keepdim=True)
        weights = torch.sub(work, shift).mul_(1.0 / temperature).exp_()  # exp(z - max z)
        norm = weights.sum(-1, keepdim=True)
        chosen = (work.gather(-1, tokens.unsqueeze(-1)) - shift) / temperature
        ctx.save_for_backward(weights, tokens, norm)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return (chosen - norm.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        weights, tokens, norm = ctx.saved_tensors
        scale = (grad / ctx.temperature).unsqueeze(-1)
        # -softmax(z) * g / T everywhere, + g / T at the chosen token
        out = torch.mul(weights, -scale / norm).scatter_add_(-1, tokens.unsqueeze(-1), scale)
        return out.to(ctx.dtype), None, None


def entropy_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``, in fp32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    Args:
        logits: the unnormalised log-probabilities ``z``.
        logsumexp: ``logsumexp(z)`` over the last dim, if already computed (None: computed here).

    Shapes: (..., V) -> (...).
    """
    logits = logits.float()
    if logsumexp is None:
        logsumexp = torch.logsumexp(logits, dim=-1)
    return logsumexp - (torch.softmax(logits, -1) * logits).sum(-1)
