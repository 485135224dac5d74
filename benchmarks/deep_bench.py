"""What a restore costs by depth, and what bounds it: ``speed_bench.py``'s chain of a 200 MB
fp32 state (a weight and an Adam-moment-like tensor, each step a small dense update of the one
before) saved with ``keyframe_every=16``; steps 0 (the keyframe), 1, 3, 7 and 15 restored (a
step's depth is its deepest record's: keyframes are decided per tensor piece and spread over
steps, so some pieces of a deep step are re-keyed on the way). The chain is saved twice, with
each delta coded against the step before (the default) and against its tensor's keyframe
(``deltas_against="keyframe"``, where every step is one delta deep), for its bytes and save
time beside its restores.

Beside the restores, for each of those steps: the records a restore decodes (each
tensor piece's record and those it reads from, back to its keyframe), and what their zstd
frames cost alone on 2 threads, copied into a reused buffer and decompressed by zstd with
nothing unshuffled, applied or hashed: a floor for any decoder of those stored bytes.
Restores run on a warm reader; every figure is the median of ``--repeats`` runs.

    python benchmarks/deep_bench.py [--repeats 5] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
import zstandard

import tpde
from speed_bench import states, timed
from tpde.chain import Chain
from tpde.manifest import Record

DEPTHS = (0, 1, 3, 7, 15)
THREADS = 2


def median_of(repeats: int, fn: Callable[[], object]) -> float:
    fn()  # the first run faults in the reader's pools and the page cache's pages
    return statistics.median(timed(fn) for _ in range(repeats))


def frames_of(chain: Chain, records: list[tuple[int, Record]]) -> list[memoryview]:
    """The zstd frames of ``records``, read as a restore reads them (through the chain's own
    reads, so that the floor reads what the restore reads)."""
    by_step: dict[int, list[Record]] = {}
    for at, rec in records:
        by_step.setdefault(at, []).append(rec)
    out: list[memoryview] = []
    for at, recs in by_step.items():
        for framed in chain.fetch(chain.manifest(at), recs):
            for frames in framed.values():
                out.extend(frames)
    return out


_local = threading.local()  # each thread's zstd context, kept from one run to the next


def zstd_alone(frames: list[memoryview], pool: ThreadPoolExecutor) -> None:
    """The frames decompressed, shared out over the threads."""
    def run(share: list[memoryview]) -> None:
        d = getattr(_local, "d", None) or zstandard.ZstdDecompressor()
        _local.d = d
        for f in share:
            d.decompress(f)

    list(pool.map(run, [frames[i::THREADS] for i in range(THREADS)]))


def copy_alone(frames: list[memoryview], pool: ThreadPoolExecutor) -> None:
    """Each frame copied into a reused buffer: the least reading the stored bytes costs."""
    buffers = [np.empty(max(map(len, frames)), np.uint8) for _ in range(THREADS)]

    def run(i: int) -> None:
        out = buffers[i]
        for f in frames[i::THREADS]:
            out[:len(f)] = np.frombuffer(f, np.uint8)

    list(pool.map(run, range(THREADS)))


def measure(run: str, chain_states: list[dict[str, torch.Tensor]], against: str,
            repeats: int) -> dict:
    """One chain of ``chain_states`` saved coding deltas ``against``: its save time and bytes,
    its restores by step, and their floors."""
    writer = tpde.Checkpointer(run, keyframe_every=16, threads=THREADS, deltas_against=against)
    saved = sum(timed(lambda s=s, x=x: writer.save(s, x)) for s, x in enumerate(chain_states))
    writer.close()
    chain = Chain(run)
    depths = [chain.manifest(d).depth for d in DEPTHS]
    assert depths == (list(DEPTHS) if against == "previous" else [min(d, 1) for d in DEPTHS])
    reader = tpde.Checkpointer(run, threads=THREADS)
    restores = {d: median_of(repeats, lambda d=d: reader.load(d)) for d in DEPTHS}
    floors = {}
    with ThreadPoolExecutor(THREADS) as pool:
        for d in DEPTHS:
            records = chain.reads(d).records
            frames = frames_of(chain, records)
            floors[d] = {
                "records": len(records), "frames": len(frames),
                "stored_MB": round(sum(map(len, frames)) / 1e6),
                "decompressed_MB": round(sum(s.raw for _, r in records
                                             for s in r.sections.values()) / 1e6),
                "zstd_s": round(median_of(repeats, lambda: zstd_alone(frames, pool)), 4),
                "copy_s": round(median_of(repeats, lambda: copy_alone(frames, pool)), 4)}
    return {"save_s": round(saved, 3), "depths": depths,
            "chain_MB": round(sum(chain.manifest(s).stored_bytes for s in chain.steps()) / 1e6),
            "restore_s": {d: round(s, 4) for d, s in restores.items()}, "floors": floors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the chain is written (default: $TMPDIR)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    chain_states = states(max(DEPTHS) + 1)
    raw = sum(t.numel() * t.element_size() for t in chain_states[0].values())
    modes = {}
    for against in ("previous", "keyframe"):
        root = tempfile.mkdtemp(prefix="tpde-deep-", dir=args.dir)
        try:
            modes[against] = measure(os.path.join(root, "run"), chain_states, against,
                                     args.repeats)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"tpde from {os.path.dirname(tpde.__file__)}; {raw / 1e6:.0f} MB state, "
          f"{THREADS} threads, medians of {args.repeats}\n")
    print("| deltas against | chain of 16 steps | saving it | step (deepest record) | restore "
          "| x the keyframe's |\n|---|---|---|---|---|---|")
    for against, m in modes.items():
        key = m["restore_s"][0]
        for i, (d, s) in enumerate(m["restore_s"].items()):
            deep = m["depths"][i]
            where = "keyframe" if deep == 0 else f"{deep} delta{'s' if deep > 1 else ''} deep"
            head = f"| {against} | {m['chain_MB']} MB | {m['save_s']:.2f} s" if i == 0 \
                else "| | | "
            print(f"{head} | {d} ({where}) | {s * 1e3:.0f} ms | {s / key:.2f}x |")
    print("\nWhat those restores decode, and what reading and decompressing it alone takes:\n")
    print("| deltas against | step | records decoded | stored | frames | copying the stored bytes "
          "| zstd alone | x the keyframe's restore |\n|---|---|---|---|---|---|---|---|")
    for against, m in modes.items():
        key = m["restore_s"][0]
        for d, f in m["floors"].items():
            print(f"| {against if d == 0 else ''} | {d} | {f['records']} | {f['stored_MB']} MB "
                  f"| {f['frames']} | {f['copy_s'] * 1e3:.0f} ms | {f['zstd_s'] * 1e3:.0f} ms "
                  f"| {f['zstd_s'] / key:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "torch": torch.__version__},
                       "raw_MB": round(raw / 1e6), "repeats": args.repeats, "threads": THREADS,
                       "deltas_against": modes}, f, indent=1)


if __name__ == "__main__":
    main()
