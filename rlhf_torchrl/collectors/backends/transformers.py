"""The generation policy: TorchRL's ``TransformersWrapper(generate=True)`` sampling the full
distribution at the recipe's temperature (no top-k/top-p), each group's prompt prefilled once;
its on-policy wrapper serves the vLLM backend too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torchrl.modules.llm import TransformersWrapper

from rlhf_torchrl import functional as F
from rlhf_torchrl.collectors.backends.base import GENERATION_BACKENDS, GenerationBackend


def make_generation_policy(
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    record_log_probs: bool = False,
    record_entropy: bool = False,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    samples_per_prompt: int = 1,
    value_head: torch.nn.Module | None = None,
    static_cache_len: int | None = None,
):
    """TorchRL's ``TransformersWrapper`` set up to sample responses on-policy.

    Tokens are drawn by :class:`~rlhf_torchrl.collectors.sampling.InverseCDFSampler` (exact, and on CPU
    several times faster than ``generate``'s multinomial). ``top_k=0`` and ``top_p=1.0`` sample
    from the full temperature-scaled distribution, the one the PPO log-probs are computed under.
    Nothing else touches the logits: ``generate`` gets these settings and transformers' neutral
    defaults (:func:`~rlhf_torchrl.collectors.sampling.sampling_generation_config`), never the checkpoint's
    own ``generation_config`` (a warning names what that leaves out). The rendered prompt is tokenised
    without adding special tokens (the chat template already wrote them).

    With ``record_log_probs`` (and ``record_entropy``) the sampler keeps the sampled tokens'
    log-probs (and exact entropies), which :class:`RolloutCollector` writes to each rollout: no
    policy forward is needed to get PPO's old log-probs. TorchRL's own log-probs are never
    requested: they are wrong for PPO (see :mod:`rlhf_torchrl.modules.actor`).

    Args:
        model (transformers.PreTrainedModel): the policy's causal LM (the trained model itself).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_new_tokens: the response budget, in tokens.
        temperature: the sampling temperature.
        top_k: keep the ``k`` likeliest tokens (0: all).
        top_p: nucleus sampling's mass (1.0: all).
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        record_log_probs: keep the sampled tokens' log-probs.
        record_entropy: keep their exact entropies too.
        device: where prompts are tokenised (None: the model's device).
        autocast_dtype: run ``generate`` under ``torch.autocast`` with this dtype, the LM head in
            fp32 (:func:`~rlhf_torchrl.modules.models.lm_head_in_fp32`): the sampler reads fp32
            logits. None: no autocast.
        samples_per_prompt: ``N``: batches come in groups of ``N`` consecutive rows with one
            prompt (:func:`make_generation_env`); each group's prompt is prefilled once and its KV
            cache repeated for the ``N`` rows (:func:`generate_in_groups`), the same tokens and
            scores as ``N`` prefills.
        value_head: the head of a critic on ``model``'s own trunk (``make_critic(init="shared")``):
            a :class:`~rlhf_torchrl.collectors.sampling.ValueRecorder` then reads each response token's value
            off the sampling forwards, and :class:`RolloutCollector` writes them as
            ``"state_value"`` (the old values need no trunk forward of their own). None: no values.
        static_cache_len: ``N``: decode with a static KV cache of ``N`` positions (the longest
            prompt plus the response budget) and the decode step compiled by transformers
            (``torch.compile``, CUDA graphs on CUDA): one graph serves every batch of the same
            size, since the cache's shape never changes (:class:`StaticCaches`). The
            prefill stays eager; a group's prompt is then prefilled once per row (the grouped
            prefill continues a dynamic cache), and ``value_head`` must be None (the value hook
            would split the compiled step). None: transformers' dynamic cache, eager.
    """
    from transformers import LogitsProcessorList

    from rlhf_torchrl.collectors.sampling import (
        InverseCDFSampler,
        ValueRecorder,
        sampling_generation_config,
        warn_ignored_generation_settings,
    )
    from rlhf_torchrl.modules.lora import trunk
    from rlhf_torchrl.modules.models import lm_head_in_fp32
    from rlhf_torchrl.runtime import module_device

    stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
    if autocast_dtype is not None:  # the trunk in bf16/fp16, the logits the sampler reads in fp32
        lm_head_in_fp32(model)
    sampler = InverseCDFSampler(temperature, top_k, top_p, record=record_log_probs,
                                record_entropy=record_entropy)
    warn_ignored_generation_settings(model, temperature)
    policy = on_policy_wrapper(
        model, tokenizer, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
        device=torch.device(device) if device is not None else module_device(model),
        do_sample=False)  # greedy over the sampler's one-hot scores = the sampler's draw
    policy.generation_config = sampling_generation_config(model)
    policy.autocast_dtype = autocast_dtype
    policy.samples_per_prompt = samples_per_prompt
    if static_cache_len is not None:
        if value_head is not None:
            raise ValueError("Values are not read off a compiled decode step: pass value_head=None "
                             "(the critic computes them) or static_cache_len=None.")
        policy.generation_config.compile_config = compile_config()
        policy.static_cache = StaticCaches(static_cache_len)
        policy.samples_per_prompt = 1  # the grouped prefill continues a dynamic cache
    policy.value_recorder = ValueRecorder(trunk(model), value_head) if value_head is not None else None
    # TransformersWrapper drops generate_kwargs it does not know, logits_processor among them
    # (tests/test_torchrl_upstream.py): set it on the built wrapper
    policy.generate_kwargs["logits_processor"] = LogitsProcessorList([sampler])
    return policy


def compile_config():
    """transformers' ``CompileConfig`` of the decode step over a static KV cache: its default
    mode (``reduce-overhead``: CUDA graphs on CUDA), fixed shapes (``dynamic=False``: the cache's
    never change), and ``_compile_all_devices`` so that it compiles on a CPU too (transformers
    compiles on accelerators only by default), where the tests check its tokens against eager
    decoding."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False)
    config._compile_all_devices = True  # transformers' own switch (CPU included)
    return config


class StaticCaches:
    """One static KV cache of ``max_cache_len`` positions per batch size, dtype and device, emptied
    before each ``generate`` that continues it.

    transformers compiles the decode step when the cache is static. Its own static cache is sized
    for each call and allocated in the weights' dtype (under a bf16 autocast the values then come
    in bf16 and the keys in fp32, and transformers 5.17 refuses to write them); this one is
    allocated once, in the autocast dtype (the weights' without one), each layer's keys and
    values cast to it, for the longest prompt plus the response budget, so a batch with a shorter
    prompt reuses the same graph instead of recompiling.

    Args:
        max_cache_len: the cache's positions: the longest prompt plus ``max_new_tokens``.
    """

    def __init__(self, max_cache_len: int):
        self.max_cache_len = int(max_cache_len)
        self._caches: dict = {}

    def __call__(self, model, batch_size: int, dtype: torch.dtype, device: torch.device):
        """The empty cache for ``batch_size`` rows of ``model``'s keys in ``dtype`` on ``device``."""
        from transformers import StaticCache

        key = (batch_size, dtype, device)
        cache = self._caches.get(key)
        if cache is None:
            config = model.config.get_text_config(decoder=True)
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = (getattr(config, "head_dim", None)
                        or config.hidden_size // config.num_attention_heads)
            cache = self._caches[key] = StaticCache(config=config, max_cache_len=self.max_cache_len)
            cache.early_initialization(batch_size=batch_size, num_heads=heads, head_dim=head_dim,
                                       dtype=dtype, device=device)
            for layer in cache.layers:
                layer.update = functools.partial(_update_in_dtype, layer.update, dtype)
        else:
            cache.reset()
        return cache


def _update_in_dtype(update, dtype: torch.dtype, key_states: torch.Tensor,
                     value_states: torch.Tensor, *args, **kwargs):
    """A static cache layer's ``update`` with the new keys and values in the cache's ``dtype``.
    Under autocast the values come out of a bf16 matmul and the keys out of the fp32 rotary
    embedding; attention then computes in bf16 either way (SDPA is on autocast's bf16 list), so
    storing both in bf16 gives the dynamic cache's result."""
    return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)


def cache_kwarg(model) -> str:
    """The name ``model``'s forward and ``generate`` take a KV cache by: ``cache`` (transformers
    5.24 on; ``past_key_values`` is then deprecated), else ``past_key_values``; a PEFT model's
    is its Hugging Face model's."""
    import inspect

    from rlhf_torchrl.modules.lora import hf_model

    forward = getattr(type(hf_model(model)), "forward", None)
    try:
        return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def generate_with_static_cache(model, generate, caches: StaticCaches,
                               dtype: torch.dtype | None, *, input_ids: torch.Tensor, **kwargs):
    """``generate(input_ids, **kwargs)`` continuing an empty cache of ``caches`` (keys in
    ``dtype``; None: the weights')."""
    dtype = dtype or next(model.parameters()).dtype
    cache = caches(model, input_ids.shape[0], dtype, input_ids.device)
    return generate(input_ids=input_ids, **{cache_kwarg(model): cache}, **kwargs)


def on_policy_wrapper(model, tokenizer, *, max_new_tokens: int,
                      stop_token_ids: Sequence[int] | None, device: torch.device,
                      **generate_kwargs) -> TransformersWrapper:
    """TorchRL's ``TransformersWrapper`` over ``model`` (a causal LM, or an engine with its
    ``generate``) as both backends sample with it: rendered text in, padded token tensors out,
    TorchRL's own log-probs off, ``generate`` run under the wrapper's ``generation_config``.

    Args:
        model: the causal LM or engine whose ``generate`` samples.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_new_tokens: the response budget, in tokens.
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        device: where prompts are tokenised.
        **generate_kwargs: more keyword arguments for ``generate``.
    """
    return _OnPolicyTransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="text",
        generate=True,
        return_log_probs=False,
        pad_output=True,
        # the chat template already wrote BOS (Llama 3, Gemma): adding specials would double it
        tokenizer_kwargs={"add_special_tokens": False},
        device=device,
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            **generate_kwargs,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": list(stop_token_ids or [tokenizer.eos_token_id]),
        },
    )


