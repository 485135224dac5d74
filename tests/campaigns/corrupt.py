"""Damage a chain at random (bit flips, truncation, deleted objects) and check every outcome.

Per trial one object of a committed chain (a blob, a manifest, a tombstone, the marker) is
damaged. Then every step either restores bit-exactly or raises a ``TPDEError`` (never another
exception, never a silently wrong tensor), every step that does not depend on the damaged object
still restores, and ``verify`` names each step that fails to load.

    python tests/campaigns/corrupt.py [--trials 3000] [--seed 0] [--pieces]

``--pieces`` stores the chain's two large tensors in pieces (chain format 2).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tpde  # noqa: E402
from campaigns.common import build  # noqa: E402
from helpers import assert_same  # noqa: E402

STEPS = 7


def dependencies(run: str, step: int) -> set[str]:
    """Objects (relative paths) that restoring ``step`` reads."""
    chain = tpde.Checkpointer(run).chain
    todo, seen = [step], set()
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        todo.extend(chain.manifest(s).refs())
    return {f"steps/{s:020d}.json" for s in seen} | {chain.manifest(s).blob for s in seen}


def damage(path: str, rng: random.Random) -> str:
    size = os.path.getsize(path)
    action = rng.choice(["flip", "flip", "truncate", "delete"] if size else ["delete"])
    if action == "delete":
        os.remove(path)
    elif action == "truncate":
        with open(path, "r+b") as f:
            f.truncate(rng.randrange(size))
    else:
        with open(path, "r+b") as f:
            at = rng.randrange(size)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return action


def campaign(trials: int, seed: int = 0, pieces: bool = False) -> Counter:
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="tpde-corrupt-")
    stats: Counter = Counter()
    try:
        base = os.path.join(root, "base")
        expected = build(base, None, STEPS, pieces=pieces)
        with tpde.Checkpointer(base) as ck:
            ck.remove(2)  # a hidden step that later steps still need
        visible = [s for s in range(STEPS) if s != 2]
        deps = {s: dependencies(base, s) for s in visible}
        objects = sorted(os.path.relpath(os.path.join(d, f), base)
                         for d, _, fs in os.walk(base) for f in fs)
        for _ in range(trials):
            run = os.path.join(root, "trial")
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(base, run)
            target = rng.choice(objects)
            stats[damage(os.path.join(run, target), rng)] += 1
            failed = set()
            for step in visible:
                try:
                    out = tpde.Checkpointer(run).load(step)
                except tpde.TPDEError:
                    assert target in deps[step] or target.startswith("removed/"), \
                        f"step {step} failed although {target} is not among what it reads"
                    failed.add(step)
                    continue
                assert_same(expected[step], out, f"SILENT WRONG RESULT? step {step}, {target}")
            reported = {p.needed_by for p in tpde.Checkpointer(run).verify()}
            # A step whose own manifest was deleted is no longer a step: nothing to report.
            gone = {s for s in failed if f"steps/{s:020d}.json" == target and
                    not os.path.exists(os.path.join(run, target))}
            assert failed - gone == reported, \
                f"verify reported {sorted(reported)}, loading failed for {sorted(failed)} ({target})"
            stats["detected" if failed else "harmless"] += 1
            stats["trials"] += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pieces", action="store_true")
    args = p.parse_args()
    stats = campaign(args.trials, args.seed, args.pieces)
    print(f"{stats['trials']} damaged chains ({stats['flip']} bit flips, {stats['truncate']} "
          f"truncations, {stats['delete']} deletions): {stats['detected']} detected as TPDEError, "
          f"{stats['harmless']} left every step restoring bit-exactly, 0 silent wrong results")


if __name__ == "__main__":
    main()
