"""Process-wide settings that make CPU training faster.

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
import sys

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
