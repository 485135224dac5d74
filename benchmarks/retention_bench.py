"""What re-basing costs: workload G (a Lightning run's checkpoints with ModelCheckpoint's
save_top_k=2 and save_last=True, replayed as Lightning saved and removed them) written with
tpde, removal by removal, twice: each removal freed at once (``Checkpointer.remove``), and
deferred as the Lightning plugin removes (``remove(..., defer=True)``: freed once the run would
hold more than the plain files, and at close).

For every removal: the steps re-based and freed, the records rewritten, the CPU and wall time
of the re-base and of deleting what went, and the bytes at rest afterwards against what
TorchCheckpointIO holds at that moment (the torch.save files of the kept checkpoints); then
the writer's close, and the totals.

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


def replay(states: list, sizes: list[int], removed_after: dict[int, list[int]], defer: bool
           ) -> dict:
    """G's saves and removals on one writer; a row per removal, then the writer's close."""
    folder = tempfile.mkdtemp(prefix="tpde-retention-")
    kept: set[int] = set()
    rows = []
    how = "deferred" if defer else "at once"
    try:
        ck = tpde.Checkpointer(os.path.join(folder, "run"))
        for step, state in enumerate(states):
            ck.save(step, state)
            kept.add(step)
            for old in removed_after.get(step, []):
                cpu, wall = time.process_time(), time.perf_counter()
                report = ck.remove(old, defer=defer)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                kept.discard(old)
                rest = ck.chain.at_rest().total
                plain = sum(sizes[s] for s in kept)
                rows.append({"after_save": step, "removed": old,
                             "rebased_steps": report.rebased_steps,
                             "rewritten_records": report.rewritten_records,
                             "purged_steps": report.purged_steps,
                             "rebase_s": report.rebase_seconds, "cpu_s": cpu, "wall_s": wall,
                             "freed_bytes": report.freed_bytes, "at_rest_bytes": rest,
                             "torch_checkpointio_bytes": plain})
                print(f"{how}: after save {step:2d}: removed {old:2d}, re-based "
                      f"{report.rebased_steps or '-'} ({report.rewritten_records} records), "
                      f"freed {report.purged_steps or '-'} in {cpu:.2f} s CPU / {wall:.2f} s "
                      f"wall; at rest {rest / 1e6:6.1f} MB vs TorchCheckpointIO "
                      f"{plain / 1e6:6.1f} MB ({rest / plain:.2f}x)", flush=True)
        cpu, wall = time.process_time(), time.perf_counter()
        closed = ck.close()  # frees what deferred removals still hold
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        final = tpde.Checkpointer(os.path.join(folder, "run")).chain.at_rest().total
        print(f"{how}: close re-based {closed.rebased_steps or '-'}, freed "
              f"{closed.purged_steps or '-'} in {cpu:.2f} s CPU / {wall:.2f} s wall; at rest "
              f"{final / 1e6:.1f} MB", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rebasing = [r for r in rows if r["rebased_steps"]]
    return {"summary": {
        "removals": len(rows), "removals_that_rebased": len(rebasing),
        "steps_rebased": sum(len(r["rebased_steps"]) for r in rows) + len(closed.rebased_steps),
        "cpu_s_all_removals_and_close": sum(r["cpu_s"] for r in rows) + cpu,
        "wall_s_all_removals_and_close": sum(r["wall_s"] for r in rows) + wall,
        "cpu_s_per_rebasing_removal_median":
            statistics.median(r["cpu_s"] for r in rebasing) if rebasing else 0.0,
        "worst_at_rest_vs_torch": max(r["at_rest_bytes"] / r["torch_checkpointio_bytes"]
                                      for r in rows),
        "final_at_rest_bytes": final}, "removals": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick-sized run")
    p.add_argument("--json", default=os.path.join(HERE, "results", "retention_bench.json"))
    args = p.parse_args()
    states = workloads.load(NAME, args.quick)
    sizes = workloads.torch_sizes(NAME, args.quick, states)
    removed_after = workloads.removals(NAME, args.quick)
    out = {how: replay(states, sizes, removed_after, defer=how == "deferred")
           for how in ("at once", "deferred")}
    print(json.dumps({how: r["summary"] for how, r in out.items()}, indent=1))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__}, "quick": args.quick,
                   "state_mb": sizes[-1] / 1e6, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
