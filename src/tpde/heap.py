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


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 on): byte counts as ``size_t``."""

    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _libc(symbol: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), symbol, None)
    except (OSError, TypeError):  # no C library to ask (Windows)
        return None


_MALLOC_TRIM = _libc("malloc_trim")
_MALLINFO2 = _libc("mallinfo2")
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def free_heap_bytes() -> int | None:
    """Bytes free in the C heap's arenas, resident or not (None: the C library does not say).
    Half a microsecond here: cheaper than the trim it decides on."""
    return _MALLINFO2().fordblks if _MALLINFO2 is not None else None


def return_freed_memory(keep: int = 0, floor: int | None = None) -> int | None:
    """Hand heap pages freed by an encode or a decode back to the OS, unless the heap holds no
    more than ``keep`` free bytes beyond ``floor``: what this returned last time (None: none).

    Returns the ``floor`` for the next call: the free bytes after a trim, or the fewer of the
    last floor and those now (memory the program took from the free heap since, and freed
    again, goes back too once it adds up to ``keep``); None until a first trim. Pages already handed back still count as
    free, so a heap compared with ``keep`` alone was trimmed after every save once it had held
    that much free, and every save faulted its buffers' pages in again: in a process that had
    freed 530 MB before G's 23 saves (``compare.py`` loads the workload's states first), each
    save trimmed for 0.4-3.7 ms, and G's saves and removals took 7-15% longer.

    The freed pages kept are those the next save faults in again: trimming after every save of
    a 46 MB bf16 state cost its chain 55-90K more page faults and 8% of its CPU time (C saved at
    709 MB/s, 783 with the trim skipped while at most 256 MiB were free), for 21 MB less idle
    memory. A writer that never trimmed once held 550 MB idle on that chain, when an encode's
    temporaries were not bounded; ``keep`` bounds what stays.
    """
    if _MALLOC_TRIM is None:
        return None
    free = free_heap_bytes() if keep else None
    if free is not None and free - (floor or 0) <= keep:
        return None if floor is None else min(floor, free)
    _MALLOC_TRIM(0)
    return free_heap_bytes() if keep else None


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
