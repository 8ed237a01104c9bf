"""Data-parallel PPO under ``torchrun``: DDP or FSDP2, and a world-size invariant batch.

``torchrun --nproc_per_node=N recipes/ppo.py`` starts N processes; :func:`init_data_parallel`
joins them (gloo on CPU, NCCL on CUDA) and returns this process's :class:`DataParallel`. One
iteration then runs as follows:

1. every process shuffles the same global batches of prompts; process ``r`` generates and scores
   its contiguous ``batch_size / N`` rows (:func:`~rlhf_torchrl.collectors.make_generation_env`),
   each row drawn from its own random stream seeded by (seed, batch, global row index), so a row's
   response does not depend on which process drew it;
2. each process computes the old, reference and value estimates of its rows;
3. :meth:`DataParallel.gather_rollout` all-gathers the tensors of the rollout (a few integers and
   floats per token): every process now holds the global batch, and the KL rewards, GAE, advantage
   whitening, the KL controller and every logged metric are computed on it, identically everywhere;
4. the PPO update draws the same minibatches everywhere; process ``r`` runs the ``r``-th slice of
   each (``balance``: the ``r``-th of sets of rows of near-equal real tokens), its gradients
   averaged across processes by DDP (``DistributedDataParallel`` around the loss) or by FSDP2
   (``fully_shard`` on every decoder layer and on each model) once per minibatch.

The result equals one process on the same global batch, up to float rounding
(``tests/test_distributed.py`` runs both with gloo and compares them). Only rank 0 prints, logs and
saves; FSDP2 models are saved from a full state dict gathered to rank 0.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import weakref
from contextlib import contextmanager, nullcontext

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2")
#: ``distributed.balance``: equal slices, rows balanced by real tokens, or balanced where the
#: update's micro-batches count real tokens (packed or under a token budget), the default: there it
#: measured faster, with equal row slices of a padded batch not (benchmarks/README.md, balance)
BALANCE_CHOICES = (False, True, "auto")
BALANCE = "auto"


class DataParallel:
    """This process's place in a data-parallel run and the collectives the pipeline needs.

    ``DataParallel()`` is the single process: every collective is the identity. Built by
    :func:`init_data_parallel` under torchrun; :meth:`shard` (FSDP2, before the optimiser is built)
    and :meth:`wrap_loss` (DDP) attach the training engine.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        local_rank: this process's rank on its machine (its GPU).
        strategy: ``ddp`` or ``fsdp2``.
        device: this process's device (None: the CPU).
        balance: the PPO update gives each process rows of near-equal real tokens rather than
            equal slices of each minibatch
            (:func:`~rlhf_torchrl.trainers.micro_batches.micro_batches`): the same loss, less
            waiting on the process with the longest rows. ``"auto"``: where its micro-batches
            count real tokens (packed, or under a token budget), or a process's padded rows make
            several micro-batches (gradient accumulation).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 strategy: str = "ddp", device: torch.device | None = None,
                 balance: bool | str = BALANCE):
        if strategy not in STRATEGIES:
            raise ConfigError(f"Unknown distributed.strategy {strategy!r}: choose one of {STRATEGIES}.")
        if balance not in BALANCE_CHOICES:
            raise ConfigError(f"Unknown distributed.balance {balance!r}: choose one of {BALANCE_CHOICES}.")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.strategy, self.balance = strategy, balance
        self.device = device or torch.device("cpu")
        self._ddp = None
        self._sharded: list[nn.Module] = []
        self._one_process_group = False  # torchrun with one process and FSDP2

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the models: under torchrun with ``strategy="fsdp2"``, one process
        included (a mesh of one: the same engine, its casts and hooks, on a single GPU)."""
        return self.strategy == "fsdp2" and (self.enabled or self._one_process_group)

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) of ``tensor`` over processes, as a new tensor on its device.

        Args:
            tensor: this process's value.
            op: ``"sum"`` or ``"max"``.
        """
        out = tensor.clone()
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out

    def max_int(self, value: int) -> int:
        """The largest ``value`` over processes.

        Args:
            value: this process's value.
        """
        if not self.enabled:
            return value
        return int(self.all_reduce(torch.tensor([value], device=self._comm_device()), "max"))

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def gather_rollout(self, rollout: TensorDictBase, pad_token_id: int) -> TensorDictBase:
        """The global batch: every process's rows of ``rollout``, in rank order, on every process.

        Tensor entries only (text and dataset fields stay with the process that scored them). Prompt
        entries are left-padded and response entries right-padded to the widest process's widths
        first (pad token for tokens, False for masks, 0 otherwise), the layout one process
        collecting the whole batch would have produced. Single process: ``rollout`` itself.

        Args:
            rollout: this process's rows.
            pad_token_id: pads the token entries.
        """
        if not self.enabled:
            return rollout
        import torch.distributed as dist

        from rlhf_torchrl.data.rollout import pad_rollout

        widths = torch.tensor([rollout.get(K.PROMPT_MASK).shape[1], rollout.get(K.RESPONSE_MASK).shape[1]],
                              device=self._comm_device())
        p_width, r_width = self.all_reduce(widths, "max").tolist()
        rollout = pad_rollout(rollout, p_width, r_width, pad_token_id)
        out = {}
        for key, value in rollout.items(True, True):
            if not isinstance(value, torch.Tensor):
                continue
            dtype = value.dtype
            send = (value.to(torch.uint8) if dtype == torch.bool else value).contiguous()
            send = send.to(self._comm_device())
            parts = [torch.empty_like(send) for _ in range(self.world_size)]
            dist.all_gather(parts, send)
            out[key] = torch.cat(parts).to(device=value.device, dtype=dtype)
        return TensorDict(out, batch_size=[rollout.shape[0] * self.world_size])

    # ---- training engines ------------------------------------------------------------------
    def shard(self, *models: nn.Module | None, mixed_precision: torch.dtype | None = None) -> None:
        """FSDP2: ``fully_shard`` every decoder layer (the model's ``_no_split_modules``) and then
        each model, so its parameters, gradients and optimiser state are split across processes.
        Call before building the optimiser. No-op with DDP or one process.

        Each model must be called with tensors (a Hugging Face model, a value head): FSDP2 finds
        the tensors of a call's inputs and outputs to hook its backward pass, and a module called
        with a TensorDict (a ``TensorDictModule``) silently trains on unreduced gradients. Shard
        :class:`~rlhf_torchrl.modules.TokenCritic` through its ``modules_to_shard()``.

        Args:
            *models: the models to shard (None entries skipped).
            mixed_precision: (bf16/fp16) parameters all-gathered and computed in that dtype,
                gradients reduced in fp32, fp32 master weights kept sharded; None: fp32.
        """
        if not self.fsdp:
            return
        from tensordict.nn import TensorDictModuleBase

        for model in models:
            if isinstance(model, TensorDictModuleBase):
                raise TypeError(
                    f"{type(model).__name__} is called with a TensorDict: FSDP2 cannot hook its "
                    "backward pass. Shard the tensor-level modules inside it (for a TokenCritic: "
                    "critic.modules_to_shard())."
                )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kwargs = {"mesh": mesh}
        if mixed_precision is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision,
                                                       reduce_dtype=torch.float32)
        for model in models:
            if model is None or model in self._sharded:
                continue
            names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
            for module in list(model.modules()):
                if module is not model and type(module).__name__ in names:
                    fully_shard(module, **kwargs)
            fully_shard(model, **kwargs)
            self._sharded.append(model)

    def wrap_loss(self, loss_module: nn.Module) -> None:
        """DDP: wrap the loss (policy, critic and value head inside) in ``DistributedDataParallel``,
        whose gradient hooks average the gradients across processes. No-op with FSDP2 or one
        process.

        Args:
            loss_module: the PPO loss, wrapped in place.
        """
        if not self.enabled or self.fsdp:
            return
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # the models' buffers (rotary frequencies) are the same everywhere and never change:
        # broadcast once as the wrapper is built, never before a forward (torch 2.13's setting;
        # broadcast_buffers=False, which also skipped the first, warns there)
        no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers"
                           in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})
        self._ddp = DistributedDataParallel(_LossCall(loss_module), device_ids=device_ids,
                                            **no_forward_sync)

    def loss(self, loss_module: nn.Module, td: TensorDictBase) -> TensorDictBase:
        """``loss_module(td)``, through the DDP wrapper when there is one.

        Args:
            loss_module: the PPO loss.
            td: a micro-batch.
        """
        return self._ddp(td) if self._ddp is not None else loss_module(td)

    @contextmanager
    def accumulate(self, last: bool):
        """Gradients of the micro-batches before the ``last`` of a minibatch stay local; the last
        one's backward averages the sum across processes (DDP ``no_sync``; FSDP2
        ``set_requires_gradient_sync``).

        Args:
            last: this is the minibatch's last micro-batch.
        """
        if self._ddp is not None:
            with nullcontext() if last else self._ddp.no_sync():
                yield
            return
        for model in self._sharded:
            if any(p.requires_grad for p in model.parameters()):
                model.set_requires_gradient_sync(last)
        yield

    def generate_kwargs(self) -> dict:
        """``generate`` arguments a data-parallel process needs: with FSDP2 every forward is a
        collective, so a process whose rows have all stopped keeps stepping until all have
        (transformers' ``synced_gpus``; transformers 5 also switches it on by itself for a model
        it sees is FSDP-managed, this states it rather than relying on the detection)."""
        return {"synced_gpus": True} if self.fsdp else {}

    def full_state_dict(self, model: nn.Module) -> dict | None:
        """The full state dict of an FSDP2-sharded ``model`` on rank 0 (on the CPU), gathered from
        the shards (a collective: call it on every process); None on other ranks and for a model
        that is not sharded (its own ``state_dict()`` is whole: ``save_pretrained`` reads it).

        Args:
            model: the model.
        """
        if self.fsdp and model in self._sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
            if not self.is_main:
                return None
            # tied weights (lm_head = embeddings) come back as copies: keep the first name only
            seen, tied = set(), set()
            for name, param in model.named_parameters(remove_duplicate=False):
                if id(param) in seen:
                    tied.add(name)
                seen.add(id(param))
            return {k: v for k, v in state.items() if k not in tied}
        return None

    def shutdown(self) -> None:
        """Drop the DDP wrapper, then end the process group and free it here, with the GIL
        released.

        DDP's reducer must not be what frees the group: it is freed holding the GIL, and the
        group's destructor waits for gloo's threads, one of which may still need the GIL to
        release the last collective's tensors; the process then hangs forever (one torchrun job
        in ten on two busy cores; ``tests/test_distributed.py``). The group's own Python handle
        releases the GIL as it frees it. Where the wrapper outlives this (a traceback holding
        it), the handle is kept in :data:`_ENDED_GROUPS` until the next group ends or the
        process exits.
        """
        wrapper = None if self._ddp is None else weakref.ref(self._ddp)
        self._ddp = None
        if (self.enabled or self._one_process_group) and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD
            torch.distributed.destroy_process_group()
            _ENDED_GROUPS[:] = [group] if wrapper is not None and wrapper() is not None else []
            del group  # freed here unless kept: its destructor releases the GIL


