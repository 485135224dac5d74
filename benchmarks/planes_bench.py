"""The byte-plane word loops of ``tpde.codec._planes`` built two ways, side by side: for one target
(``TPDE_ONE_TARGET``: the compiler's baseline, SSE2 on x86-64) and as tpde builds them (with
GCC 12 or later on x86-64 Linux, one clone per instruction set, the widest the CPU has chosen
as the module loads). Both are compiled here from ``src/tpde/codec/_planes.c`` with the compiler and
flags Python's own extensions use, and each is timed in a process of its own.

Loops, on fp32 words: ``join`` (words from their four planes, applied as an XOR residual, what
a restore does slice by slice), ``split`` (an XOR residual straight into its planes, a delta
save's slice), ``take`` (one plane of words, a keyframe save's frame); at a small record's
size, a slice that stays in cache, and 32 MB that do not. Best of 5.

    python benchmarks/planes_bench.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "src", "tpde", "codec", "_planes.c")
SIZES = (1000, 65536, 8_000_000)  # fp32 words


def build(folder: str, defines: list[str]) -> None:
    """``_planes`` into ``folder``, compiled as setuptools would compile it."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    flags = (sysconfig.get_config_var("CFLAGS") or "").split()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run([*cc, *flags, *defines, "-fPIC", "-shared",
                    f"-I{sysconfig.get_paths()['include']}", SOURCE,
                    "-o", os.path.join(folder, "_planes" + suffix)], check=True)


def measure() -> dict[str, dict[str, float]]:
    """GB/s of each loop at each size, for the ``_planes`` first on ``sys.path``."""
    import _planes as planes

    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for m in SIZES:
        rows = rng.integers(0, 256, (m, 4), dtype=np.uint8)
        ref = rows.copy()
        ref[::3] ^= 1
        parts = [np.ascontiguousarray(rows[:, k]) for k in range(4)]
        dest, split, plane = rows.copy(), np.empty(4 * m, np.uint8), np.empty(m, np.uint8)
        calls = max(3, 20_000_000 // (4 * m))

        def best(fn: Callable[[], object]) -> float:
            fastest = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(calls):
                    fn()
                fastest = min(fastest, (time.perf_counter() - started) / calls)
            return 4 * m / fastest / 1e9  # bytes of words a second

        out[f"{4 * m} B"] = {
            "join": best(lambda: planes.join(parts, 4, dest, 1)),
            "split": best(lambda: planes.diff(rows, ref, 4, split, 1, m)),
            "take": best(lambda: planes.take(rows, 4, 3, 0, plane)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # the child: a build's folder
    args = ap.parse_args()
    if args.measure:
        sys.path.insert(0, args.measure)
        print(json.dumps(measure()))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, defines in (("one target", ["-DTPDE_ONE_TARGET"]), ("clones", [])):
            folder = os.path.join(tmp, name.replace(" ", "-"))
            os.makedirs(folder)
            build(folder, defines)
            done = subprocess.run([sys.executable, __file__, "--measure", folder],
                                  check=True, capture_output=True, text=True)
            runs[name] = json.loads(done.stdout)
    print("| loop | size | one target GB/s | clones GB/s | speed-up |\n|---|---|---|---|---|")
    for size, loops in runs["one target"].items():
        for loop, base in loops.items():
            wide = runs["clones"][size][loop]
            print(f"| {loop} | {size} | {base:.1f} | {wide:.1f} | {wide / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
