"""Weight sync: after every update the sampler's copy of the policy gets the trainer's weights.

The transformers backend samples with the trained model itself and needs no sync; a vLLM engine
(:class:`~rlhf_torchrl.collectors.vllm.VLLMGenerator`), a generation copy of the model
(asynchronous collection) or remote workers (Ray) hold their own weights. Each of them has
``load_weights(pairs)``; :class:`WeightSync` feeds it :func:`engine_weights` and counts versions.
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
    """
    from ..modules.lora import hf_model

    hf = hf_model(model)
    lora_layers = {name: m for name, m in hf.named_modules() if _is_lora_layer(m)}
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


def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return isinstance(module, LoraLayer)


class WeightSync:
    """Push ``model``'s weights to ``target`` (anything with ``load_weights(pairs)``).

    ``sync(version)`` pushes and records ``version``, the number of updates the pushed weights
    have had (0: the initial weights); returns the seconds the push took.
    """

    def __init__(self, model: nn.Module, target):
        self.model, self.target = model, target
        self.version: int | None = None  # nothing pushed yet

    def __call__(self, version: int) -> float:
        start = time.perf_counter()
        self.target.load_weights(engine_weights(self.model))
        self.version = version
        return time.perf_counter() - start
