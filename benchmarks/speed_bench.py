"""Save and restore speed against the plain format, side by side in one run: a 200 MB fp32
state (a 100 MB weight and a 100 MB Adam-moment-like tensor), then the same after small
updates, in a fresh folder on local disk. ``torch.save`` writes its file to the page cache;
a tpde save fsyncs its blob before it commits, so ``torch.save + fsync`` is timed too.

Rows: ``torch.save`` and ``torch.load`` of the state; a tpde keyframe save, a delta save, the
restore of the delta step (its keyframe and one delta) and of a keyframe; and a step 15 deltas
deep (``keyframe_every=16``) against a keyframe of the same chain, and the same step of the
chain saved with ``deltas_against="keyframe"`` (one delta deep). tpde runs with 1 and 2
threads, the process held to 1 and 2 cores. Every figure is the median of ``--repeats`` runs;
MB/s is the state's raw size over the wall time.

Where ``/dev/shm`` is a RAM-backed file system, both saves run there too ("in RAM" rows): the
same system calls as writing to the page cache, while a tpde save's fsync costs nothing. Those
rows time the work of each format without the disk, whose speed moves a lot from one second
to the next on a shared machine (and which a tpde save waits for, where ``torch.save`` does not).

    python benchmarks/speed_bench.py [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Callable

import torch

import tpde
from tpde.chain import Chain

N = 25_000_000  # words per tensor: 2 x 100 MB


def states(steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` states of a weight and a moment, each a small update of the one before."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, generator=g)
    m = torch.randn(N, generator=g).abs() * 1e-3
    out = [{"w": w, "m": m}]
    for _ in range(steps - 1):
        w = w + 1e-4 * torch.randn(N, generator=g)
        m = m * 0.999 + 1e-6 * torch.randn(N, generator=g).abs()
        out.append({"w": w, "m": m})
    return out


def pin(cores: list[int]) -> None:
    """Hold every thread of this process (the thread pools included) to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that has just ended
            pass


