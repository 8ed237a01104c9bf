"""Where and how the pipeline runs: devices, precision, and process-wide CPU settings.

:func:`resolve_device`, :func:`native_bf16`, :func:`autocast` and :func:`placed` are the device and
precision helpers every phase uses.

PyTorch on CPU allocates and frees tensors of the vocabulary's size (logits, their gradients) at
every forward and backward. glibc serves blocks above its mmap threshold (at most 32 MB unless
told otherwise) with fresh ``mmap`` pages and unmaps them when freed, so every such tensor costs
one page fault per 4 KB page when first written: tens of milliseconds per 100 MB, as much as the
arithmetic on it. :func:`reuse_freed_memory` raises the threshold and stops trimming, so freed
blocks stay in the heap and are reused without faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Serve CPU allocations up to 2 GB from glibc's heap and keep freed memory for reuse.

    Process-wide and permanent: resident memory then stays at its peak instead of shrinking
    between steps (the peak itself is unchanged). Returns True when applied, False where the C
    library is not glibc (macOS, musl, Windows): nothing is changed there.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, _INT_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    log.debug("reuse_freed_memory: %s", "applied" if applied else "refused by the C library")
    return applied


def _busy_ticks(cpus: set[int], stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over ``cpus`` since boot, from ``stat`` (``/proc/stat``).

    Busy counts user, system, irq, softirq and steal time; nice time (processes that yield to
    normal-priority work) and idle/iowait count as free.
    """
    try:
        with open(stat) as f:
            lines = f.readlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
        busy += user + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return (busy, total) if total else None


class ThreadTuner:
    """Keeps torch's intra-op threads to the cores that other processes leave free.

    A torch CPU op splits its work over its OpenMP threads and waits for the slowest; OpenMP
    threads spin while they wait. With as many threads as cores and another busy process on one
    of them, one thread is descheduled and the others spin at every barrier: a PPO iteration on 2
    cores took 45 s instead of 16 s beside one busy process. :meth:`update` measures, since its
    last call, how many cores other processes kept busy (``/proc/stat`` over the cores this
    process may run on, minus this process's own CPU time; niced processes count as free, since
    they yield), and sets ``torch.set_num_threads`` to the cores left, between ``1`` and
    ``max_threads`` (torch's default, i.e. ``OMP_NUM_THREADS`` or the core count). Call it between
    iterations. Where ``/proc/stat`` is missing (not Linux), it keeps ``max_threads``.

    Args:
        max_threads: the most threads (None: torch's default, ``OMP_NUM_THREADS`` or the core
            count).
        adapt: follow the free cores (False: keep ``max_threads``).
        stat: the kernel's CPU statistics file (a test gives a fixed one).
        cpus: the cores this process may run on (None: its affinity).
        cpu_time: this process's CPU seconds so far.

    Example:
        >>> tuner = ThreadTuner()
        >>> for batch in batches:
        ...     tuner.update()  # threads for this iteration
    """

    def __init__(self, max_threads: int | None = None, adapt: bool = True, *,
                 stat: str = "/proc/stat", cpus: set[int] | None = None,
                 cpu_time: Callable[[], float] = time.process_time):
        self.max_threads = max_threads or torch.get_num_threads()
        self.adapt, self.stat, self.cpu_time = adapt, stat, cpu_time
        if cpus is not None:
            self.cpus = set(cpus)
        else:
            try:
                self.cpus = os.sched_getaffinity(0)
            except AttributeError:  # not Linux
                self.cpus = set(range(os.cpu_count() or 1))
        self.threads = self.max_threads
        self._last = self._sample()

    def _sample(self):
        ticks = _busy_ticks(self.cpus, self.stat)
        return None if ticks is None else (*ticks, self.cpu_time())

    def others_busy(self) -> float | None:
        """Cores kept busy by other processes since the last call (None without ``/proc/stat``)."""
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        elapsed = (now[1] - last[1]) / len(self.cpus)  # wall ticks per core
        others = (now[0] - last[0]) - (now[2] - last[2]) * hz  # busy ticks not ours
        return max(0.0, others / elapsed)

    def update(self) -> int:
        """Set and return the thread count for the next stretch of work."""
        busy = self.others_busy() if self.adapt else None
        if busy is not None:
            free = len(self.cpus) - round(busy)
            self.threads = max(1, min(self.max_threads, free))
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on: ``None`` or ``"auto"`` picks CUDA when present (``cuda:LOCAL_RANK`` under
    torchrun), else the CPU; anything else is checked to exist.

    Args:
        device: None, ``"auto"``, or a device or its name.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device={device!r} is not a device: use cpu, cuda, cuda:N or auto.") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device} but torch sees no CUDA device: use device=cpu "
                             "(or auto), or install a CUDA build of torch.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device} but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible.")
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls in hardware: a CUDA GPU of compute capability 8.0 or
    later (Ampere on), or a CPU with AVX512-BF16 or AMX tiles (Cooper Lake, Sapphire Rapids on;
    Zen 4 on). Elsewhere bf16 is emulated and slower than fp32.

    Args:
        device: the device to ask about.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":  # torch's own CPU capability probes (the ones oneDNN dispatches on)
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return False


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device`` in ``dtype`` (bf16/fp16 matmuls over fp32 weights), or nothing
    when ``dtype`` is None.

    Args:
        device: the device the block runs on.
        dtype: ``torch.bfloat16`` or ``torch.float16`` (None: no autocast).
    """
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU for a module without any).

    Args:
        module: the module.
    """
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@contextmanager
def placed(module: nn.Module | None, device: torch.device, offload: bool = False):
    """Run a block with ``module`` on ``device``; with ``offload``, it lives on the CPU otherwise.

    Frozen models (reference, reward model) offloaded this way take device memory only during the
    phase that uses them.

    Args:
        module: the module (None: nothing done).
        device: where it runs during the block.
        offload: the module lives on the CPU and visits ``device`` for the block only (False: it
            is left where it is, on ``device`` already).
    """
    if module is None or not offload:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()


@contextmanager
def quiet_loading_bars():
    """transformers' loading bars (weights, GGUF dequantising) off while the library loads a
    model, in a run and in a Python session alike; the caller's setting comes back after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
