"""What a second thread buys a restore, stage by stage: one 32 MiB piece of ``speed_bench.py``'s
state (its weight's keyframe record, then its first delta), decoded on 1 and on 2 threads, the
process held to that many cores.

Rows: zstd alone (every frame of the keyframe record decompressed into a few reused buffers,
as a decode does, nothing joined); the
keyframe record's words decoded into pages already faulted in; the same into fresh pages, as a
restore does (the words it returns are new memory); the delta applied to words in place; and
faulting in and filling 32 MiB of fresh pages with nothing decoded. Medians of ``--repeats``.

    python benchmarks/threads_bench.py [--repeats 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

import torch

import tpde
from speed_bench import pin, states
from tpde.chain import Chain
from tpde.codec import transform, unframe
from tpde.runtime import frame_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    root = tempfile.mkdtemp(prefix="tpde-threads-")
    try:
        ck = tpde.Checkpointer(root)
        for step, state in enumerate(states(2)):
            ck.save(step, state)
        ck.close()
        chain = Chain(root)
        key = chain.manifest(0).record("w/0")
        delta = chain.manifest(1).record("w/0")
        assert key.codec == "key" and delta.codec == "dense", (key.codec, delta.codec)
        kv, dv = key.sections["values"], delta.sections["values"]
        key_frames = chain.fetch(chain.manifest(0), [key])[0]["values"]
        delta_frames = chain.fetch(chain.manifest(1), [delta])[0]["values"]
        n = kv.raw // 4
        faulted = torch.zeros(n, dtype=torch.int32)

        def zstd(threads: int) -> None:
            def work(indices):
                framed = unframe.Framed(key_frames, kv.raw, kv.chunk)  # reused buffers, per thread
                for i in indices:
                    framed._frame(i)
            frame_threads.spread(len(key_frames), threads, work, kv.raw)

        def into_faulted(threads: int) -> None:
            transform.stream_words(unframe.Frames(key_frames, kv.raw, kv.chunk), torch.int32,
                                   threads=threads, out=faulted)

        def into_fresh(threads: int) -> None:
            transform.stream_words(unframe.Frames(key_frames, kv.raw, kv.chunk), torch.int32,
                                   threads=threads)

        def apply_delta(threads: int) -> None:
            transform.apply_streamed(faulted, unframe.Frames(delta_frames, dv.raw, dv.chunk),
                                     delta.residual, "float", threads=threads)

        def fault_fill(threads: int) -> None:
            torch.empty(n, dtype=torch.int32).fill_(0)

        rows: dict[str, Callable[[int], None]] = {
            "zstd alone": zstd, "keyframe into faulted pages": into_faulted,
            "keyframe into fresh pages": into_fresh, "delta applied in place": apply_delta,
            "fault in + fill 32 MiB": fault_fill}
        runs: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for threads in (1, 2):
                pin(cores[:threads])
                torch.set_num_threads(threads)
                try:
                    for name, fn in rows.items():
                        started = time.perf_counter()
                        fn(threads)
                        runs.setdefault((name, threads), []).append(
                            time.perf_counter() - started)
                finally:
                    pin(cores)
                    torch.set_num_threads(len(cores))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {}
    print(f"one {kv.raw >> 20} MiB piece, medians of {args.repeats}\n")
    print("| stage | 1 thread | 2 threads | 2 / 1 |\n|---|---|---|---|")
    for name in rows:
        one, two = (statistics.median(runs[(name, t)]) for t in (1, 2))
        out[name] = {"1 thr ms": round(one * 1e3, 2), "2 thr ms": round(two * 1e3, 2),
                     "speedup": round(one / two, 2)}
        print(f"| {name} | {one * 1e3:.1f} ms | {two * 1e3:.1f} ms | {one / two:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