class _LossCall(nn.Module):
    """The loss module as the one ``forward`` DDP wraps (its parameters: policy, critic, head)."""

    def __init__(self, loss_module: nn.Module):
        super().__init__()
        self.loss_module = loss_module

    def forward(self, td):
        return self.loss_module(td)


#: a process group :meth:`DataParallel.shutdown` ended while its DDP wrapper lived on; let go at
#: exit, before the interpreter winds down (a group freed while it finalises may need a GIL no
#: thread can take)
_ENDED_GROUPS: list[torch.distributed.ProcessGroup] = []
atexit.register(_ENDED_GROUPS.clear)

#: what gloo says when the other end of a collective has gone (its process died or was killed)
_GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "Socket closed")


class PeerLost(RuntimeError):
    """Another process of the job died mid-run; the message is :func:`lost_peer`'s line."""


def lost_peer(error: BaseException) -> str | None:
    """One line for an error that says another process of the job is gone (a collective's peer
    died: gloo's connection reset, NCCL's ``DistBackendError``), or None for any other error.

    torchrun then stops the job's other processes; this process's own traceback would only point
    at whichever collective it was in, so the command prints this line instead."""
    import torch.distributed as dist

    # (read from torchrun's environment: by now the run's ``finally`` may have ended the group)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world <= 1 or not dist.is_available():
        return None
    message = str(error)
    if not (isinstance(error, dist.DistError)
            or isinstance(error, RuntimeError) and any(m in message for m in _GLOO_PEER_GONE)):
        return None
    # gloo's "[file:line] Connection reset by peer [address]. This is typically ..." -> the middle
    first = next((line.strip() for line in message.splitlines() if line.strip()), type(error).__name__)
    first = first.split("] ", 1)[-1].split(". ", 1)[0]
    return (f"process {rank} of {world} lost another process of the job "
            f"({first[:160]}): the job stops here. Its checkpoints are whole (each is written to a "
            "temporary folder, then renamed); run the same command again and resume=auto "
            "continues from the newest.")


