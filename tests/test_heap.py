"""Freed heap handed back to the OS after a save only while more than the writer keeps is free,
measured as resident memory of a real process with glibc's allocator; the arena a mount at
budget 0 takes its words from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpde.runtime import heap

GLIBC = pytest.mark.skipif(heap.free_heap_bytes() is None,
                           reason="the C library does not report its free heap")

MB = 1 << 20

#: 256 MiB of 16 MiB buffers from the heap (below the mmap threshold), freed and left resident
#: (no automatic trim of the heap's top), then ``return_freed_memory`` with each ``keep``.
SCRIPT = """
import json, sys
import numpy as np
from tpde.runtime import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
out = {}
for keep in map(int, sys.argv[1:]):
    blocks = [np.ones(16 << 20, dtype=np.uint8) for _ in range(16)]
    del blocks
    before, free = rss(), heap.free_heap_bytes()
    heap.return_freed_memory(keep=keep)
    out[keep] = {"free": free, "handed_back": before - rss()}
print(json.dumps(out))
"""


@GLIBC
def test_freed_heap_is_kept_up_to_keep_and_handed_back_above_it() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 * MB),
           "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
    keeps = [1024 * MB, 64 * MB, 0]
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, keeps)], env=env,
                         capture_output=True, text=True, check=True)
    r = {int(k): v for k, v in json.loads(out.stdout).items()}
    for keep in keeps:
        assert r[keep]["free"] >= 256 * MB, r
    assert r[1024 * MB]["handed_back"] < 16 * MB, r  # less free than kept: nothing trimmed
    assert r[64 * MB]["handed_back"] > 200 * MB, r
    assert r[0]["handed_back"] > 200 * MB, r


#: A writer's saves in a process with 256 MiB free inside its heap: after the trim that hands
#: them back, the pages a save faults in again and frees stay for the next one; the heap is
#: trimmed again once more than ``keep`` beyond what was free after the trim is free.
AGAIN = """
import json
import numpy as np
from tpde.runtime import heap
MB = 1 << 20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def freed(count):
    blocks = [np.ones(16 * MB, dtype=np.uint8) for _ in range(count)]
    del blocks
    return rss()
blocks = [np.ones(16 * MB, dtype=np.uint8) for _ in range(16)]
pin = np.ones(MB, dtype=np.uint8)  # above them: the heap keeps its size when they are freed
del blocks
out, floor = [], None
for count in (0, 8, 8, 40):
    before = freed(count)
    floor = heap.return_freed_memory(keep=64 * MB, floor=floor)
    out.append({"handed_back": before - rss(), "floor": floor})
print(json.dumps(out))
"""


@GLIBC
def test_pages_faulted_in_again_after_a_trim_stay_until_more_than_keep_is_freed() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 * MB),
           "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
    out = subprocess.run([sys.executable, "-c", AGAIN], env=env, capture_output=True,
                         text=True, check=True)
    first, again, third, grown = json.loads(out.stdout)
    # handed back inside the heap: still counted free, the floor the next call measures from
    assert first["handed_back"] > 200 * MB and first["floor"] >= 256 * MB, first
    # 128 MB faulted in again and freed, the free heap no larger: kept for the next save
    assert again["handed_back"] < 16 * MB and third["handed_back"] < 16 * MB, (again, third)
    assert again["floor"] <= first["floor"]
    # 640 MB: the heap grew by 384 MB beyond the free bytes after the trim, handed back
    assert grown["handed_back"] > 300 * MB, grown


#: Arena operations: take that many bytes, or free the live array at that index (modulo).
OPS = st.lists(st.one_of(st.tuples(st.just("take"), st.integers(1, 3000)),
                         st.tuples(st.just("free"), st.integers(0, 63))), max_size=60)


@given(ops=OPS, size=st.sampled_from([64, 1000, 4096]))
def test_arena_words_never_overlap_and_all_come_back(ops, size: int) -> None:
    """Live arrays from an arena never share a byte (each keeps what was written into it while
    the others are taken, written and freed), each is aligned, and once all are freed every
    map is one free range again."""
    arena = heap.Arena(size)
    live: list[tuple[np.ndarray, int]] = []
    mark, a = 0, None
    for op, n in ops:
        if op == "take":
            mark = mark % 255 + 1
            a = arena.take(n)
            assert a.nbytes == n and a.ctypes.data % heap.ALIGN == 0
            a[:] = mark
            live.append((a, mark))
        elif live:
            del live[n % len(live)]
        for a, m in live:
            assert (a == m).all()
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a, _ in live)
        assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    live.clear()
    a = None  # the loop's last array
    with arena._lock:
        arena._join()
    assert arena._free == [[0, len(m)] for m in arena._maps]


def test_arena_words_outlive_the_arena() -> None:
    """An array taken from an arena stays valid after the arena is dropped; its map goes with
    the last array."""
    arena = heap.Arena(1 << 16)
    a = arena.take(1 << 12)
    a[:] = 7
    del arena
    b = np.ones(1 << 12, dtype=np.uint8)  # anything that might reuse the memory
    assert (a == 7).all() and (b == 1).all()


def test_words_freed_while_the_arena_is_busy_come_back_at_the_next_take() -> None:
    """Words freed while the arena's lock is held (as when the cycle collector frees an array
    in the middle of a ``take`` on the same thread) neither wait for the lock nor get lost:
    the next ``take`` has them."""
    arena = heap.Arena(1 << 12)
    held = [arena.take(1 << 12)]

    def free_while_busy() -> None:
        with arena._lock:
            held.clear()

    t = threading.Thread(target=free_while_busy, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    again = arena.take(1 << 12)
    assert len(arena._maps) == 1 and again.ctypes.data == \
        np.frombuffer(arena._maps[0], dtype=np.uint8).ctypes.data
