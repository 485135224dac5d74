"""Saving with reference="store" needs far less memory than the state itself (measured RSS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from campaigns.memory import CHILD

pytestmark = pytest.mark.slow


def test_store_reference_bounds_the_memory_a_save_needs() -> None:
    # glibc's dynamic mmap threshold keeps freed buffers resident and makes RSS depend on
    # allocation history; a fixed threshold measures what tpde itself holds.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    with tempfile.TemporaryDirectory() as root:
        out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(root, "run"), "store",
                              "200", "16"], capture_output=True, text=True, timeout=300,
                             check=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["keyframe_extra_mb"] < 0.5 * r["state_mb"], r
    assert r["delta_extra_mb"] < r["state_mb"], r
