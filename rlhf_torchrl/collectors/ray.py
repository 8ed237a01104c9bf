"""Collection spread over Ray workers: each samples its share of every global batch.

Worker ``i`` of ``N`` is a Ray actor holding a :class:`~rlhf_torchrl.collectors.RolloutCollector`
for rows ``i * B/N ... (i + 1) * B/N - 1`` of each global batch (the same sharding as torchrun's
processes), with its own copy of the policy or its own vLLM engine. The learner asks every worker
for its next batch at once and concatenates them in worker order; since each row has its own random
stream, N workers sample exactly what one collector would. After each update the trainer's
weights are put in Ray's object store once and every worker loads them.

TorchRL's ``RayLLMCollector`` wraps one remote ``LLMCollector``; its weight updaters for vLLM need
NCCL and a GPU, and its remote actor cannot be told which rows of a global batch are its own. So the
actor here is a thin one around the same env + generation policy + ``LLMCollector`` as everywhere
else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict

from rlhf_torchrl.data.rollout import concat_rollouts
from rlhf_torchrl.errors import ConfigError


class _Worker:
    """The Ray actor: ``factory(rank, world_size)`` returns ``(collector, target)``: the
    :class:`~rlhf_torchrl.collectors.RolloutCollector` for this worker's rows and what loads pushed
    weights (anything with ``load_weights(pairs)``)."""

    def __init__(self, factory: Callable, rank: int, world_size: int, num_threads: int | None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.collector, self.target = factory(rank, world_size)
        self.batches = iter(self.collector)

    def next(self) -> TensorDict:
        return next(self.batches).cpu()

    def load_weights(self, state: dict) -> None:
        self.target.load_weights(state.items())

    def shutdown(self) -> None:
        self.collector.shutdown()


class RayCollector:
    """``num_workers`` Ray actors, each running ``factory(rank, num_workers)``; iterating yields
    the global batch (worker rollouts concatenated, padded to common widths, on ``device``).

    ``load_weights(pairs)`` broadcasts weights (one ``ray.put``; every worker loads, in parallel),
    so a :class:`~rlhf_torchrl.collectors.WeightSync` can target it, and
    :class:`~rlhf_torchrl.collectors.asynchronous.AsyncCollector` can run it ahead of training.

    Args:
        factory: ``(rank, world_size) -> (collector, weights target)``, run in each actor; must be
            picklable by Ray (a module-level function or a ``functools.partial`` of one).
        num_workers: the number of actors.
        pad_token_id: pads the workers' rollouts to common widths.
        num_cpus: CPUs each actor reserves.
        num_gpus: GPUs each actor reserves (a GPU of its own for a vLLM engine: sampling on other
            GPUs than training).
        device: where the global batch is moved (None: left where it is gathered).
        shutdown_ray: :meth:`shutdown` also disconnects from Ray (for the one who started it).
    """

    def __init__(self, factory: Callable, num_workers: int, *, pad_token_id: int,
                 num_cpus: float = 1, num_gpus: float = 0, device: torch.device | str | None = None,
                 shutdown_ray: bool = False):
        import ray

        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}.")
        if not ray.is_initialized():
            raise RuntimeError("RayCollector needs a Ray cluster: call ray.init(...) first.")
        actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_Worker)
        threads = max(1, int(num_cpus)) if not num_gpus else None
        self.workers = [actor.remote(factory, rank, num_workers, threads)
                        for rank in range(num_workers)]
        self.pad_token_id, self.device, self.shutdown_ray = pad_token_id, device, shutdown_ray
        self.sampler = None  # the workers record the log-probs; nothing to drive locally

    def __iter__(self) -> Iterator[TensorDict]:
        import ray

        while True:
            parts = ray.get([w.next.remote() for w in self.workers])
            rollout = concat_rollouts(parts, self.pad_token_id)
            yield rollout if self.device is None else rollout.to(self.device)

    def load_weights(self, weights) -> None:
        import ray

        state = {name: t.detach().cpu() for name, t in weights}
        ref = ray.put(state)
        ray.get([w.load_weights.remote(ref) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)
        if self.shutdown_ray:
            ray.shutdown()
