"""Kill a real save (or remove + gc, which re-bases) with SIGKILL before each of its I/O
operations in turn.

After every kill: each step committed before it restores bit-exactly, ``verify`` passes, a
half-written step is invisible, ``gc`` removes the leftovers, and the next writer continues.

    python tests/campaigns/crash.py [--s3] [--steps 4]     # prints the kill points tried
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tpde  # noqa: E402
from campaigns.common import build, state_at  # noqa: E402
from helpers import assert_same  # noqa: E402
from tpde.store import exclusive, store  # noqa: E402

#: Everything tpde does that touches a store passes through one of these.
EVENTS = [(store.BlobWriter, "write"), (store.BlobWriter, "close"), (store.Store, "put_atomic"),
          (store.Store, "delete"), (exclusive, "create"), (os, "fsync"), (os, "replace"),
          (os, "link")]


def arm(kill_at: int) -> list[int]:
    """Make this process SIGKILL itself at its ``kill_at``-th store operation (0: never).

    Returns the live count of operations so far (one cell, shared by every thread).
    """
    count, lock = [0], threading.Lock()

    def armed(original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with lock:
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return wrapper

    for owner, name in EVENTS:
        setattr(owner, name, armed(getattr(owner, name)))
    return count


def _child(action: str, url: str, options: dict | None, kill_at: int, steps: int) -> None:
    arm(kill_at)
    ck = tpde.Checkpointer(url, storage_options=options, keyframe_every=3, chunk_bytes=4096)
    if action == "save":
        ck.load()
        ck.save(steps, state_at(steps))
    else:
        ck.remove(1)
        ck.remove(2)
        ck.gc(grace_seconds=0)
    os._exit(0)


def check(url: str, options: dict | None, expected: dict[int, dict], action: str) -> None:
    ck = tpde.Checkpointer(url, storage_options=options, keyframe_every=3)
    visible = ck.steps()
    if action == "save":
        assert visible in (sorted(expected), sorted(expected) + [len(expected)]), visible
    else:
        assert set(visible) >= set(expected) - {1, 2}, visible
    assert ck.verify() == [], "verify failed after a kill"
    for step in visible:
        want = expected.get(step) or state_at(step)
        assert_same(want, ck.load(step), f"step {step}")
    ck.gc(grace_seconds=0)
    live = {ck.chain.manifest(s).blob for s in ck.chain.committed()}
    left = {e.path for e in ck.chain.store.list("data")} - live
    assert not left, f"gc left unreferenced blobs: {left}"
    nxt = max(ck.chain.committed()) + 1
    ck.save(nxt, state_at(nxt))  # the killed writer's lease is taken over: its process is gone
    assert nxt in ck.steps()
    ck.close()


def campaign(make_url: Callable[[], tuple[str, dict | None]], *, steps: int = 4,
             actions: tuple[str, ...] = ("save", "remove+gc"), limit: int = 200,
             every: int = 1) -> int:
    """Every kill point of every action (``every``: each that many-th, from the first);
    returns how many were tried."""
    ctx = multiprocessing.get_context("fork")
    tried = 0
    for action in actions:
        for kill_at in range(1, limit + 1, every):
            url, options = make_url()
            # Deltas all the way (keyframe_every=8): removing steps 1 and 2 re-bases step 3.
            expected = build(url, options, steps, keyframe_every=8)
            child = ctx.Process(target=_child, args=(action, url, options, kill_at, steps))
            child.start()
            child.join(120)
            assert child.exitcode in (0, -signal.SIGKILL), f"child exit code {child.exitcode}"
            if child.exitcode == 0 and action == "remove+gc":
                # The action re-based step 3 (its delta read step 2): kills fell inside it.
                assert tpde.Checkpointer(url, storage_options=options).chain.manifest(3).origin
            check(url, options, expected, action)
            if child.exitcode == 0:
                break  # the action ran to the end: every point before it was tried
            tried += 1
    return tried


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--s3", action="store_true", help="against a moto S3 server on 127.0.0.1")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=1, help="try each N-th kill point (default: all)")
    args = p.parse_args()
    if args.s3:
        from campaigns.s3 import moto_server

        with moto_server() as options:
            n = campaign(lambda: (f"s3://tpde/{uuid.uuid4().hex[:10]}", options),
                         steps=args.steps, every=args.every)
    else:
        root = tempfile.mkdtemp()
        try:
            n = campaign(lambda: (os.path.join(root, uuid.uuid4().hex[:10]), None),
                         steps=args.steps, every=args.every)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{n} kill points tried on {'S3 (moto)' if args.s3 else 'local disk'}: "
          "every committed step survived each")


if __name__ == "__main__":
    main()
