"""Process memory: buffers kept out of the C heap, and freed heap pages handed back.

glibc raises its mmap threshold to the size of the large blocks a program frees and keeps
later blocks below that size in its heaps, where freed ones stay resident. Encodes and decodes
free many such blocks; these two tools keep what the process holds near what it uses.
"""

from __future__ import annotations

import ctypes
import mmap
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


_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)  # None on Windows: a plain anonymous map


def outside_heap(nbytes: int) -> np.ndarray:
    """``nbytes`` of memory mapped for this buffer alone, returned to the system as soon as
    the buffer is freed, whatever glibc's threshold has become: a memory-first decode's
    buffers, made this way, never stay resident once freed (measured on a mount at budget 0:
    7 MB less for an 8 MB tensor).

    Private, not Python's default shared map: the first write to each page is what a fresh
    buffer costs, and 47 MB took 25 ms to fault in shared, 16 ms private. (Advised into huge
    pages, 2.4 ms alone, but a restore that faulted 200 MB so took 51-287 ms where it takes
    74-95 ms in small pages: the kernel compacts memory to find them.)
    """
    if _PRIVATE is None:
        return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=np.uint8)[:nbytes]
    m = mmap.mmap(-1, max(1, nbytes), flags=_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype=np.uint8)[:nbytes]


def in_heap(nbytes: int) -> np.ndarray:
    """A decode's scratch bytes from the heap, where the next decode finds them already faulted
    in (a fresh map's pages cost a fault each: 16 ms for 47 MB here)."""
    return np.empty(nbytes, dtype=np.uint8)
