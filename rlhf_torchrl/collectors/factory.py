"""The collector of a run from one picklable spec: backend x overlap x Ray.

:class:`CollectorSpec` says how rollouts are sampled (sizes, sampling settings, the backend, the
vLLM engine, asynchronous overlap, Ray workers); :func:`make_collector` builds this process's
collector from it. A Ray worker gets the spec and the prompts and builds its own share
(:func:`ray_worker`): it imports this package only, no recipe or config.

Example:
    >>> spec = CollectorSpec(policy="smollm2-135m-instruct", batch_size=32, max_new_tokens=64,
    ...                      temperature=0.7, stop_token_ids=(tok.eos_token_id,), overlap=1)
    >>> collector = make_collector(spec, prompts, tok, policy)  # AsyncCollector over a copy
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rlhf_torchrl.collectors.asynchronous import AsyncCollector, ModelCopy
from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS
from rlhf_torchrl.collectors.base import RolloutCollector
from rlhf_torchrl.collectors.sampling import check_full_distribution
from rlhf_torchrl.collectors.weight_sync import SyncedCollector, WeightSync
from rlhf_torchrl.data.prompt_sets import PromptMixture, PromptSet
from rlhf_torchrl.distributed import DataParallel
from rlhf_torchrl.envs.prompt_env import make_generation_env
from rlhf_torchrl.envs.sandbox import SandboxSpec
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.runtime import resolve_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMSpec:
    """The vLLM engine of ``backend="vllm"`` (:func:`~rlhf_torchrl.collectors.backends.vllm.make_vllm_engine`).

    Args:
        max_model_len: the longest sequence (prompt + response), in tokens.
        dtype: the engine's weights' dtype.
        gpu_memory_utilization: on CUDA, the share of the GPU the engine may take (weights and KV
            cache; keep it small when training shares the GPU).
        kv_cache_gb: on the CPU backend, the KV cache's size in GB.
        enforce_eager: no CUDA graphs (faster start, slower sampling).
        sleep: the engine frees its GPU memory between batches (None: on with CUDA).
        tensor_parallel_size: GPUs the engine shards the model over.
        workdir: the engine's config and tokenizer files (None: a temporary directory).
    """

    max_model_len: int
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float = 1.0
    enforce_eager: bool = True
    sleep: bool | None = None  # None: on with CUDA
    tensor_parallel_size: int = 1
    workdir: str | None = None  # the engine's config and tokenizer files (None: a temporary one)


@dataclass(frozen=True)
class CollectorSpec:
    """How a run samples its rollouts; plain values only, so Ray can ship it to its workers.

    Rows are sampled from streams keyed by ``(seed, batch, row)``.

    Args:
        batch_size: the global batch, in responses (over all processes or workers).
        max_new_tokens: the response budget (per turn, with several turns), in tokens.
        stop_token_ids: the ids that end a response.
        temperature: the sampling temperature.
        top_k: keep the ``k`` likeliest tokens (0: all).
        top_p: nucleus sampling's mass (1.0: all).
        seed: the sampling streams' seed.
        backend: a name in :data:`~rlhf_torchrl.collectors.backends.GENERATION_BACKENDS`:
            ``transformers`` (the trained model, or with ``overlap`` a copy of it, samples) or
            ``vllm`` (an engine given ``vllm``'s settings).
        vllm: the engine's settings (the backend's ``engine_spec``; None: it has none).
        overlap: None: synchronous; ``N >= 0``: a background thread samples ``N`` updates ahead.
        record_entropy: the sampler records exact entropies (log-probs are always recorded).
        autocast_dtype: ``bfloat16``/``float16`` generation (None: the model's dtype).
        lm_head_matmul: the fp32 logits' product under autocast (``model.lm_head_matmul``:
            ``fp32`` or ``bf16x3``), which Ray workers give their own policy's head.
        policy: the policy's name or path, which Ray workers load their own copy from.
        chat_template: the workers' tokenizer's chat template, as
            :func:`~rlhf_torchrl.modules.load_tokenizer` takes it.
        dtype: the workers' policy dtype.
        attn_implementation: the workers' attention kernel (None: transformers' default).
        ray_workers: ``N > 0``: Ray actors each sample their share with a policy of their own
            (0: no Ray).
        ray_address: the Ray cluster to join (None: a local one started here).
        ray_cpus_per_worker: CPUs Ray reserves for each worker.
        ray_gpus_per_worker: GPUs Ray reserves for each worker (0: they sample on the CPU).
        worker_restarts: Ray workers replaced over the run (died, or hung past
            ``worker_timeout``) before the run stops.
        worker_timeout: seconds a Ray worker may take to answer one call (start-up and a batch,
            or a weight load).
        samples_per_prompt: responses sampled for each prompt (a group; ``batch_size`` counts
            responses); vLLM draws a group as one request with ``n`` samples.
        max_turns: turns per episode; above 1, episodes of several turns with tools
            (:class:`~rlhf_torchrl.collectors.MultiTurnCollector`).
        tools: the tools' names (:func:`~rlhf_torchrl.envs.tools.load_tools`).
        max_tokens: an episode's budget of response tokens over all its turns (None: none).
        tool_timeout: seconds a tool call may run.
        python_sandbox: where the ``python`` tool runs code (None: the default sandbox).
        partial_rollout_tokens: partial rollouts, a response paused after this many tokens per
            round and continued later
            (:class:`~rlhf_torchrl.collectors.partial.PartialRolloutCollector`); None: whole
            responses.
        static_cache_len: the transformers backend decodes with a static KV cache of this many
            positions and a compiled decode step (``generation.compile``; None: eager, a dynamic
            cache).
    """

    batch_size: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    backend: str = "transformers"
    vllm: VLLMSpec | None = None
    overlap: int | None = None
    record_entropy: bool = False
    autocast_dtype: str | None = None
    lm_head_matmul: str = "fp32"
    policy: str | None = None
    chat_template: str | None = None
    dtype: str = "float32"
    attn_implementation: str | None = None
    ray_workers: int = 0
    ray_address: str | None = None
    ray_cpus_per_worker: float = 1
    ray_gpus_per_worker: float = 0
    worker_restarts: int = 3
    worker_timeout: float = 1800.0
    samples_per_prompt: int = 1
    max_turns: int = 1
    tools: tuple[str, ...] = ()
    max_tokens: int | None = None
    tool_timeout: float = 10.0
    python_sandbox: SandboxSpec | None = None
    partial_rollout_tokens: int | None = None
    static_cache_len: int | None = None


def make_collector(spec: CollectorSpec, prompts, tokenizer, policy, *, device=None,
                   parallel: DataParallel | None = None, start_batch: int = 0, pending=(),
                   value_head=None):
    """This process's share of every global batch, each row sampled from its own stream.

    A sampler with weights of its own (vLLM, Ray workers, a copy) gets the trainer's through the
    collector's ``update_weights(version)`` (:class:`SyncedCollector`, :class:`AsyncCollector`).
    A resumed run starts at batch ``start_batch`` (= iterations done), after the ``pending``
    batches its asynchronous collector had sampled ahead (saved in the checkpoint).

    Args:
        spec: how to sample.
        prompts (Sequence): the prompts, as :func:`~rlhf_torchrl.collectors.make_generation_env`
            takes them.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        policy (transformers.PreTrainedModel): the trained policy model.
        device (torch.device | str | None): where rollouts are sampled and placed (None: the CPU).
        parallel: this process's place in a torchrun job (None: one process).
        start_batch: the first global batch (a resumed run: the iterations done).
        pending (Sequence): the rollouts an asynchronous collector had sampled ahead, from the
            checkpoint, served first.
        value_head (torch.nn.Module | None): a shared-trunk critic's head; where ``policy``
            itself samples (the transformers backend without a copy: no ``overlap`` > 0, no Ray
            workers), the rollouts carry the values read off the sampling pass
            (:class:`~rlhf_torchrl.collectors.sampling.ValueRecorder`). Elsewhere the critic computes them (a
            copy or another engine holds no value head).
    """
    partial_state = None
    if spec.partial_rollout_tokens is not None:  # the paused responses, not batches sampled ahead
        from rlhf_torchrl.collectors.partial import resume_batch

        partial_state, pending = (pending[0] if pending else None), ()
    if pending and "next_batch" in pending[0].keys():
        raise ConfigError("The checkpoint holds the responses partial rollouts paused: resume with "
                          "collection.partial_rollout=true and the same partial_rollout_tokens.")
    if pending and spec.overlap is None:
        raise ConfigError(f"The checkpoint holds {len(pending)} batches sampled ahead "
                          "(collection.overlap was set): resume with the same collection.overlap.")
    parallel = parallel or DataParallel()
    device = torch.device(device) if device is not None else torch.device("cpu")
    first = start_batch + len(pending)  # the first batch this collector samples
    if partial_state is not None:  # the prompts go on where the paused run's stopped
        first = resume_batch(partial_state)

    def in_background(collector, sync):
        if spec.overlap is None:
            return collector if sync is None else SyncedCollector(collector, sync)
        return AsyncCollector(collector, sync, overlap=spec.overlap, start_version=start_batch,
                              pending=pending)

    if spec.ray_workers:
        collector = make_ray_collector(spec, prompts, tokenizer, device=device, start_batch=first)
        sync = WeightSync(policy, collector)
        log.info("%d Ray workers loaded the policy's weights in %.2f s", spec.ray_workers, sync(0))
        return in_background(collector, sync)
    world, rank = parallel.world_size, parallel.rank
    env = make_generation_env(prompts, tokenizer, batch_size=spec.batch_size, seed=spec.seed,
                              rank=rank, world_size=world, start_batch=first,
                              samples_per_prompt=spec.samples_per_prompt)
    check_full_distribution(spec.top_k, spec.top_p)  # PPO trains on full-distribution samples
    backend = GENERATION_BACKENDS.get(spec.backend)
    gen_policy, sync = backend.make_policy(spec, policy, tokenizer, device, parallel=parallel,
                                           value_head=value_head)
    local = spec.batch_size // world
    if spec.partial_rollout_tokens is not None:
        from rlhf_torchrl.collectors.partial import PartialRolloutCollector

        return in_background(PartialRolloutCollector(
            env, gen_policy, tokenizer=tokenizer, batch_size=local,
            max_new_tokens=spec.max_new_tokens, segment_tokens=spec.partial_rollout_tokens,
            seed=spec.seed, row_offset=rank * local, samples_per_prompt=spec.samples_per_prompt,
            stop_token_ids=list(spec.stop_token_ids), start_batch=start_batch, device=device,
            state=partial_state), sync)
    collector = RolloutCollector(env, gen_policy, tokenizer=tokenizer, batch_size=local,
                                 stop_token_ids=list(spec.stop_token_ids), seed=spec.seed,
                                 row_offset=rank * local, device=device, start_batch=first,
                                 samples_per_prompt=spec.samples_per_prompt)
    if spec.tools:  # the later turns of each episode, after its tool calls
        from rlhf_torchrl.collectors.multiturn import MultiTurnCollector
        from rlhf_torchrl.envs.tools import load_tools

        collector = MultiTurnCollector(
            collector, gen_policy, tokenizer=tokenizer, tools=load_tools(spec.tools, python_sandbox=spec.python_sandbox),
            max_turns=spec.max_turns, max_new_tokens=spec.max_new_tokens,
            max_tokens=spec.max_tokens, tool_timeout=spec.tool_timeout)
    return in_background(collector, sync)


def make_ray_collector(spec: CollectorSpec, prompts: Sequence, tokenizer, *, device=None,
                       start_batch: int = 0):
    """``spec.ray_workers`` Ray actors (:func:`ray_worker`), on the cluster at
    ``spec.ray_address`` or a local one started here.

    Args:
        spec: how to sample (``spec.ray_workers`` > 0).
        prompts: the prompts, shipped to every worker.
        tokenizer (transformers.PreTrainedTokenizerBase): the trainer's tokenizer (its pad id).
        device (torch.device | str | None): where the gathered rollouts are moved (None: left as
            gathered).
        start_batch: the first global batch (a resumed run).
    """
    import ray

    from rlhf_torchrl.collectors.ray import RayCollector

    started = not ray.is_initialized()
    if started:
        ray.init(address=spec.ray_address, include_dashboard=False, log_to_driver=False)
    # a prompt set travels as its table (a memory-mapped one pickles as its files), not its rows
    shipped = prompts if isinstance(prompts, (PromptSet, PromptMixture)) else list(prompts)
    return RayCollector(functools.partial(ray_worker, spec, shipped), spec.ray_workers,
                        pad_token_id=tokenizer.pad_token_id, start_batch=start_batch,
                        restarts=spec.worker_restarts, timeout=spec.worker_timeout,
                        num_cpus=spec.ray_cpus_per_worker, num_gpus=spec.ray_gpus_per_worker,
                        device=device, shutdown_ray=started)


def ray_worker(spec: CollectorSpec, prompts: list, rank: int, world_size: int,
               start_batch: int = 0):
    """Runs in Ray worker ``rank``: its own tokenizer and policy (or vLLM engine), and the collector
    of its rows of every global batch from ``start_batch`` on (a resumed run, or a worker that
    replaces a dead one); returns ``(collector, weights target)``.

    Args:
        spec: how to sample.
        prompts: every prompt.
        rank: the worker's index.
        world_size: the number of workers.
        start_batch: the first global batch (a resumed run).
    """
    from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
    from rlhf_torchrl.modules.models import lm_head_in_fp32

    spec = replace(spec, ray_workers=0, overlap=None)
    device = resolve_device("cuda" if spec.ray_gpus_per_worker else "cpu")
    tokenizer = load_tokenizer(spec.policy, chat_template=spec.chat_template)
    model = load_causal_lm(spec.policy, tokenizer, dtype=spec.dtype,
                           attn_implementation=spec.attn_implementation).to(device)
    if spec.autocast_dtype is not None:  # the logits' product the trainer's policy has
        lm_head_in_fp32(model, spec.lm_head_matmul)
    # the worker's model is only sampled from; weights arrive merged (LoRA) from the trainer
    target = ModelCopy(model, copy_model=False)
    place = DataParallel(rank=rank, world_size=world_size)
    collector = make_collector(spec, prompts, tokenizer, target.model, device=device,
                               parallel=place, start_batch=start_batch)
    if isinstance(collector, SyncedCollector):  # vLLM: the engine loads the pushed weights
        return collector.collector, collector.weight_sync.target
    return collector, target