def init_data_parallel(strategy: str = "ddp", device: torch.device | None = None,
                       backend: str | None = None, balance: bool | str = BALANCE) -> DataParallel:
    """Join the process group torchrun set up (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``...), or return the single process when there is none.

    Args:
        strategy: ``ddp`` or ``fsdp2``.
        device: this process's device (None: the CPU).
        backend: the process group's backend (None: NCCL for CUDA devices, gloo for the CPU).
        balance: rows of near-equal real tokens per process in the update: True, False or
            ``"auto"`` (:class:`DataParallel`).
    """
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = device or torch.device("cpu")
    # one process runs FSDP2 only when torchrun started it (a group of one to shard over)
    if world <= 1 and not (strategy == "fsdp2" and "RANK" in os.environ):
        return DataParallel(strategy=strategy, device=device, balance=balance)
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda" and device.index is None:  # this process's GPU
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or ("nccl" if device.type == "cuda" else "gloo"),
                                device_id=device if device.type == "cuda" else None)
    log.info("Process %d of %d (%s, %s%s)", rank, world, strategy, device,
             "" if world <= 1 or balance is False else ", update rows balanced by tokens"
             + (" where packed, under a token budget or accumulating" if balance == "auto" else ""))
    parallel = DataParallel(rank=rank, world_size=world, local_rank=local_rank, strategy=strategy,
                            device=device, balance=balance)
    parallel._one_process_group = world == 1
    return parallel
