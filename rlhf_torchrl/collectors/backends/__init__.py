"""Generation backends: what samples the responses, each a registered
:class:`~rlhf_torchrl.collectors.backends.base.GenerationBackend`.

``transformers``: Hugging Face ``generate`` in the trainer's process (eager, or a static KV cache
with a compiled decode step); ``vllm``: a vLLM engine that gets the trainer's weights after every
update. ``base``: the class a new backend subclasses, and :data:`GENERATION_BACKENDS`.
"""

from rlhf_torchrl.collectors.backends import transformers, vllm  # noqa: F401 - they register
from rlhf_torchrl.collectors.backends.base import GENERATION_BACKENDS, GenerationBackend

__all__ = ["GENERATION_BACKENDS", "GenerationBackend"]
