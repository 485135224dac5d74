"""Lightning: bytes written and training-loop stall per checkpoint, tpde vs Lightning's own.

The example run of ``examples/lightning_train.py`` (a GPT-style model on Python's stdlib
sources, fp32 + AdamW, ``ModelCheckpoint(save_top_k=2, save_last=True)`` every 4 steps) is
trained with ``TorchCheckpointIO``, ``AsyncCheckpointIO(TorchCheckpointIO)`` and
``TPDECheckpointIO``, ``--repeats`` times each; stalls are medians over all checkpoints of all
repeats.

    python benchmarks/lightning_bench.py [--quick] [--json benchmarks/results/lightning_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lightning_train import compare  # noqa: E402

SIZES = {"small": (128, 2), "medium": (384, 6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small model once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    sizes = {"small": SIZES["small"]} if args.quick else SIZES
    repeats = 1 if args.quick else args.repeats
    results: dict[str, dict] = {}
    for size, (dim, layers) in sizes.items():
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as root:
                runs.append(compare(root, epochs=3, every=4, dim=dim, layers=layers))
        results[size] = {
            name: {
                "state_mb": runs[0][name]["state_bytes"] / 1e6,
                "checkpoints": runs[0][name]["checkpoints"],
                "written_mb": runs[0][name]["written_bytes"] / 1e6,
                "disk_mb_at_end": runs[0][name]["disk_bytes"] / 1e6,
                "stall_ms_median": statistics.median(r[name]["stall_ms_median"] for r in runs),
                "stall_ms_max": max(r[name]["stall_ms_max"] for r in runs),
                "fit_seconds_median": statistics.median(r[name]["fit_seconds"] for r in runs),
            } for name in runs[0]
        }
        print(f"\n{size}: GPT dim {dim}, {layers} layers; state "
              f"{results[size]['TorchCheckpointIO']['state_mb']:.1f} MB per checkpoint "
              f"(torch.save), medians of {repeats} run(s)")
        print(f"{'plugin':26s} {'ckpts':>5s} {'written':>11s} {'disk at end':>12s} "
              f"{'stall median':>13s} {'stall max':>10s} {'fit':>8s}")
        for name, f in results[size].items():
            print(f"{name:26s} {f['checkpoints']:5d} {f['written_mb']:8.2f} MB "
                  f"{f['disk_mb_at_end']:9.2f} MB {f['stall_ms_median']:10.1f} ms "
                  f"{f['stall_ms_max']:7.1f} ms {f['fit_seconds_median']:6.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
