"""tpde's own settings (zstd level, keyframe interval) on chains from real training runs.

Workloads A, B and C of ``workloads.py`` (generated once by training, cached in .bench-cache/):
a GPT-style model pretrained from scratch, all-MiniLM-L6-v2 fully fine-tuned (fp32 weights +
Adam moments) and the same run's weights in bf16.  For each: total stored bytes and ratio vs
torch.save, save and restore throughput (MB/s of raw state) and the codec mix, for each setting.
``compare.py`` measures tpde against other libraries.

    python benchmarks/chain_bench.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

import tpde

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads  # noqa: E402
from compare import difference  # noqa: E402
from contenders import codec_mix  # noqa: E402

SWEPT = ("A-gpt-pretrain", "B-minilm-finetune", "C-minilm-bf16")


def run_chain(states: list, **options) -> dict:
    root = tempfile.mkdtemp(prefix="tpde-bench-")
    try:
        ck = tpde.Checkpointer(os.path.join(root, "run"), **options)
        raw = stored = 0
        save_s = 0.0
        for step, state in enumerate(states):
            t = time.perf_counter()
            info = ck.save(step, state)
            save_s += time.perf_counter() - t
            raw += info.raw_bytes
            stored += info.stored_bytes
        reader = tpde.Checkpointer(os.path.join(root, "run"))
        t = time.perf_counter()
        last = reader.load(len(states) - 1)
        restore_s = time.perf_counter() - t
        found = difference(last, states[-1])
        assert found is None, f"round trip is not bit-exact: {found}"
        return {"raw_bytes": raw, "stored_bytes": stored, "save_mb_s": raw / 1e6 / save_s,
                "restore_latest_mb_s": info.raw_bytes / 1e6 / restore_s,
                "codecs": codec_mix([reader.chain.manifest(s) for s in reader.steps()])}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short chains, a few minutes")
    p.add_argument("--json", default=os.path.join(HERE, "results", "chain_bench.json"))
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "torch": torch.__version__, "platform": platform.platform()},
                     "quick": args.quick, "workloads": {}}
    for name in SWEPT:
        states = workloads.load(name, args.quick)
        torch_bytes = sum(workloads.torch_sizes(name, args.quick, states))
        entry = {"checkpoints": len(states), "torch_save_bytes": torch_bytes, "settings": {}}
        # The defaults are level=None (byte-plane parameters) and keyframe_every=16: the first row.
        grid = [(f"level={lv}", {"level": lv}) for lv in (None, 1, 3, 6, 9, 12)] \
            + [(f"keyframe_every={k}", {"keyframe_every": k}) for k in (1, 4, 8, 32)]
        for label, options in grid:
            r = run_chain(states, **options)
            r["ratio_vs_torch_save"] = torch_bytes / r["stored_bytes"]
            entry["settings"][label] = r
            print(f"{name:13s} {label:17s} ratio {r['ratio_vs_torch_save']:5.2f}x  "
                  f"save {r['save_mb_s']:6.1f} MB/s  restore {r['restore_latest_mb_s']:6.1f} MB/s  "
                  f"{r['codecs']}", flush=True)
        results["workloads"][name] = entry
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