class _OnPolicyTransformersWrapper(TransformersWrapper):
    """``TransformersWrapper`` whose ``generate`` runs under ``self.generation_config``.

    transformers fills every generation setting it is not given from ``model.generation_config``,
    and a checkpoint's repetition penalty or suppressed tokens would bend the distribution the
    tokens are drawn from (off-policy). The model's own config is swapped out only for the call,
    which runs under ``torch.autocast`` when ``autocast_dtype`` is set. The ``generate`` call
    records values (``value_recorder``) and prefills each group's prompt once
    (``samples_per_prompt``) where those are set.
    """

    generation_config = None
    autocast_dtype = None
    samples_per_prompt = 1  # > 1: the prompt of each group of rows is prefilled once
    value_recorder = None  # a ValueRecorder: values read off the sampling forwards
    static_cache = None  # StaticCaches: decode over a static cache, the step compiled

    def forward(self, *args, **kwargs):
        with self._sampling(grouped=True):
            return super().forward(*args, **kwargs)

    @contextlib.contextmanager
    def _sampling(self, *, grouped: bool):
        """The model's own generation config swapped out, ``self.model.generate`` shadowed by one
        that records values (around the generate itself) and, with ``grouped``, prefills each
        group once (before it), all under autocast."""
        from rlhf_torchrl.modules.lora import hf_model
        from rlhf_torchrl.runtime import autocast

        # PEFT copies its config onto the base model in generate: swap (and restore) that one
        model = hf_model(self.model)
        own = getattr(model, "generation_config", None)
        if self.generation_config is not None:
            model.generation_config = self.generation_config
        generate = self.model.generate
        if self.value_recorder is not None:
            generate = self.value_recorder.wrap(generate)
        # FSDP2 (synced_gpus): every process must run the same forwards; no per-batch choice there
        grouped = (grouped and self.samples_per_prompt > 1
                   and not self.generate_kwargs.get("synced_gpus"))
        if grouped:
            generate = functools.partial(generate_in_groups, self.model, generate,
                                         self.samples_per_prompt)
        if self.static_cache is not None:
            generate = functools.partial(generate_with_static_cache, model, generate,
                                         self.static_cache, self.autocast_dtype)
        shadowed = grouped or self.value_recorder is not None or self.static_cache is not None
        if shadowed:  # TorchRL's wrapper calls self.model.generate
            self.model.generate = generate
        try:
            with autocast(self._device, self.autocast_dtype):
                yield generate
        finally:
            if self.generation_config is not None:
                model.generation_config = own
            if shadowed:
                del self.model.generate

    def sample_texts(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a response to each rendered prompt exactly as :meth:`forward` does (the same
        tokenisation, ``generate`` call, grouped prefill and recorders), without TorchRL's text,
        token and mask objects around it: the dense one-turn path of
        :class:`~rlhf_torchrl.collectors.RolloutCollector`. Returns the (B, P) left-padded prompt
        tokens, their (B, P) attention mask and the (B, T) response tokens as generated
        (right-padded with the pad token)."""
        encoded = self.tokenizer(list(texts), **self.tokenizer_kwargs)
        input_ids = encoded["input_ids"].to(self._device)
        attention_mask = encoded["attention_mask"].to(self._device)
        with self._sampling(grouped=True) as generate, torch.no_grad():
            out = generate(input_ids=input_ids, attention_mask=attention_mask,
                           **self.generate_kwargs)
        return input_ids, attention_mask, _sequences(out)[:, input_ids.shape[1]:]

    def generate_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        max_new_tokens: int) -> torch.Tensor:
        """Sample continuations of left-padded token rows as :meth:`forward` samples responses
        (same sampler, stop tokens, recorded log-probs and values), each row on its own (no
        grouped prefill): the next turn of a multi-turn episode. Returns (B, T) new tokens,
        right-padded with the pad token."""
        kwargs = {**self.generate_kwargs, "max_new_tokens": max_new_tokens}
        groups = getattr(self.model, "samples_per_prompt", None)  # a vLLM engine's request size
        if groups is not None:
            self.model.samples_per_prompt = 1
        try:
            with self._sampling(grouped=False) as generate, torch.no_grad():
                out = generate(input_ids=input_ids.to(self._device),
                               attention_mask=attention_mask.to(self._device), **kwargs)
        finally:
            if groups is not None:
                self.model.samples_per_prompt = groups
        return _sequences(out)[:, input_ids.shape[1]:].cpu()


def _sequences(out) -> torch.Tensor:
    """The (B, P + T) token rows a ``generate`` returned: a dict's or an output object's
    ``sequences`` (transformers, the vLLM generator), or the tensor itself."""
    return out["sequences"] if isinstance(out, dict) else getattr(out, "sequences", out)


def generate_in_groups(model, generate, group: int, *, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, **kwargs):
    """``generate(input_ids, attention_mask, **kwargs)`` for a batch of groups of ``group``
    consecutive rows with the same (left-padded) prompt, prefilling each prompt once.

    The prompt without its last token runs once per group (the first row of each), its KV cache
    is repeated for every row of the group (``DynamicCache.batch_repeat_interleave``), and
    ``generate`` continues from that cache: it runs the last prompt token, then samples. Tokens and
    scores are those of a prefill per row (``tests/test_sampling.py``); on a 2-core CPU with
    SmolLM2, 8 prompts x 4 responses of 48 tokens, the prefill was ~21% of generation and one per
    group saves ~3/4 of it. A batch that is not made of such groups is generated as it is.

    Args:
        model (transformers.PreTrainedModel): the model whose forward prefills the prompts.
        generate (Callable): ``model.generate`` or a wrapper of it.
        group: rows per group (1: a prefill per row).
        input_ids: (B, P) left-padded prompt tokens.
        attention_mask: (B, P) their attention mask.
        **kwargs: passed to ``generate``.
    """
    from transformers import DynamicCache

    first, first_mask = input_ids[::group], attention_mask[::group]
    prefix_mask = first_mask[:, :-1]
    if (input_ids.shape[0] % group or input_ids.shape[1] < 2 or not bool(prefix_mask.any(-1).all())
            or not torch.equal(input_ids, first.repeat_interleave(group, 0))
            or not torch.equal(attention_mask, first_mask.repeat_interleave(group, 0))):
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    cache, name = DynamicCache(config=getattr(model, "config", None)), cache_kwarg(model)
    with torch.no_grad():
        model(input_ids=first[:, :-1], attention_mask=prefix_mask,
              position_ids=F.position_ids_from_mask(prefix_mask), **{name: cache}, use_cache=True)
    cache.batch_repeat_interleave(group)
    return generate(input_ids=input_ids, attention_mask=attention_mask, **{name: cache}, **kwargs)


def sampler_of(policy):
    """What draws a generation policy's tokens and records their log-probs: the transformers
    backend's :class:`~rlhf_torchrl.collectors.sampling.InverseCDFSampler`, or the
    :class:`~rlhf_torchrl.collectors.backends.vllm.VLLMGenerator` in the model's place; None otherwise.

    Args:
        policy (torch.nn.Module): a generation policy (:func:`make_generation_policy` or the vLLM
            one).
    """
    from rlhf_torchrl.collectors.sampling import InverseCDFSampler

    processors = getattr(policy, "generate_kwargs", {}).get("logits_processor") or []
    sampler = next((p for p in processors if isinstance(p, InverseCDFSampler)), None)
    model = getattr(policy, "model", None)
    if sampler is None and all(hasattr(model, a) for a in ("set_streams", "pop", "record")):
        sampler = model
    return sampler


@GENERATION_BACKENDS.register("transformers")
class TransformersBackend(GenerationBackend):
    """The trained model samples with Hugging Face ``generate`` in the trainer's process (with
    ``collection.overlap``, a copy of it); ``generation.compile``: a static KV cache and a
    compiled decode step."""

    log_probs_match_training = True
    samples_with_trained_model = True
    compiles_decode = True
    overlap_needs_policy_copy = True

    @classmethod
    def make_policy(cls, spec, policy, tokenizer, device, *, parallel, value_head=None):
        from rlhf_torchrl.collectors.asynchronous import ModelCopy
        from rlhf_torchrl.collectors.weight_sync import WeightSync
        from rlhf_torchrl.modules.models import torch_dtype

        sync, sampling_model = None, policy
        if spec.overlap:  # the trainer updates the policy while the copy samples
            copy_ = ModelCopy(policy)
            sync, sampling_model = WeightSync(policy, copy_), copy_.model
        gen_policy = make_generation_policy(
            sampling_model, tokenizer, max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
            stop_token_ids=list(spec.stop_token_ids),
            # always recorded: the old log-probs (unless recomputed) and the on-policy check's reference
            record_log_probs=True, record_entropy=spec.record_entropy, device=device,
            autocast_dtype=torch_dtype(spec.autocast_dtype) if spec.autocast_dtype else None,
            samples_per_prompt=spec.samples_per_prompt,
            value_head=value_head if sampling_model is policy else None,
            static_cache_len=spec.static_cache_len,
        )
        gen_policy.generate_kwargs.update(parallel.generate_kwargs())
        return gen_policy, sync
