"""An fp32 linear layer from bf16 matrix products: the LM head's fast path on a GPU.

The logits PPO's ratio reads are computed in fp32 (:func:`~rlhf_torchrl.modules.models.lm_head_in_fp32`).
On a GPU an fp32 matmul runs on the CUDA cores, about a sixteenth of the bf16 tensor cores' rate
(an H200: 50 against 780 TFLOP/s): with Qwen2.5's 151,936-token vocabulary the head is then about
a quarter of the update's seconds at 0.5B, by the plan's count (docs/scaling.md). Split each fp32 operand into two bf16 parts, ``x = hi + lo`` (``hi``
the rounding of ``x``, ``lo`` the rounding of what is left): the three products that matter,
``hi_x hi_w + hi_x lo_w + lo_x hi_w``, are one bf16 matmul over a three-times-longer inner
dimension, accumulated and returned in fp32. Each operand keeps 16 of fp32's 24 mantissa bits
and the dropped ``lo_x lo_w`` is as small again: a logit's error is about ``2**-16`` of the
products it sums, against ``2**-8`` for a bf16 head (logits rounded to steps of 0.0625 at 10)
and ``2**-24`` for fp32. The trick is known as ``bfloat16_3x`` (PyTorch's documentation of
``set_float32_matmul_precision("high")`` names it; on CUDA "high" means TF32 instead); here it
is explicit, so nothing else in the process changes precision (a global TF32 switch would also
round the rotary embedding's fp32 angle product, which needs every bit).

The backward is a plain bf16 one, as autocast's: the gradient's precision is not what PPO's ratio
reads. The products need a matmul that takes bf16 and returns fp32 (``torch.mm(...,
out_dtype=torch.float32)``, CUDA); where there is none (a CPU) :func:`split_bf16_linear` falls
back to the fp32 product, exactly as before, and so it does for a decoding step's few rows,
where splitting the weight would cost more than the fp32 product saves.
"""

from __future__ import annotations

import functools

import torch

#: the settings of ``model.lm_head_matmul``: ``fp32`` (the head's product in fp32) or
#: ``bf16x3`` (three bf16 products, fp32 accumulation: the GPU's fast path)
LM_HEAD_MATMULS = ("fp32", "bf16x3")


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` in bf16 with ``hi + lo`` equal to ``x`` (taken as fp32) to about 16 mantissa
    bits; ``lo`` is zero where ``x`` is bf16 already."""
    hi = x.to(torch.bfloat16)
    return hi, (x.float() - hi.float()).to(torch.bfloat16)


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16 matrices, accumulated and returned in fp32 (CUDA's ``mm.dtype``)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def has_fp32_out_mm(device: torch.device) -> bool:
    """Whether ``device`` has a bf16 x bf16 -> fp32 matmul on bf16 tensor cores: CUDA's, on a GPU
    of compute capability 8.0 or more (tried once per device)."""
    return _has_fp32_out_mm(str(device))


@functools.cache
def _has_fp32_out_mm(device: str) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        return mm_fp32_out(one, one).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False

#: fewer rows than this (a decoding step, a prefill's last positions) take the fp32 product:
#: splitting the weight costs about as much memory traffic as the fp32 product of ~300 rows
SPLIT_MIN_ROWS = 1024
#: rows split at a time while the operands are built (bounds the fp32 temporaries)
_CHUNK_ROWS = 8192


def _parts(m: torch.Tensor, slots: tuple[str, ...]) -> torch.Tensor:
    """``(n, k)`` -> bf16 ``(n, len(slots) k)``: for each slot ``"hi"`` or ``"lo"`` that part of
    ``m`` (:func:`split_bf16`), built in row chunks so that no fp32 copy of the whole is made."""
    n, k = m.shape
    out = torch.empty(n, len(slots) * k, dtype=torch.bfloat16, device=m.device)
    for start in range(0, n, _CHUNK_ROWS):
        rows = slice(start, start + _CHUNK_ROWS)
        parts = dict(zip(("hi", "lo"), split_bf16(m[rows]), strict=True))
        for i, slot in enumerate(slots):
            out[rows, i * k:(i + 1) * k] = parts[slot]
    return out


class _SplitBF16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mm):
        ctx.save_for_backward(x, weight)  # as given: a bf16 weight is kept in bf16
        ctx.mm = mm
        # hi_x hi_w + hi_x lo_w + lo_x hi_w as one product over a longer inner dimension; an
        # operand in bf16 already has no lo part, and its products are left out
        pairs = [("hi", "hi")]
        if weight.dtype != torch.bfloat16:
            pairs.append(("hi", "lo"))
        if x.dtype != torch.bfloat16:
            pairs.append(("lo", "hi"))
        rows = x.reshape(-1, x.shape[-1])
        out = mm(_parts(rows, tuple(a for a, _ in pairs)),
                 _parts(weight, tuple(b for _, b in pairs)).T)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.mm(g, weight.to(torch.bfloat16)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            grad_w = ctx.mm(g.T, rows).to(weight.dtype)
        return grad_x, grad_w, None


def split_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      mm=None) -> torch.Tensor:
    """``x @ weight.T + bias`` in fp32 from three bf16 products: each operand split as
    ``hi + lo`` in bf16, ``hi_x hi_w + hi_x lo_w + lo_x hi_w`` as one bf16 matmul over a
    three-times-longer inner dimension with fp32 accumulation (about 16 mantissa bits; a bf16
    product has 8); the backward in bf16 with fp32 results. The LM head's fast path on a GPU
    (``model.lm_head_matmul=bf16x3``).

    Without a bf16 -> fp32 matmul on the tensors' device (a CPU), and for fewer than 1,024 rows
    (``SPLIT_MIN_ROWS``; a decoding step, where the fp32 product costs less than splitting the
    weight), it is ``torch.nn.functional.linear`` in fp32.

    Args:
        x: ``(..., in)`` activations (any float dtype: taken as fp32).
        weight: ``(out, in)``.
        bias: ``(out,)`` or None, added in fp32.
        mm: the bf16 x bf16 -> fp32 matmul (None: ``torch.mm(a, b, out_dtype=torch.float32)``
            where the device has it); tests pass an emulation to check the arithmetic on a CPU.
    """
    if mm is None:
        if x.numel() < SPLIT_MIN_ROWS * x.shape[-1] or not has_fp32_out_mm(x.device):
            return torch.nn.functional.linear(x.float(), weight.float(),
                                              None if bias is None else bias.float())
        mm = mm_fp32_out
    out = _SplitBF16Linear.apply(x, weight, mm)
    return out if bias is None else out.add_(bias.float())
