"""Generation as TorchRL environments and collectors that emit dense rollout TensorDicts.

``base``: :class:`RolloutCollector`, one response per prompt, over the prompt environment
(:mod:`rlhf_torchrl.envs.prompt_env`); ``backends``: what samples (``transformers``: the
generation policy; ``vllm``: the vLLM engine in the model's place); ``sampling``: exact token
sampling that records log-probs; ``on_policy``: the check that the ratio is taken against the
policy that sampled; ``multiturn``: episodes of several turns with tools; ``partial``: partial
rollouts (long responses paused and continued by newer weights); ``weight_sync``: the trainer's
weights to whichever copy samples; ``asynchronous`` and ``ray``: sampling beside the trainer;
``factory``: the settings to one of them. The rollouts' layout is
:mod:`rlhf_torchrl.data.rollout`'s.
"""

from rlhf_torchrl.collectors.backends.transformers import make_generation_policy, sampler_of
from rlhf_torchrl.collectors.base import RolloutCollector
from rlhf_torchrl.collectors.multiturn import MultiTurnCollector
from rlhf_torchrl.collectors.partial import PartialRolloutCollector
from rlhf_torchrl.collectors.weight_sync import SyncedCollector, WeightSync, engine_weights
from rlhf_torchrl.envs.prompt_env import ShardedBatchSampler, make_generation_env

__all__ = [
    "MultiTurnCollector", "PartialRolloutCollector", "RolloutCollector", "ShardedBatchSampler",
    "SyncedCollector", "WeightSync", "engine_weights", "make_generation_env",
    "make_generation_policy", "sampler_of",
]
