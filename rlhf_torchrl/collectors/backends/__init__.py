"""Generation backends: what samples the responses.

``transformers``: Hugging Face ``generate`` in the trainer's process (eager, or a static KV cache
with a compiled decode step); ``vllm``: a vLLM engine.
"""
