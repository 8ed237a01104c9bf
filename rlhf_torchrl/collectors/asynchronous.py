"""Asynchronous collection: the next batches are generated while the trainer updates on this one.

As in Asynchronous RLHF (Noukhovitch et al. 2024), open-instruct, OpenRLHF and verl, generation
and training overlap, and the price is staleness: with ``overlap`` N, batch k is sampled by the
policy after k - N updates while the trainer, at k updates, uses it. Each row records the version
that sampled it (``"policy_version"``), so the recipe logs the staleness and PPO's old log-probs can be the behaviour policy's (recorded while sampling) or
the trainer's, corrected by truncated importance sampling (``ppo.tis_cap``).

``overlap=0`` waits for the weights of update k before sampling batch k: the synchronous run,
token for token (each row has its own random stream, so where it is drawn does not matter).
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tensordict import TensorDict
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError


class AsyncCollector:
    """Runs ``collector`` in a background thread, ``overlap`` policy versions behind the trainer.

    ``update_weights(version)`` is the trainer's call after each update: it pushes the weights with
    ``weight_sync`` between two batches, never during one. Batch k is sampled by exactly version
    ``max(0, k - overlap)``: the thread waits for that version, and a push waits until the batches
    the older version still owes are sampled. Staleness is therefore fixed, not a matter of timing,
    and a run is reproducible. The rows of each batch get ``"policy_version"`` (B,) int64 and
    ``"sampling_seconds"`` (B,) float64, the time the batch took to sample.

    Resume: :meth:`pending` (after ``update_weights(v)``) returns the batches already sampled for
    the trainer's next iterations, by versions older than ``v``; a collector rebuilt with
    ``start_version=v`` and those ``pending`` batches, around a collector that starts at the batch
    after them, continues exactly as this one would have.

    Args:
        collector (Iterable): the collector run in the thread (a
            :class:`~rlhf_torchrl.collectors.RolloutCollector`, a Ray or vLLM one).
        weight_sync (rlhf_torchrl.collectors.WeightSync | None): pushes the trainer's weights to
            the sampler; None when the sampler reads the trained model itself, which is safe only
            with ``overlap=0``.
        overlap: policy versions the sampler runs behind the trainer (batch ``k`` is sampled by
            version ``max(0, k - overlap)``).
        start_version: the trainer's updates done when this collector starts (a resumed run).
        pending: the batches a previous collector had sampled ahead (:meth:`pending`), served
            first.

    Example:
        >>> collector = AsyncCollector(RolloutCollector(...), WeightSync(policy, engine), overlap=1)
        >>> for k, rollout in enumerate(collector):  # batch k + 1 is sampled meanwhile
        ...     update(rollout)
        ...     collector.update_weights(k + 1)
    """

    def __init__(self, collector, weight_sync=None, *, overlap: int = 1, start_version: int = 0,
                 pending: Sequence[TensorDict] = ()):
        if overlap < 0:
            raise ConfigError(f"overlap must be >= 0, got {overlap}.")
        self.collector, self.weight_sync, self.overlap = collector, weight_sync, overlap
        self.version = start_version  # of the weights the sampler holds
        self._first = start_version + len(pending)  # index of the first batch sampled here
        self._sampled = self._first  # batches sampled so far (the pending ones included)
        self._turn = threading.Condition()  # held while a batch is sampled or weights are pushed
        self._queue: queue.Queue = queue.Queue()
        for rollout in pending:
            self._queue.put(rollout)
        self._thread: threading.Thread | None = None
        self._stop = self._done = False

    @property
    def sampler(self):
        return self.collector.sampler

    def __iter__(self) -> Iterator[TensorDict]:
        if self._thread is not None:
            raise RuntimeError("AsyncCollector can be iterated once.")
        self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
        self._thread.start()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _produce(self) -> None:
        try:
            batches = iter(self.collector)
            for k in itertools.count(self._first):
                with self._turn:
                    self._turn.wait_for(lambda k=k: self._stop or self.version >= k - self.overlap)
                    if self._stop:
                        break
                    start = time.perf_counter()
                    rollout = next(batches, None)
                    if rollout is None:
                        break
                    rollout.set(K.POLICY_VERSION, torch.full(
                        rollout.shape, self.version, dtype=torch.long, device=rollout.device))
                    rollout.set(K.SAMPLING_SECONDS, torch.full(
                        rollout.shape, time.perf_counter() - start, dtype=torch.float64,
                        device=rollout.device))
                    self._queue.put(rollout)  # queued and counted together: see pending()
                    self._sampled += 1
                    self._turn.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
            self._queue.put(e)
        finally:
            with self._turn:
                self._done = True
                self._turn.notify_all()
            self._queue.put(None)

    def update_weights(self, version: int) -> float:
        """Push the trainer's weights (``version`` = updates done) once every batch the previous
        version owes is sampled; returns the seconds the push took (0 without a weight sync).

        Args:
            version: the trainer's updates done.
        """
        with self._turn:
            self._turn.wait_for(lambda: self._done or self._sampled >= version + self.overlap)
            seconds = self.weight_sync(version) if self.weight_sync is not None else 0.0
            self.version = version
            self._turn.notify_all()
        return seconds

    @contextmanager
    def paused(self):
        """No batch is sampled inside the block: the one under way finishes first. For whatever
        else uses the sampling model meanwhile (a held-out evaluation with the live policy, a
        checkpoint of its shards).

        Where the sampler runs the trained model itself (no ``weight_sync``: ``overlap=0``), the
        block also waits until the batches the current weights owe are sampled. Under FSDP2 the
        sampler's forwards are collectives, and so is the block's work (a sharded checkpoint, an
        evaluation): every process must run them in the same order, never interleaved from two
        threads. Without this wait one process could enter the block before its sampler starts
        the batch while another's sampler is already in it, and both would wait for each other.
        """
        with self._turn:
            if self.weight_sync is None:
                self._turn.wait_for(lambda: self._done or self._stop
                                    or self._sampled > self.version + self.overlap)
            yield

    def pending(self) -> list[TensorDict]:
        """The sampled batches the trainer has not taken yet, sampled by versions older than the
        current one (after ``update_weights``: exactly ``overlap`` batches). A batch the current
        version has sampled is left out: a resumed run samples it again, identically."""
        with self._queue.mutex:  # self.version changes only in the caller's thread
            queued = list(self._queue.queue)
        rollouts = [r for r in queued if isinstance(r, TensorDict)]
        return [r for r in rollouts if int(r.get(K.POLICY_VERSION)[0]) < self.version]

    def shutdown(self) -> None:
        with self._turn:
            self._stop = True
            self._turn.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.collector.shutdown()


class ModelCopy:
    """A copy of the policy that samples while the trainer updates the original (asynchronous
    collection with the transformers backend); ``load_weights`` takes
    :func:`~rlhf_torchrl.collectors.engine_weights` pairs. A PEFT policy is copied merged (the
    copy has no adapters).

    Args:
        model: the policy to copy.
        copy_model: copy it (False: adopt ``model`` itself, a Ray worker's own).
    """

    def __init__(self, model: nn.Module, copy_model: bool = True):
        from rlhf_torchrl.modules.lora import is_peft

        model = copy.deepcopy(model) if copy_model else model
        self.model = (model.merge_and_unload() if is_peft(model) else model).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        own = self.model.state_dict()
        for name, tensor in weights:
            own[name].copy_(tensor)
