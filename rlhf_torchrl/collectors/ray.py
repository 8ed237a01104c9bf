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

A worker that dies (killed, out of memory, its node lost) or does not answer within ``timeout``
seconds is replaced: a fresh actor from the same factory, started at the batch the dead one was
asked for and loaded with the last pushed weights, is asked again; its rows are those the dead
one would have sampled. Ray's own actor restarts (``max_restarts``) cannot do this: they rerun the
constructor with its first arguments, the first batch and the initial weights. After
``restarts`` replacements the run stops with one line (:class:`~rlhf_torchrl.errors.SamplerError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict

from rlhf_torchrl.data.rollout import concat_rollouts
from rlhf_torchrl.errors import ConfigError, SamplerError

log = logging.getLogger(__name__)


class _Worker:
    """The Ray actor: ``factory(rank, world_size, start_batch)`` returns ``(collector, target)``:
    the :class:`~rlhf_torchrl.collectors.RolloutCollector` for this worker's rows from batch
    ``start_batch`` on, and what loads pushed weights (anything with ``load_weights(pairs)``). A
    replacement worker starts with ``weights``, the last pushed."""

    def __init__(self, factory: Callable, rank: int, world_size: int, num_threads: int | None,
                 start_batch: int = 0, weights: dict | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.collector, self.target = factory(rank, world_size, start_batch)
        if weights is not None:
            self.target.load_weights(weights.items())
        self.batches = iter(self.collector)

    def next(self) -> TensorDict:
        return next(self.batches).cpu()

    def load_weights(self, state: dict) -> None:
        self.target.load_weights(state.items())

    def shutdown(self) -> None:
        self.collector.shutdown()


class RayCollector:
    """``num_workers`` Ray actors, each running ``factory(rank, num_workers, start_batch)``;
    iterating yields the global batch (worker rollouts concatenated, padded to common widths, on
    ``device``).

    ``load_weights(pairs)`` broadcasts weights (one ``ray.put``; every worker loads, in parallel),
    so a :class:`~rlhf_torchrl.collectors.WeightSync` can target it, and
    :class:`~rlhf_torchrl.collectors.asynchronous.AsyncCollector` can run it ahead of training.
    Every wait on a worker has a deadline (``timeout``); a worker that died or missed it is
    replaced at the same batch with the last pushed weights, ``restarts`` times in all.

    Args:
        factory: ``(rank, world_size, start_batch) -> (collector, weights target)``, run in each
            actor; must be picklable by Ray (a module-level function or a ``functools.partial``
            of one).
        num_workers: the number of actors.
        pad_token_id: pads the workers' rollouts to common widths.
        start_batch: the first global batch (a resumed run).
        restarts: workers replaced over the run (died or hung) before the run stops with
            :class:`~rlhf_torchrl.errors.SamplerError`.
        timeout: seconds a worker may take to answer one call (start-up and a batch, or a weight
            load) before it counts as hung.
        num_cpus: CPUs each actor reserves.
        num_gpus: GPUs each actor reserves (a GPU of its own for a vLLM engine: sampling on other
            GPUs than training).
        device: where the global batch is moved (None: left where it is gathered).
        shutdown_ray: :meth:`shutdown` also disconnects from Ray (for the one who started it).
    """

    def __init__(self, factory: Callable, num_workers: int, *, pad_token_id: int,
                 start_batch: int = 0, restarts: int = 3, timeout: float = 1800.0,
                 num_cpus: float = 1, num_gpus: float = 0, device: torch.device | str | None = None,
                 shutdown_ray: bool = False):
        import ray

        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}.")
        if not ray.is_initialized():
            raise RuntimeError("RayCollector needs a Ray cluster: call ray.init(...) first.")
        self.actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_Worker)
        self.factory, self.num_workers = factory, num_workers
        self.threads = max(1, int(num_cpus)) if not num_gpus else None
        self.batch = start_batch  # the global batch asked for next: where a replacement starts
        self.weights = None  # the last pushed weights' object ref: what a replacement loads
        self.restarts, self.restarts_left, self.timeout = restarts, restarts, timeout
        self.workers = [self._start(rank) for rank in range(num_workers)]
        self.pad_token_id, self.device, self.shutdown_ray = pad_token_id, device, shutdown_ray
        self.sampler = None  # the workers record the log-probs; nothing to drive locally

    def _start(self, rank: int):
        return self.actor.remote(self.factory, rank, self.num_workers, self.threads, self.batch,
                                 self.weights)

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            parts = self._ask("next")
            self.batch += 1
            rollout = concat_rollouts(parts, self.pad_token_id)
            yield rollout if self.device is None else rollout.to(self.device)

    def load_weights(self, weights) -> None:
        import ray

        state = {name: t.detach().cpu() for name, t in weights}
        self.weights = ray.put(state)  # kept until the next push: a replacement worker loads it
        self._ask("load_weights", self.weights)

    def _ask(self, method: str, *args) -> list:
        """Every worker's answer to ``method(*args)``, in rank order. The workers run at once;
        one that died, or did not answer within ``timeout`` seconds, is replaced and asked again
        (the others' answers stand: each has already sampled its rows)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        calls = [getattr(w, method).remote(*args) for w in self.workers]
        answers = []
        for rank, call in enumerate(calls):
            while True:
                try:
                    answers.append(ray.get(call, timeout=self.timeout))
                    break
                except (RayActorError, GetTimeoutError) as error:
                    self._replace(rank, error, method)
                    call = getattr(self.workers[rank], method).remote(*args)
        return answers

    def _replace(self, rank: int, error: Exception, method: str) -> None:
        """A fresh actor for ``rank`` at batch ``self.batch`` with the last pushed weights, or
        :class:`SamplerError` once ``restarts`` are spent."""
        import ray
        from ray.exceptions import GetTimeoutError

        what = (f"did not answer within {self.timeout:g} s" if isinstance(error, GetTimeoutError)
                else f"died ({type(error).__name__})")
        doing = f"sampling batch {self.batch + 1}" if method == "next" else "loading weights"
        if self.restarts_left <= 0:
            for w in self.workers:  # the run ends: no actor left holding the cluster's CPUs
                ray.kill(w)
            raise SamplerError(
                f"Ray worker {rank} {what} while {doing}, and "
                f"collection.worker_restarts={self.restarts} restarts are spent: the run stops "
                "here, its checkpoints intact; resume=auto continues from the newest.") from error
        self.restarts_left -= 1
        log.warning("Ray worker %d %s while %s: a new one takes its place at batch %d with the "
                    "last pushed weights (restarts left: %d).", rank, what, doing, self.batch + 1,
                    self.restarts_left)
        ray.kill(self.workers[rank], no_restart=True)  # a hung one stops; a dead one stays dead
        self.workers[rank] = self._start(rank)

    def shutdown(self) -> None:
        import ray

        # a worker that died or hangs does not hold the shutdown up
        ray.wait([w.shutdown.remote() for w in self.workers], num_returns=self.num_workers,
                 timeout=self.timeout)
        for w in self.workers:
            ray.kill(w)
        if self.shutdown_ray:
            ray.shutdown()
