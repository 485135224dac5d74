"""Peak extra resident memory of a save, sampled from /proc while it runs.

    python tests/campaigns/memory.py [--mb 400] [--inflight-mb 32] [--tensors 25]

``--tensors 1`` saves the state as one tensor, which is stored in pieces.
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
    t = threading.Thread(target=sample)
    t.start()
    fn()
    stop.set()
    t.join()
    return max(top[0], rss()) - base

g = torch.Generator().manual_seed(0)
n = mb * (1 << 20) // 4 // count
state = {f"layer{i}": torch.randn(n, generator=g) for i in range(count)}
ck = tpde.Checkpointer(run, reference=mode, max_inflight_bytes=inflight << 20)
key = peak_extra(lambda: ck.save(0, state))
for t in state.values():
    t.add_(torch.randn(n, generator=g), alpha=1e-4)
delta = peak_extra(lambda: ck.save(1, state))
print(json.dumps({"mode": mode, "state_mb": mb, "tensors": count,
                  "keyframe_extra_mb": key / 2**20,
                  "delta_extra_mb": delta / 2**20}))
"""


def measure(mode: str, mb: int, inflight_mb: int, tensors: int = 25,
            env: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as root:
        out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(root, "run"), mode,
                              str(mb), str(inflight_mb), str(tensors)], capture_output=True,
                             text=True, timeout=600, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--inflight-mb", type=int, default=32)
    p.add_argument("--tensors", type=int, default=25)
    args = p.parse_args()
    for mode in ("host", "store"):
        r = measure(mode, args.mb, args.inflight_mb, args.tensors)
        print(f"reference={mode:5s} state {r['state_mb']} MB in {args.tensors} tensor(s): "
              "peak extra memory "
              f"{r['keyframe_extra_mb']:.0f} MB saving a keyframe, {r['delta_extra_mb']:.0f} MB "
              f"saving a delta (max_inflight_bytes={args.inflight_mb} MB)")


if __name__ == "__main__":
    main()