def saved_durably(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save`` made durable, as a tpde save is before it commits (its blob is fsynced)."""
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    """``fn``'s wall time, its result held until the clock has stopped: freeing a restored
    200 MB state (unmapping its pages) takes 13-15 ms, which belongs to no restore, and
    ``compare.py`` leaves it out too."""
    started = time.perf_counter()
    result = fn()
    took = time.perf_counter() - started
    del result
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    chain = states(16)
    raw = sum(t.numel() * t.element_size() for t in chain[0].values()) / 1e6
    root = tempfile.mkdtemp(prefix="tpde-speed-")
    ram = tempfile.mkdtemp(prefix="tpde-speed-", dir="/dev/shm") \
        if os.path.isdir("/dev/shm") else None
    runs: dict[str, list[float]] = {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")

    def note(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)

    def saves(url: str, threads: int, label: str, restores: bool = False) -> None:
        """A keyframe and a delta saved into ``url`` on ``threads`` threads, held to that many
        cores (torch's own threads and tpde's decode threads follow the cores they are given);
        with ``restores``, both steps read back."""
        pin(cores[:threads])
        try:
            ck = tpde.Checkpointer(url, threads=threads)
            note(f"keyframe save, {label}", timed(lambda: ck.save(0, chain[0])))
            note(f"delta save, {label}", timed(lambda: ck.save(1, chain[1])))
            ck.close()
            if restores:
                reader = tpde.Checkpointer(url, threads=threads)
                note(f"restore latest (1 delta), {label}", timed(lambda: reader.load(1)))
                note(f"restore keyframe, {label}", timed(lambda: reader.load(0)))
        finally:
            pin(cores)
        shutil.rmtree(url)

    try:
        for _ in range(args.repeats):
            path = os.path.join(root, "plain.pt")
            note("torch.save", timed(lambda: torch.save(chain[0], path)))
            os.remove(path)
            note("torch.save + fsync", timed(lambda: saved_durably(chain[0], path)))
            note("torch.load", timed(lambda: torch.load(path)))
            os.remove(path)
            for threads in (1, 2):
                saves(os.path.join(root, f"run{threads}"), threads, f"{threads} thr",
                      restores=True)
            if ram is not None:
                path = os.path.join(ram, "plain.pt")
                note("torch.save, in RAM", timed(lambda: torch.save(chain[0], path)))
                os.remove(path)
                for threads in (1, 2):
                    saves(os.path.join(ram, f"run{threads}"), threads, f"in RAM, {threads} thr")
        for against, step15, key in (
                ("previous", "restore step 15 deltas deep", "restore its keyframe"),
                ("keyframe", "restore step 15, deltas against keyframes",
                 "restore its keyframe, deltas against keyframes")):
            deep = os.path.join(root, f"deep-{against}")
            ck = tpde.Checkpointer(deep, keyframe_every=16, deltas_against=against)
            for step, state in enumerate(chain):
                ck.save(step, state)
            ck.close()
            assert Chain(deep).manifest(15).depth == (15 if against == "previous" else 1)
            for _ in range(args.repeats):
                reader = tpde.Checkpointer(deep)
                note(step15, timed(lambda: reader.load(15)))
                note(key, timed(lambda: reader.load(0)))
            shutil.rmtree(deep)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if ram is not None:
            shutil.rmtree(ram, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    rows = {k: {"seconds": round(s, 3), "MBps": round(raw / s)} for k, s in medians.items()}
    ratios = {
        "keyframe save / torch.save (2 thr)":
            medians["torch.save"] / medians["keyframe save, 2 thr"],
        "delta save / torch.save (2 thr)": medians["torch.save"] / medians["delta save, 2 thr"],
        "keyframe save / torch.save + fsync (2 thr)":
            medians["torch.save + fsync"] / medians["keyframe save, 2 thr"],
        "delta save / torch.save + fsync (2 thr)":
            medians["torch.save + fsync"] / medians["delta save, 2 thr"],
        **({"keyframe save / torch.save, in RAM (2 thr)":
            medians["torch.save, in RAM"] / medians["keyframe save, in RAM, 2 thr"],
            "delta save / torch.save, in RAM (2 thr)":
            medians["torch.save, in RAM"] / medians["delta save, in RAM, 2 thr"],
            "keyframe save in RAM, 2 thr / 1 thr":
            medians["keyframe save, in RAM, 1 thr"] / medians["keyframe save, in RAM, 2 thr"],
            "delta save in RAM, 2 thr / 1 thr":
            medians["delta save, in RAM, 1 thr"] / medians["delta save, in RAM, 2 thr"]}
           if ram else {}),
        "restore latest / torch.load (2 thr)":
            medians["torch.load"] / medians["restore latest (1 delta), 2 thr"],
        "15 deep / keyframe (time)":
            medians["restore step 15 deltas deep"] / medians["restore its keyframe"],
        "step 15, deltas against keyframes / keyframe (time)":
            medians["restore step 15, deltas against keyframes"]
            / medians["restore its keyframe, deltas against keyframes"],
        "keyframe save, 2 thr / 1 thr":
            medians["keyframe save, 1 thr"] / medians["keyframe save, 2 thr"],
        "delta save, 2 thr / 1 thr": medians["delta save, 1 thr"] / medians["delta save, 2 thr"],
        "restore latest, 2 thr / 1 thr":
            medians["restore latest (1 delta), 1 thr"] / medians["restore latest (1 delta), 2 thr"],
    }
    print(f"tpde from {os.path.dirname(tpde.__file__)}; {raw:.0f} MB state, medians of "
          f"{args.repeats}\n")
    print("| what | time | MB/s |\n|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['seconds']:.3f} s | {r['MBps']} |")
    print("\n| ratio | value |\n|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "torch": torch.__version__},
                       "raw_MB": raw, "repeats": args.repeats, "rows": rows,
                       "ratios": {k: round(v, 3) for k, v in ratios.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
