"""What re-basing costs: workload G (a Lightning run's checkpoints with ModelCheckpoint's
save_top_k=2 and save_last=True, replayed as Lightning saved and removed them) written with
tpde, removal by removal.

For every removal: the steps re-based, the records rewritten, the CPU and wall time of the
re-base and of deleting what went, and the bytes at rest afterwards against what
TorchCheckpointIO holds at that moment (the torch.save files of the kept checkpoints).

    python benchmarks/retention_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads  # noqa: E402

import tpde  # noqa: E402

NAME = "G-lightning-retention"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick-sized run")
    p.add_argument("--json", default=os.path.join(HERE, "results", "retention_bench.json"))
    args = p.parse_args()
    states = workloads.load(NAME, args.quick)
    sizes = workloads.torch_sizes(NAME, args.quick, states)
    removed_after = workloads.removals(NAME, args.quick)
    folder = tempfile.mkdtemp(prefix="tpde-retention-")
    kept: set[int] = set()
    rows = []
    try:
        with tpde.Checkpointer(os.path.join(folder, "run")) as ck:
            for step, state in enumerate(states):
                ck.save(step, state)
                kept.add(step)
                for old in removed_after.get(step, []):
                    cpu, wall = time.process_time(), time.perf_counter()
                    report = ck.remove(old)
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    kept.discard(old)
                    rest = ck.chain.at_rest().total
                    plain = sum(sizes[s] for s in kept)
                    rows.append({"after_save": step, "removed": old,
                                 "rebased_steps": report.rebased_steps,
                                 "rewritten_records": report.rewritten_records,
                                 "rebase_s": report.rebase_seconds, "cpu_s": cpu, "wall_s": wall,
                                 "freed_bytes": report.freed_bytes, "at_rest_bytes": rest,
                                 "torch_checkpointio_bytes": plain})
                    print(f"after save {step:2d}: removed {old:2d}, re-based "
                          f"{report.rebased_steps or '-'} ({report.rewritten_records} records) "
                          f"in {cpu:.2f} s CPU / {wall:.2f} s wall; at rest "
                          f"{rest / 1e6:6.1f} MB vs TorchCheckpointIO {plain / 1e6:6.1f} MB "
                          f"({rest / plain:.2f}x)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rebasing = [r for r in rows if r["rebased_steps"]]
    summary = {
        "removals": len(rows), "removals_that_rebased": len(rebasing),
        "cpu_s_per_removal_median": statistics.median(r["cpu_s"] for r in rows),
        "cpu_s_per_rebasing_removal_median":
            statistics.median(r["cpu_s"] for r in rebasing) if rebasing else 0.0,
        "state_mb": sizes[-1] / 1e6,
        "worst_at_rest_vs_torch": max(r["at_rest_bytes"] / r["torch_checkpointio_bytes"]
                                      for r in rows),
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__}, "quick": args.quick,
                   "summary": summary, "removals": rows}, f, indent=1)


if __name__ == "__main__":
    main()
