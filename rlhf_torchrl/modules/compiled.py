"""A compiled training forward: the decoder layers under ``torch.compile``, for the actor and
critic alone.

Regional compilation (PyTorch's recipe for transformers): each decoder layer's ``forward`` is
compiled once per layer class, with dynamic shapes, and every layer of the model (and of any
copy of it) reuses that graph, so compiling takes one layer's time, not the model's. The
compiled forward runs only inside :func:`compiled_region`, which
:class:`~rlhf_torchrl.modules.TokenLevelActor` and :class:`~rlhf_torchrl.modules.TokenCritic`
enter around their model calls (the old quantities, the reference, the update's forward and,
through autograd, its backward); ``generate`` and anything else calling the model runs it
eagerly, so a KV cache never reaches a compiled graph.

Shapes change from batch to batch (the rows, their widths, a packed row's length): with
``dynamic=True`` the batch and sequence dimensions are symbolic from the first call, so a new
length does not recompile. What does give another graph, once each: grad mode (the no-grad old
quantities against the update), an attention mask or none (a batch without padding), and a
dimension of size 1 (torch specialises 0 and 1).

Example:
    >>> compile_layers(policy)              # nothing compiles yet
    >>> with compiled_region():
    ...     logits = policy(input_ids).logits  # compiles the layer on the first call
"""

from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

_ACTIVE = contextvars.ContextVar("rlhf_torchrl_compiled_region", default=False)
#: a layer class's forward -> its compiled version, shared by every layer of that class
_COMPILED: dict = {}


@contextmanager
def compiled_region():
    """Compiled layers run compiled inside this block (eagerly everywhere else)."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (its ``_no_split_modules``: FSDP's units).

    Args:
        model: a transformers model.
    """
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _forward(layer: nn.Module, eager, compiled, *args, **kwargs):
    if not _ACTIVE.get():
        return eager(layer, *args, **kwargs)
    # no duck shaping: a batch of 8 rows would otherwise share its symbol with a head_dim of 8
    # (equal sizes seen at the first call) and be specialised to 8 by the rotary broadcast
    with fx_config.patch(use_duck_shape=False):
        return compiled(layer, *args, **kwargs)


def compile_layers(model: nn.Module, *, dynamic: bool = True) -> int:
    """Give each decoder layer of ``model`` a compiled forward for :func:`compiled_region`;
    returns the number of layers (0: none found, nothing changed). Idempotent. The weights,
    ``state_dict`` and a deepcopy of the model are unaffected (the forward is an instance
    attribute holding the layer, which a copy maps to its own).

    Args:
        model: the model whose layers get compiled forwards.
        dynamic: compile for dynamic shapes (no recompile per batch width).
    """
    layers = decoder_layers(model)
    for layer in layers:
        if isinstance(layer.__dict__.get("forward"), functools.partial):
            continue  # compiled already
        eager = type(layer).forward
        if eager not in _COMPILED:
            _COMPILED[eager] = torch.compile(eager, dynamic=dynamic)
        layer.forward = functools.partial(_forward, layer, eager, _COMPILED[eager])
    return len(layers)
