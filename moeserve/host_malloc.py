"""Keep freed host memory in the process instead of handing it back to the kernel (glibc malloc).

glibc serves every allocation above its mmap threshold (128 KiB, rising by itself to at most 32 MiB) with
a fresh mmap and unmaps it on free, and trims the heap's free top back to the kernel. A step makes the same
large temporaries again and again (a prefill's gathered expert rows, GEMM outputs, logits), and those above
32 MiB page-fault their memory back in every time, a fault per 4 KiB page plus zeroing it. Measured on the
V3-shaped checkpoint of benchmarks/decode_speed.py (one thread, a 4096-token prefill step of 32 x 128-token
prompts, fresh processes alternating): BF16 1300 -> 1580 tok/s (~400 000 -> ~20 000 minor faults a step),
A8W8 1325 -> 1500; a 1024-token step (its temporaries stay below 32 MiB) unchanged. A DeepSeek-V3 layer's
[tokens x top-8, 7168] BF16 rows pass 32 MiB from ~300 tokens.

keep_freed_memory() raises both thresholds once per process, the way PyTorch's CUDA caching allocator keeps
device memory: the process holds on to its peak host memory instead of returning it. Not done where the
process already chose its allocator: MOESERVE_MALLOC_TUNING=0, a MALLOC_*_ environment variable of glibc's,
or jemalloc / tcmalloc in LD_PRELOAD. Not glibc (musl, macOS): nothing to do.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to 1 GiB come from the heap and stay there when freed; larger ones (weights loaded whole,
# a KV pool) are still mapped on their own. mallopt takes an int: the trim threshold is its largest value.
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1

_OWN_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether they are raised now."""
    global _done
    if _done is not None:
        return _done
    _done = False
    reason = _skip_reason()
    if reason:
        logger.debug("host malloc tuning off: %s", reason)
        return False
    libc = _glibc()
    if libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        logger.warning("glibc refused the malloc thresholds; freed host memory keeps going back to the kernel")
        return False
    _done = True
    return True


def _skip_reason() -> str | None:
    if os.environ.get("MOESERVE_MALLOC_TUNING", "1") == "0":
        return "MOESERVE_MALLOC_TUNING=0"
    for name in _OWN_ALLOCATOR_ENV:
        if name in os.environ:
            return f"{name} is set"
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload:
        return "an allocator is preloaded"
    return None


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has mallopt as a stub)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
