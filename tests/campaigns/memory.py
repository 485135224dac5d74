"""Peak extra resident memory of a save, and of a restore, sampled from /proc while they run.

    python tests/campaigns/memory.py [--mb 400] [--inflight-mb 32] [--tensors 25] [--lightning]

A process saves a keyframe and a delta of an fp32 state; a fresh process then restores the
delta step. ``--tensors 1`` makes the state one tensor, which is stored in pieces.
``--lightning`` instead saves a real Trainer's checkpoint twice (one fp32 parameter and its
Adam moments, one optimizer step between) with ``TorchCheckpointIO``, ``TPDECheckpointIO()``
and ``TPDECheckpointIO(async_save=False, reference="store")``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

#: Peak resident memory above the start while ``fn`` runs, sampled every 5 ms (both children).
SAMPLER = r"""
import os, threading, time

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
"""

CHILD = SAMPLER + r"""
import json, sys
import torch, tpde

run, mode, mb, inflight, count = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])

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


LIGHTNING_CHILD = SAMPLER + r"""
import json, sys
import lightning as L
import torch
import tpde
from lightning.pytorch.plugins import TorchCheckpointIO

which, mb, inflight, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

class Big(L.LightningModule):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    def training_step(self, batch, _):
        return (self.w * 1e-3).square().sum() * batch.sum()
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

plugin = {"torch": TorchCheckpointIO(), "tpde": tpde.TPDECheckpointIO(),
          "tpde-sync-store": tpde.TPDECheckpointIO(async_save=False, reference="store",
                                                   max_inflight_bytes=inflight << 20)}[which]
trainer = L.Trainer(max_steps=2, plugins=[plugin], logger=False, accelerator="cpu",
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
# One fp32 tensor with its two Adam moments: the state is `mb` MB in three tensors.
trainer.fit(Big(mb * (1 << 20) // 12), torch.utils.data.DataLoader(torch.ones(8, 1)))
model, opt = trainer.lightning_module, trainer.optimizers[0]
out = {}
for i in range(2):
    def save():
        trainer.save_checkpoint(os.path.join(root, f"s{i}.ckpt"))
        if hasattr(plugin, "wait"):
            plugin.wait()
    out["keyframe_extra_mb" if i == 0 else "delta_extra_mb"] = peak_extra(save) / 2**20
    model.training_step(torch.ones(1, 1), 0).backward()  # one more step between the saves
    opt.step()
    opt.zero_grad()
print(json.dumps({"plugin": which, "state_mb": mb, **out}))
"""


def measure_lightning(plugin: str, mb: int, inflight_mb: int,
                      env: dict[str, str] | None = None) -> dict:
    """Two ``trainer.save_checkpoint`` calls of a real Trainer with ``plugin``, into a folder
    removed after them."""
    with tempfile.TemporaryDirectory() as root:
        done = subprocess.run([sys.executable, "-c", LIGHTNING_CHILD, plugin, str(mb),
                               str(inflight_mb), root], capture_output=True, text=True,
                              timeout=600, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    p.add_argument("--lightning", action="store_true",
                   help="save through Lightning's Trainer with each checkpoint plugin instead")
    args = p.parse_args()
    if args.lightning:
        for plugin in ("torch", "tpde", "tpde-sync-store"):
            r = measure_lightning(plugin, args.mb, args.inflight_mb)
            print(f"{plugin:15s} state {args.mb} MB: peak extra memory "
                  f"{r['keyframe_extra_mb']:.0f} MB on the first save, "
                  f"{r['delta_extra_mb']:.0f} MB on the second")
        return
    for mode in ("host", "store"):
        r = measure(mode, args.mb, args.inflight_mb, args.tensors)
        print(f"reference={mode:5s} state {r['state_mb']} MB in {args.tensors} tensor(s): "
              f"peak extra memory {r['keyframe_extra_mb']:.0f} MB saving a keyframe, "
              f"{r['delta_extra_mb']:.0f} MB saving a delta (max_inflight_bytes="
              f"{args.inflight_mb} MB); {r['restore_extra_mb']:.0f} MB restoring the delta, "
              "the restored state included")


if __name__ == "__main__":
    main()
