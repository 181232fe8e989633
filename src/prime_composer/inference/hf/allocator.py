"""Keep freed memory in the process for the next decode step instead of returning it to the kernel.

Why: glibc's ``malloc`` serves blocks above its mmap threshold (128 KiB, rising with use to at
most 32 MiB) with a fresh ``mmap`` and unmaps them on free, and trims the heap above its trim
threshold. A decode step allocates tensors of a few MB each time (logits, the sampler's float64
CDF: 16 x 49,152 x 8 bytes), so each step page-faults those megabytes in again: the sampler took
6.3 ms per step on SmolLM2, 2.8 ms with the thresholds raised (``docs/experiments.md``,
2026-12-04). vLLM's CPU backend gets the same from preloading tcmalloc.

``keep_freed_memory`` raises both thresholds once per process (Linux with glibc; elsewhere it does
nothing). The process then holds on to its peak heap size, which a server serving one model
reaches in its first requests anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold: blocks up to this come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap kept before trimming

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once); ``True`` when they are set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    _done = True
    logger.info("decode loop: malloc keeps freed blocks up to %d MiB in the heap", MMAP_THRESHOLD >> 20)
    return True
