"""Freed heap handed back to the OS after a save only while more than the writer keeps is free,
measured as resident memory of a real process with glibc's allocator."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tpde import heap

pytestmark = pytest.mark.skipif(heap.free_heap_bytes() is None,
                                reason="the C library does not report its free heap")

MB = 1 << 20

#: 256 MiB of 16 MiB buffers from the heap (below the mmap threshold), freed and left resident
#: (no automatic trim of the heap's top), then ``return_freed_memory`` with each ``keep``.
SCRIPT = """
import json, sys
import numpy as np
from tpde import heap
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
