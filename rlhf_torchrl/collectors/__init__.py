"""Generation as TorchRL environments and collectors that emit dense rollout TensorDicts.

``base``: the prompt env, the transformers generation policy, :class:`RolloutCollector` and the
rollout layout; ``multiturn``: episodes of several turns with tools; ``partial``: partial rollouts (long
responses paused and continued by newer weights); ``vllm``: the vLLM engine in the model's place; ``weight_sync``: the trainer's
weights to whichever copy samples.
"""

from .base import (
    RolloutCollector,
    ShardedBatchSampler,
    build_rollout,
    decode,
    make_generation_env,
    make_generation_policy,
    probe_rollout,
    sampler_of,
    to_rollout,
)
from .multiturn import MultiTurnCollector
from .partial import PartialRolloutCollector
from .weight_sync import SyncedCollector, WeightSync, engine_weights

__all__ = [
    "MultiTurnCollector", "PartialRolloutCollector", "RolloutCollector", "ShardedBatchSampler", "SyncedCollector", "WeightSync", "build_rollout", "decode",
    "engine_weights", "make_generation_env", "make_generation_policy", "probe_rollout",
    "sampler_of", "to_rollout",
]
