"""A sparse delta's pieces, in C (``tpde.codec._elias``, ``tpde.codec._planes``) against numpy's path, which
runs wherever the extensions are not built.

A sparse delta stores the positions of the words that changed (Elias-delta gaps) and their XOR
residuals. A save sizes the positions' codes (``encoded_bits``) and writes them; a restore
decodes them and XORs the residuals into the words at those positions. Words whose sections
were decompressed whole are put together from their byte planes (``unshuffle``). Positions
are drawn at each density over 22M words (the size of compare.py's C state in bf16 words),
the residuals are bf16 words. Best of 5, ns per position (per MiB of words for unshuffle).

    python benchmarks/sparse_bench.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from tpde.codec import decoder, elias, frames, transform

WORDS = 22_000_000
DENSITIES = (0.005, 0.05, 0.22, 0.7)


def best(f: Callable[[], Any], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        f()
        times.append(time.perf_counter() - started)
    return min(times)


def numpy_path(f: Callable[[], Any]) -> Callable[[], Any]:
    """``f`` with the C byte-plane loops switched off, as where they are not built."""
    def run() -> Any:
        kept, frames.native = frames.native, None
        try:
            return f()
        finally:
            frames.native = kept
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    print(f"{'density':>8s} {'positions':>10s} {'':9s} {'encoded_bits':>13s} {'encode':>8s} "
          f"{'decode':>8s} {'apply':>8s}   (ns a position)")
    for density in DENSITIES:
        at = np.flatnonzero(rng.random(WORDS) < density).astype(np.int64)
        n = at.size
        stream = elias.encode(at)
        words = torch.from_numpy(rng.integers(-2**15, 2**15, WORDS, dtype=np.int16))
        residual = torch.from_numpy(rng.integers(-2**15, 2**15, n, dtype=np.int16))
        where = torch.from_numpy(at)
        apply = lambda: decoder.CPU().sparse(words, where, residual)  # noqa: E731
        for path, native in (("C", True), ("numpy", False)):
            row = {"density": density, "positions": n, "path": path,
                   "encoded_bits": best(lambda: elias.encoded_bits(at, use_native=native)),
                   "encode": best(lambda: elias.encode(at, use_native=native)),
                   "decode": best(lambda: elias.decode(stream, use_native=native)),
                   "apply": best(apply if native else numpy_path(apply))}
            row = {k: v / n * 1e9 if k in ("encoded_bits", "encode", "decode", "apply") else v
                   for k, v in row.items()}
            rows.append(row)
            print(f"{density:8.3f} {n:10d} {path:9s} {row['encoded_bits']:13.2f} "
                  f"{row['encode']:8.2f} {row['decode']:8.2f} {row['apply']:8.2f}")
    joins: list[dict[str, Any]] = []
    print(f"\n{'unshuffle':>10s} {'C':>8s} {'numpy':>8s}   (us a MiB of words)")
    for dtype in (torch.bfloat16, torch.float32):
        width = torch.empty(0, dtype=dtype).element_size()
        planes = torch.from_numpy(rng.integers(0, 256, WORDS // 4 * width, dtype=np.uint8))
        mib = planes.numel() / 2**20
        join = lambda: transform.unshuffle(planes, dtype)  # noqa: E731
        c, numpy = best(join) / mib * 1e6, best(numpy_path(join)) / mib * 1e6
        joins.append({"dtype": str(dtype), "c_us_per_mib": c, "numpy_us_per_mib": numpy})
        print(f"{str(dtype).replace('torch.', ''):>10s} {c:8.0f} {numpy:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__},
                       "positions": rows, "unshuffle": joins}, f, indent=1)


if __name__ == "__main__":
    main()
