"""``tpde.codec._planes`` built for one instruction set at a time gives the same bytes as the build
installed, whichever of its clones the CPU chose: the baseline (what a CPU without AVX2 runs),
and x86-64-v3 and v4 where this CPU can run them. The installed build's clone is the only one
the other tests reach on a given machine."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
from types import ModuleType

import numpy as np
import pytest

from tpde.codec import frames

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from planes_bench import build  # noqa: E402  (the benchmark's build, flags and all)

pytestmark = pytest.mark.skipif(
    frames.native is None or platform.machine() != "x86_64" or sys.platform != "linux"
    or shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None,
    reason="needs the built extension and a C compiler on x86-64 Linux")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _targets() -> list[tuple[str, list[str]]]:
    flags = _cpu_flags()
    out = [("baseline", ["-DTPDE_ONE_TARGET"])]
    if "avx2" in flags:
        out.append(("x86-64-v3", ["-DTPDE_ONE_TARGET", "-march=x86-64-v3"]))
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out.append(("x86-64-v4", ["-DTPDE_ONE_TARGET", "-march=x86-64-v4"]))
    return out


def _load(folder: str) -> ModuleType:
    path = os.path.join(folder, "_planes" + sysconfig.get_config_var("EXT_SUFFIX"))
    spec = importlib.util.spec_from_file_location("_planes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(planes: ModuleType) -> str:
    """Every loop on words of every width, sizes with and without vector tails, every mode."""
    h = hashlib.sha256()
    rng = np.random.default_rng(7)
    for width in (1, 2, 4, 8):
        for n in (0, 1, 15, 64, 1000, 4099, 70001):
            new = rng.integers(0, 256, n * width, dtype=np.uint8)
            ref = new.copy()
            ref[rng.random(n * width) < 0.3] ^= 0x5A  # some words changed, some not
            for k in range(width):
                out = np.empty(n, np.uint8)
                planes.take(new, width, k, 0, out)
                h.update(out)
            for mode in (1, 2, 3):
                res = np.empty_like(new)
                planes.diff(new, ref, width, res, mode)
                split = np.empty_like(new)
                planes.diff(new, ref, width, split, mode, n)
                back = ref.copy()
                planes.apply(res, width, back, mode)
                joined = ref.copy()
                planes.join([split[k * n:(k + 1) * n] for k in range(width)], width, joined, mode)
                h.update(res)
                h.update(split)
                h.update(back)
                h.update(joined)
            at = np.empty(n, np.int64)
            vals = np.empty(n * width, np.uint8)
            count = planes.changed(new, ref, width, at, vals)
            h.update(str((planes.changed(new, ref, width), count)).encode())
            h.update(at[:count])
            h.update(vals[: count * width] if width == 1 else
                     np.concatenate([vals[k * n:k * n + count] for k in range(width)]))
    return h.hexdigest()


@pytest.mark.parametrize("name,defines", _targets(), ids=[t[0] for t in _targets()])
def test_each_instruction_set_gives_the_installed_bytes(tmp_path, name: str,
                                                        defines: list[str]) -> None:
    build(str(tmp_path), defines)
    assert _digest(_load(str(tmp_path))) == _digest(frames.native)
