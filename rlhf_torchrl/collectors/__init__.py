"""Generation as TorchRL environments and collectors that emit dense rollout TensorDicts.

``env``: the prompt environment; ``generation``: the transformers generation policy; ``base``:
:class:`RolloutCollector`, one response per prompt; ``multiturn``: episodes of several turns with
tools; ``partial``: partial rollouts (long responses paused and continued by newer weights);
``vllm``: the vLLM engine in the model's place; ``weight_sync``: the trainer's weights to whichever
copy samples; ``asynchronous`` and ``ray``: sampling beside the trainer; ``factory``: the settings
to one of them. The rollouts' layout is :mod:`rlhf_torchrl.rollout`'s.
"""

from .base import RolloutCollector
from .env import ShardedBatchSampler, make_generation_env
from .generation import make_generation_policy, sampler_of
from .multiturn import MultiTurnCollector
from .partial import PartialRolloutCollector
from .weight_sync import SyncedCollector, WeightSync, engine_weights

__all__ = [
    "MultiTurnCollector", "PartialRolloutCollector", "RolloutCollector", "ShardedBatchSampler",
    "SyncedCollector", "WeightSync", "engine_weights", "make_generation_env",
    "make_generation_policy", "sampler_of",
]
