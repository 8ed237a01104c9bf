"""Weight sync: after every update the sampler's copy of the policy gets the trainer's weights.

The transformers backend samples with the trained model itself and needs no sync; a vLLM engine
(:class:`~rlhf_torchrl.collectors.backends.vllm.VLLMGenerator`), a generation copy of the model
(asynchronous collection) or remote workers (Ray) hold their own weights. Each of them has
``load_weights(pairs)``; :class:`WeightSync` feeds it :func:`engine_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import nn


def engine_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under Hugging Face parameter names, as an inference engine loads them.

    A PEFT model's LoRA layers are merged on the fly (``W + B A * scale``; the live model keeps its
    adapters unmerged) and the adapter tensors are left out; FSDP2 shards are gathered (a
    collective: every process must iterate). Tied weights appear under both names.

    Args:
        model: the trained model (plain, PEFT or FSDP2-sharded).
    """
    from rlhf_torchrl.modules.lora import hf_model

    hf = hf_model(model)
    lora_type = _lora_layer_type()
    lora_layers = {name: m for name, m in hf.named_modules()
                   if lora_type is not None and isinstance(m, lora_type)}
    for name, tensor in hf.state_dict().items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            owner = owner.removesuffix(".base_layer")
            layer = lora_layers.get(owner)
            if layer is not None and leaf == "weight" and not layer.merged:
                with torch.no_grad():
                    tensor = tensor + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            name = f"{owner}.{leaf}"
        if hasattr(tensor, "full_tensor"):  # a DTensor shard (FSDP2)
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def _lora_layer_type():
    """PEFT's LoRA layer class, or None without PEFT (then no model has LoRA layers)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return None
    return LoraLayer


class WeightSync:
    """Push ``model``'s weights to ``target`` (anything with ``load_weights(pairs)``).

    ``sync(version)`` pushes; ``version`` (updates the weights have had, 0: the initial ones) is
    the caller's count, taken for the recipe's and
    :class:`~rlhf_torchrl.collectors.asynchronous.AsyncCollector`'s common signature. Returns the
    seconds the push took.

    Args:
        model: the trained model (:func:`engine_weights` reads it).
        target (object): the sampler's copy: a vLLM generator, a
            :class:`~rlhf_torchrl.collectors.asynchronous.ModelCopy`, a Ray
            collector.
    """

    def __init__(self, model: nn.Module, target):
        self.model, self.target = model, target

    def __call__(self, version: int) -> float:
        start = time.perf_counter()
        self.target.load_weights(engine_weights(self.model))
        return time.perf_counter() - start


class SyncedCollector:
    """A collector whose sampler holds weights of its own (a vLLM engine, Ray workers):
    ``update_weights(version)`` pushes the trainer's through ``weight_sync`` between batches (the
    call :class:`~rlhf_torchrl.collectors.asynchronous.AsyncCollector` has too), so the trainer's
    weight-push hook treats both alike.

    Args:
        collector (Iterable): the collector whose sampler holds its own weights.
        weight_sync: pushes the trainer's weights to that sampler.
    """

    def __init__(self, collector, weight_sync: WeightSync):
        self.collector, self.weight_sync = collector, weight_sync

    @property
    def sampler(self):
        return self.collector.sampler

    def __iter__(self):
        return iter(self.collector)

    def update_weights(self, version: int) -> float:
        return self.weight_sync(version)

    def pending(self) -> list:
        """The inner collector's state a checkpoint keeps (partial rollouts' paused responses)."""
        pending = getattr(self.collector, "pending", None)
        return pending() if pending is not None else []

    def shutdown(self) -> None:
        self.collector.shutdown()
