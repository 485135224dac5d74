"""Process memory: decode buffers, and freed heap pages handed back.

glibc raises its mmap threshold to the size of the large blocks a program frees and keeps
later blocks below that size in its heaps, where freed ones stay resident. Encodes and decodes
free many such blocks; these tools keep what the process holds near what it uses.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
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
    again, goes back too once it adds up to ``keep``); None until a first trim. Pages already
    handed back still count as free, so a heap compared with ``keep`` alone was trimmed after
    every save once it had held that much free, and every save faulted its buffers' pages in
    again, which made a process's saves and removals markedly slower.

    The freed pages kept are those the next save faults in again: trimming after every save
    costs page faults and CPU time for little idle memory spared, and a writer that never
    trims holds what its largest save freed; ``keep`` bounds what stays.
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
    fresh map's pages cost a fault each): the Python path's buffers. A
    mount at budget 0 rebuilds its words in an ``Arena``, which keeps its pages.

    A memory-first decode (a mount at budget 0) took its buffers from maps of their own, given
    back to the system as each was freed, and trimmed the heap after every module: each
    forward faulted its tensors' fresh pages in again. From the heap, trimmed as ``freed``
    says, a forward takes about half the time, for a few MB more at the peak
    (``benchmarks/mount_memory.py``).
    """
    return np.empty(nbytes, dtype=np.uint8)


class Trims:
    """The heap handed back for one user of it (a writer, a mount, the memory-first decodes)
    whenever it holds ``keep`` bytes more free than after that user's last trim (the floor
    ``return_freed_memory`` compares with), looked at once ``every`` bytes were counted since
    the last look (0: at every call; the look, ``mallinfo2``, is not free)."""

    def __init__(self, every: int = 0) -> None:
        self.every = every
        self._floor: int | None = None
        self._unlooked = 0
        self._lock = threading.Lock()

    def after(self, keep: int, nbytes: int = 0) -> None:
        """Count ``nbytes`` more, and look (and maybe trim) once they reach ``every``. The
        trim runs outside the lock: a thread that only counts never waits for another's."""
        with self._lock:
            self._unlooked += nbytes
            if self._unlooked < self.every:
                return
            self._unlooked = 0
            floor = self._floor
        floor = return_freed_memory(keep, floor)
        with self._lock:
            self._floor = floor


#: Bytes a memory-first decode frees between two trims of the heap (``freed``): trimmed more
#: often, a forward at budget 0 is slower; less often, its peak rises towards a dense load's
#: (``benchmarks/mount_memory.py``).
TRIM_EVERY_BYTES = 16 << 20
_freed = Trims(every=TRIM_EVERY_BYTES)


def freed(nbytes: int) -> None:
    """Count ``nbytes`` that a memory-first decode let go, and trim the heap once they add up to
    ``TRIM_EVERY_BYTES``: trimming after each module handed back the pages the next one was
    about to fault in again."""
    _freed.after(0, nbytes)


#: Where an arena's words start: a cache line, so that two threads writing neighbouring words
#: never share one.
ALIGN = 64
#: Whether this system has the private anonymous maps an ``Arena`` is made of (not Windows).
ARENAS = hasattr(mmap, "MAP_PRIVATE")


class Arena:
    """Words that a memory-first decode takes again and again, from maps of their own whose
    pages stay faulted in: a mount at budget 0 rebuilds every module on every forward. From
    the heap, trimmed as ``freed`` says so that the process held no more than it used, a
    forward faulted its words in again each time (dozens of times the page faults of an
    arena), and embeddings above glibc's mmap threshold were mapped and unmapped every
    forward: it decoded below the restore path's speed, and from an arena at about it
    (``benchmarks/mount_bench.py --alternate``).

    Words are handed out first-fit, so that the pages touched stay near the most words alive
    at once. They go back when the last array (or tensor) viewing them is freed, whatever
    thread frees it, and are joined to the free ranges by the next ``take``: an array freed by
    the cycle collector in the middle of a ``take`` must not wait for the lock that ``take``
    holds. A map that cannot fit a request is joined by another of at least its size, and the
    maps go once the arena and every word taken from them are gone."""

    def __init__(self, size: int) -> None:
        self._size = max(size, ALIGN)
        self._maps: list[mmap.mmap] = []
        self._free: list[list[int]] = []  # each map's free (start, end) ranges, by start
        self._back: list[tuple[int, int, int]] = []  # given back, not yet joined
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes, as an array the caller owns until it frees it."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            self._join()
            found = next(((i, j) for i, free in enumerate(self._free)
                          for j in range(0, len(free), 2) if free[j + 1] - free[j] >= need),
                         None)
            if found is None:
                self._grow(need)
                found = (len(self._maps) - 1, 0)
            i, j = found
            start = self._free[i][j]
            self._free[i][j] += need
            if self._free[i][j] == self._free[i][j + 1]:
                del self._free[i][j : j + 2]
        out = np.frombuffer(self._maps[i], dtype=np.uint8, count=nbytes, offset=start)
        weakref.finalize(out, self._back.append, (i, start, start + need)).atexit = False
        return out

    def _grow(self, need: int) -> None:
        size = max(self._size, -(-need // mmap.PAGESIZE) * mmap.PAGESIZE)
        self._maps.append(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
        self._free.append([0, size])

    def _join(self) -> None:
        """The ranges given back since, joined to the free ones (with the lock held)."""
        while self._back:
            i, a, b = self._back.pop()
            free = self._free[i]
            j = 0
            while j < len(free) and free[j] < a:
                j += 2
            free[j:j] = [a, b]
            if j + 2 < len(free) and free[j + 1] == free[j + 2]:  # joins the next range
                free[j + 1] = free[j + 3]
                del free[j + 2 : j + 4]
            if j and free[j - 1] == free[j]:  # joins the one before
                free[j - 1] = free[j + 1]
                del free[j : j + 2]
