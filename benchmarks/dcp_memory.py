"""What a sharded save costs each rank in memory: the peak rise of its resident set over one
``dcp.save`` (a keyframe, then a delta coded against the previous step read back from the
store), beside DCP's ``FileSystemWriter`` saving the same state.

Two ranks (gloo, CPU) each hold 256 MB of fp32 shards (8 DTensors sharded by rows); tpde runs
with ``max_inflight_bytes`` = 32 MiB. The peak is reset through ``/proc/self/clear_refs``
before each save and read from ``VmHWM`` after it.

    python benchmarks/dcp_memory.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from dcp_bench import end_rank, launch_ranks
from mount_memory import _rss_kb

HERE = os.path.dirname(os.path.abspath(__file__))
INFLIGHT = 32 << 20


def rank_main(out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import tpde.dcp

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    # 8 tensors of 64 MB each, sharded by rows: 256 MB per rank.
    state = {f"w{i}": distribute_tensor(torch.randn(4096, 4096, generator=g), mesh, [Shard(0)])
             for i in range(8)}
    peaks = {}

    def measure(name: str, save) -> None:
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_kb("VmRSS:")
        save()
        peaks[name] = (_rss_kb("VmHWM:") - base) / 1024
        dist.barrier()

    measure("dcp", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
        os.path.join(out, "dcp"))))
    for step in range(2):
        if step:
            with torch.no_grad():
                for t in state.values():
                    t.add_(1e-3)
        measure(f"tpde step {step}", lambda: dcp.save(state, storage_writer=tpde.dcp.Writer(
            os.path.join(out, "tpde"), step, reference="store", max_inflight_bytes=INFLIGHT)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(peaks, f)
    end_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", default=os.path.join(HERE, "results", "dcp_memory.json"))
    p.add_argument("--rank", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        rank_main(args.rank)
        return
    with tempfile.TemporaryDirectory(prefix="tpde-dcp-memory-") as out:
        launch_ranks([sys.executable, __file__, "--rank", out])
        ranks = []
        for r in range(2):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    print(f"peak rise of each rank's resident set over one save of its 256 MB of shards "
          f"(tpde: max_inflight_bytes = {INFLIGHT >> 20} MiB)")
    for name in ranks[0]:
        print(f"  {name:12s} " + "  ".join(f"rank {r}: {ranks[r][name]:7.1f} MiB"
                                            for r in range(2)))
    with open(args.json, "w") as f:
        json.dump({"state_mb_per_rank": 256, "max_inflight_bytes": INFLIGHT, "ranks": ranks},
                  f, indent=1)


if __name__ == "__main__":
    main()
