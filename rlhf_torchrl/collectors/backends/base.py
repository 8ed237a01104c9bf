"""What a generation backend is: a registered class whose attributes answer what the run must do
around it, and whose :meth:`~GenerationBackend.make_policy` builds the sampling policy.

A new backend is one file: subclass :class:`GenerationBackend`, set its capabilities, implement
``make_policy`` and register it (``@GENERATION_BACKENDS.register("sglang")``); ``generation.backend``
then selects it. Nothing else compares backend names.
"""

from __future__ import annotations

from rlhf_torchrl.registry import Registry


class GenerationBackend:
    """What samples a run's responses. Its class attributes are the capabilities the run asks
    about; its class methods build and check it. Every method has the base behaviour a backend
    without that need keeps.
    """

    name: str
    #: its name in words (the plan's rows: "vLLM engine")
    label: str = "generation"
    #: its recorded log-probs are the training forward's own (the same model and kernels, in the
    #: trainer's process): in fp32 and synchronous they can serve as PPO's old log-probs
    log_probs_match_training: bool = False
    #: it samples with weights of its own, which the trainer pushes after every update
    takes_pushed_weights: bool = False
    #: the on-policy check runs again on the first batch after each push: a push that went wrong
    #: (a missed tensor, a wrong dtype) shows there
    recheck_after_push: bool = False
    #: the trained model itself samples: a shared-trunk critic's values can be read off the
    #: sampling pass (``ValueRecorder``)
    samples_with_trained_model: bool = False
    #: ``generation.compile`` applies (a static KV cache and a compiled decode step)
    compiles_decode: bool = False
    #: with ``collection.overlap`` the sampler is a copy of the policy, which FSDP2 shards cannot give
    overlap_needs_policy_copy: bool = False

    @classmethod
    def missing(cls) -> str | None:
        """The one line saying what to install, where a package it needs is absent (None: ready)."""
        return None

    @classmethod
    def check(cls, cfg, device) -> None:
        """Its own settings against the device, before any model loads (a ConfigError)."""

    @classmethod
    def engine_spec(cls, cfg):
        """The picklable settings of its engine, carried by the collector's spec (None: none)."""
        return None

    @classmethod
    def engine_memory(cls, cfg, device_bytes: float, *, cuda: bool) -> tuple[float, float] | None:
        """``(bytes while sampling, bytes kept while training)`` of an engine of its own on a device
        of ``device_bytes``, for the plan (:mod:`rlhf_torchrl.plan`); None: it samples in the
        trained model's memory (the KV cache and logits, which the plan counts itself)."""
        return None

    @classmethod
    def sampler_dtype(cls, cfg) -> str | None:
        """The dtype its sampler computes log-probs in, where that is not the trainer's (None)."""
        return None

    @classmethod
    def make_policy(cls, spec, policy, tokenizer, device, *, parallel, value_head=None):
        """``(generation policy, weight sync or None)``: the TorchRL generation policy that
        samples ``spec``'s rollouts, and what pushes the trainer's weights to it.

        Args:
            spec (rlhf_torchrl.collectors.factory.CollectorSpec): how to sample.
            policy (transformers.PreTrainedModel): the trained policy.
            tokenizer (transformers.PreTrainedTokenizerBase): its tokenizer.
            device (torch.device): where rollouts are sampled.
            parallel (rlhf_torchrl.distributed.DataParallel): this process's place in the job.
            value_head (torch.nn.Module | None): a shared-trunk critic's head, read while
                sampling where the trained model samples.
        """
        raise NotImplementedError


#: the values of ``generation.backend``
GENERATION_BACKENDS: Registry[type[GenerationBackend]] = Registry("generation.backend",
                                                                  "generation backend")
