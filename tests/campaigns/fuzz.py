"""Fuzz every decoder and parser with mutations of valid inputs: only TPDEErrors may escape.

    python tests/campaigns/fuzz.py [--cases 20000] [--seed 0]

Targets, each fed valid inputs mutated at random (bit flips, overwritten, inserted or deleted
bytes, truncations, duplicated runs):

* ``manifest``: the golden chains' manifests (formats 1 and 2) as bytes;
* ``lie``: a manifest whose body has one field replaced by a hostile value (a huge, negative or
  mistyped number, a string, a list, a deep structure) and is signed again, so that only the
  field checks stand between it and the decoder; then the step is loaded in full (records,
  skeleton, tensors) from a copy of its chain;
* ``elias``: Elias-delta position streams;
* ``zstd``: a section's zstd frames, one of them mutated;
* ``entry``: checkpoint entries (the zip archive a Lightning checkpoint path holds).

Per case the outcome is "accepted" or "refused" (a ``TPDEError``); anything else is a failure,
and so is a case that runs past a watchdog of 120 s (a hang, or a bomb decoding for minutes;
this is no timing: the slowest case is reported, and cases take about 0.1 s at most). The process's peak resident memory is reported: a mutation
that declared a huge size and got it allocated would show there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import sys
import time
import uuid
from collections import Counter
from typing import Any, Callable

import fsspec
import numpy as np
import torch

import tpde
from tpde import manifest
from tpde.chain import Chain
from tpde.codec import elias, frames, unframe
from tpde.entries import entry

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
CHAINS = ("chain-v1", "chain-v2", "chain-v3")
#: A watchdog against hangs, generous enough for any machine under load; not a timing.
WATCHDOG_S = 120.0


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4, 16])):
        kind = rng.choice(["flip", "byte", "insert", "delete", "truncate", "repeat"])
        at = rng.randrange(len(out) + 1)
        if kind == "flip" and out:
            at = min(at, len(out) - 1)
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "byte" and out:
            out[min(at, len(out) - 1)] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        elif kind == "insert":
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif kind == "delete":
            del out[at : at + rng.randrange(1, 9)]
        elif kind == "truncate":
            del out[at:]
        elif kind == "repeat":
            n = rng.randrange(1, 65)
            out[at:at] = out[at : at + n]
    return bytes(out)


HOSTILE = [10**15, 2**63, -1, 0, 1, 3.5, "x", "", None, True, [], {}, [0] * 3,
           {"$t": 0}, {"$pickle": "AAAA"}, [[[[[[[[]]]]]]]], 2**48, 2**48 + 1]


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:50]):
            out += _paths(v, path + (i,))
    return out


class Targets:
    """Valid inputs to start from, built once."""

    def __init__(self, rng: random.Random) -> None:
        self.manifests: list[tuple[str, int, bytes]] = []
        for name in CHAINS:
            chain = Chain(os.path.join(GOLDEN, name))
            for step in chain.steps():
                raw = open(os.path.join(GOLDEN, name, "steps", f"{step:020d}.json"), "rb").read()
                self.manifests.append((name, step, raw))
        self.chain_files = {name: self._files(os.path.join(GOLDEN, name)) for name in CHAINS}
        positions = np.sort(np.array(rng.sample(range(10**6), 3000), dtype=np.int64))
        self.streams = [elias.encode(positions[:n], block) for n, block in
                      [(1, 256), (50, 16), (3000, 256), (3000, 7)]]
        planes = torch.arange(40000, dtype=torch.float32).sin().view(torch.uint8).numpy()
        self.section = frames.compress(memoryview(planes).cast("B"), level=1, chunk=4096)
        self.entry_bytes = entry.to_bytes(entry.CheckpointEntry(
            run=".tpde", run_url="memory://fuzz/.tpde", step=3, blob="data/x.tpd",
            raw_bytes=100, stored_bytes=10, meta={"epoch": 1, "global_step": 8}))

    @staticmethod
    def _files(root: str) -> dict[str, bytes]:
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(root) for f in fs}

    def manifest(self, rng: random.Random) -> None:
        _, step, raw = rng.choice(self.manifests)
        manifest.parse(mutate(raw, rng), step=step)

    def lie(self, rng: random.Random) -> None:
        name, step, raw = rng.choice(self.manifests)
        body = copy.deepcopy(json.loads(manifest.plain(raw))["body"])
        path = rng.choice(_paths(body))
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = rng.choice(HOSTILE)
        canon = manifest.canonical(body)
        signed = manifest.canonical({"body": body, "blake2b": manifest.content_hash(canon)})
        run = f"memory://tpde-fuzz/{uuid.uuid4().hex[:10]}"
        fs = fsspec.filesystem("memory")
        try:
            for rel, data in self.chain_files[name].items():
                fs.pipe(f"{run}/{rel}", data)
            fs.pipe(f"{run}/steps/{step:020d}.json", signed)
            Chain(run).load(step, keep_words=False)
        finally:
            fs.rm(run, recursive=True)

    def elias(self, rng: random.Random) -> None:
        elias.decode(mutate(rng.choice(self.streams), rng), limit=10**6)

    def zstd(self, rng: random.Random) -> None:
        fr = [bytes(f) for f in self.section.frames]
        i = rng.randrange(len(fr))
        fr[i] = mutate(fr[i], rng)
        unframe.decompress(fr, self.section.raw, self.section.chunk)

    def entry(self, rng: random.Random) -> None:
        entry.parse(mutate(self.entry_bytes, rng), "fuzzed entry")


def campaign(cases: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    targets = Targets(rng)
    kinds: dict[str, Callable[[random.Random], None]] = {
        "manifest": targets.manifest, "lie": targets.lie, "elias": targets.elias,
        "zstd": targets.zstd, "entry": targets.entry}
    stats: Counter = Counter()
    failures: list[str] = []
    slowest = 0.0
    for case in range(cases):
        kind = list(kinds)[case % len(kinds)]
        started = time.perf_counter()
        try:
            kinds[kind](rng)
            stats[f"{kind} accepted"] += 1
        except tpde.TPDEError:
            stats[f"{kind} refused"] += 1
        except Exception as exc:  # anything else escaping is what the campaign looks for
            failures.append(f"{kind} case {case}: {type(exc).__name__}: {exc}")
        took = time.perf_counter() - started
        slowest = max(slowest, took)
        if took > WATCHDOG_S:
            failures.append(f"{kind} case {case} ran past the watchdog: {took:.1f} s")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"cases": cases, "counts": dict(stats), "failures": failures,
            "slowest_s": slowest, "peak_rss_mb": peak_mb}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    r = campaign(args.cases, args.seed)
    for kind in ("manifest", "lie", "elias", "zstd", "entry"):
        print(f"{kind:9s} {r['counts'].get(f'{kind} refused', 0):6d} refused with a TPDEError, "
              f"{r['counts'].get(f'{kind} accepted', 0):6d} accepted")
    print(f"{r['cases']} cases, {len(r['failures'])} failures; slowest case {r['slowest_s']:.2f} s; "
          f"peak RSS {r['peak_rss_mb']:.0f} MB")
    for f in r["failures"][:20]:
        print("FAILURE", f)
    sys.exit(1 if r["failures"] else 0)


if __name__ == "__main__":
    main()
