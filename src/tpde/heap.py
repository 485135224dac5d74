"""Process memory: decode buffers, and freed heap pages handed back.

glibc raises its mmap threshold to the size of the large blocks a program frees and keeps
later blocks below that size in its heaps, where freed ones stay resident. Encodes and decodes
free many such blocks; these tools keep what the process holds near what it uses.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np


def _malloc_trim() -> Any:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to ask (Windows): nothing to trim
        return None


_MALLOC_TRIM = _malloc_trim()


def return_freed_memory() -> None:
    """Hand heap pages freed by an encode or a decode back to the OS.

    Without this a long run's writer holds several states' worth of idle memory (measured over
    20 saves of a 46 MB bf16 state: about 550 MB, 110 MB with it).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def in_heap(nbytes: int) -> np.ndarray:
    """A decode's bytes from the heap, where the next decode finds them already faulted in (a
    fresh map's pages cost a fault each: 16 ms for 47 MB here).

    A memory-first decode (a mount at budget 0) took its buffers from maps of their own, given
    back to the system as each was freed, and trimmed the heap after every module: a forward of
    MiniLM mounted at its keyframe took 116-120 ms, faulting its tensors' fresh pages in each
    time. From the heap, trimmed as ``freed`` says, it takes 58-70 ms (two deltas deep: 227-238
    against 117-154), for up to 4 MB more at the peak (``benchmarks/mount_memory.py``).
    """
    return np.empty(nbytes, dtype=np.uint8)


#: Bytes a memory-first decode frees between two trims of the heap (``freed``). Per forward of
#: MiniLM at budget 0, trimmed every 8 / 16 / 32 MiB: 64 / 58 / 53 ms; a small bf16 model's
#: peak rose 12 / 12-15 / 11-23 MiB over its forward, against 24 for a dense load.
TRIM_EVERY_BYTES = 16 << 20
_freed = 0
_freed_lock = threading.Lock()


def freed(nbytes: int) -> None:
    """Count ``nbytes`` that a memory-first decode let go, and trim the heap once they add up to
    ``TRIM_EVERY_BYTES``: trimming after each module handed back the pages the next one was
    about to fault in again."""
    global _freed
    with _freed_lock:
        _freed += nbytes
        if _freed < TRIM_EVERY_BYTES:
            return
        _freed = 0
    return_freed_memory()
