"""Peak extra resident memory of a save, and of a restore, sampled from /proc while they run.

    python tests/campaigns/memory.py [--mb 400] [--inflight-mb 32] [--tensors 25]

A process saves a keyframe and a delta of an fp32 state; a fresh process then restores the
delta step. ``--tensors 1`` makes the state one tensor, which is stored in pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, threading, time
import torch, tpde

run, mode, mb, inflight, count = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def peak_extra(fn):
    base, top, stop = rss(), [0], threading.Event()
    def sample():
        while not stop.is_set():
            top[0] = max(top[0], rss())
            time.sleep(0.005)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        stop.set()
        t.join()
    extra = max(top[0], rss()) - base  # with what fn returned still held
    del result
    return extra

if mode == "restore":
    ck = tpde.Checkpointer(run, reference="store")  # a reader: it keeps no copy
    print(json.dumps({"restore_extra_mb": peak_extra(lambda: ck.load(1)) / 2**20}))
    sys.exit()
ck = tpde.Checkpointer(run, reference=mode, max_inflight_bytes=inflight << 20)
g = torch.Generator().manual_seed(0)
n = mb * (1 << 20) // 4 // count
state = {f"layer{i}": torch.randn(n, generator=g) for i in range(count)}
key = peak_extra(lambda: ck.save(0, state))
for t in state.values():
    t.add_(torch.randn(n, generator=g), alpha=1e-4)
delta = peak_extra(lambda: ck.save(1, state))
print(json.dumps({"mode": mode, "state_mb": mb, "tensors": count,
                  "keyframe_extra_mb": key / 2**20, "delta_extra_mb": delta / 2**20}))
"""


def measure(mode: str, mb: int, inflight_mb: int, tensors: int = 25,
            env: dict[str, str] | None = None) -> dict:
    """Save with ``reference=mode``, then restore the delta in a fresh process."""
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for child in (mode, "restore"):
            done = subprocess.run([sys.executable, "-c", CHILD, os.path.join(root, "run"),
                                   child, str(mb), str(inflight_mb), str(tensors)],
                                  capture_output=True, text=True, timeout=600, check=True,
                                  env=env)
            out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--inflight-mb", type=int, default=32)
    p.add_argument("--tensors", type=int, default=25)
    args = p.parse_args()
    for mode in ("host", "store"):
        r = measure(mode, args.mb, args.inflight_mb, args.tensors)
        print(f"reference={mode:5s} state {r['state_mb']} MB in {args.tensors} tensor(s): "
              f"peak extra memory {r['keyframe_extra_mb']:.0f} MB saving a keyframe, "
              f"{r['delta_extra_mb']:.0f} MB saving a delta (max_inflight_bytes="
              f"{args.inflight_mb} MB); {r['restore_extra_mb']:.0f} MB restoring the delta, "
              "the restored state included")


if __name__ == "__main__":
    main()
