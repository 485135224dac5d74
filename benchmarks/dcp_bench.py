"""A 2-rank FSDP2 fine-tune (gloo on the CPU) checkpointed every few steps four ways, from the
same states: DCP's ``FileSystemWriter``, the same with DCP's experimental ``ZStandard``
extension, ``tpde.dcp.Writer`` (sharded, each rank its own deltas; references read back from
the store, or kept in host memory with ``reference="host"``), and a single-process
``tpde.Checkpointer`` save of the gathered full state (what a run without DCP would do).

Measured: bytes at rest after all saves, each save's time (wall clock around ``dcp.save``,
the slower rank; the single-process save includes gathering the full state), and the time to
restore the last step on 2 ranks (``dcp.load``; for the single-process run, ``Checkpointer.load``
then ``set_state_dict`` from the full state on every rank).

    python benchmarks/dcp_bench.py [--dim 512 --layers 4 --saves 5 --every 2] [--json PATH]

The model is a small GPT-style stack of linear layers in fp32 with AdamW (weights and two
moments: the hardest case for deltas, see benchmarks/README.md), trained on fixed random data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

from tpde.chain import Chain
from tpde.manifest import plain

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("dcp", "dcp+zstd", "tpde.dcp", "tpde.dcp, host ref", "tpde (1 process)")


def launch_ranks(argv: list[str]) -> None:
    """Run ``argv`` as 2 ranks of one gloo group (one thread each); both must succeed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(argv, env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                         "OMP_NUM_THREADS": "1"}) for r in range(2)]
    if any(p.wait() for p in procs):
        raise SystemExit("a rank failed")


def end_rank() -> None:
    """Leave the group and exit: gloo's threads sometimes abort interpreter teardown."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tpde
    import tpde.dcp

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                   torch.nn.Linear(4 * args.dim, args.dim)]
    model = torch.nn.Sequential(torch.nn.Embedding(args.vocab, args.dim), *blocks,
                                torch.nn.Linear(args.dim, args.vocab))
    for layer in model:
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    out = args.out
    times: dict[str, list[float]] = {m: [] for m in METHODS}

    def timed(method: str, fn) -> None:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        times[method].append(time.perf_counter() - t)

    saved = []
    # The single-process run keeps one writer, as a training job does: each save is a delta
    # against the one before.
    single_writer = tpde.Checkpointer(os.path.join(out, "tpde1"), reference="store") \
        if rank == 0 else None
    for step in range(args.saves * args.every):
        x = torch.randint(0, args.vocab, (8, 32), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, args.vocab),
                                                 x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every:
            continue
        n = len(saved)
        m, o = get_state_dict(model, opt)
        state = {"model": m, "optim": o}
        timed("dcp", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
            os.path.join(out, "dcp", str(n)))))
        timed("dcp+zstd", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(
            os.path.join(out, "dcp+zstd", str(n)), _extensions=[ZStandard()])))
        timed("tpde.dcp", lambda: dcp.save(state, storage_writer=tpde.dcp.Writer(
            os.path.join(out, "tpde.dcp"), n, reference="store")))
        timed("tpde.dcp, host ref", lambda: dcp.save(state, storage_writer=tpde.dcp.Writer(
            os.path.join(out, "tpde.dcp-host"), n, reference="host")))

        def single() -> None:
            fm, fo = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
            if rank == 0:
                single_writer.save(n, {"model": fm, "optim": fo})

        timed("tpde (1 process)", single)
        saved.append(n)
    if single_writer is not None:
        single_writer.close()
    last = saved[-1]
    restore: dict[str, float] = {}

    def fresh() -> dict:
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    for method, reader in (("dcp", lambda: dcp.FileSystemReader(os.path.join(out, "dcp",
                                                                             str(last)))),
                           ("dcp+zstd", lambda: dcp.FileSystemReader(
                               os.path.join(out, "dcp+zstd", str(last)))),
                           ("tpde.dcp", lambda: tpde.dcp.Reader(os.path.join(out, "tpde.dcp"),
                                                                last)),
                           ("tpde.dcp, host ref", lambda: tpde.dcp.Reader(
                               os.path.join(out, "tpde.dcp-host"), last))):
        state = fresh()
        dist.barrier()
        t = time.perf_counter()
        dcp.load(state, storage_reader=reader())
        dist.barrier()
        restore[method] = time.perf_counter() - t
    dist.barrier()
    t = time.perf_counter()
    full = tpde.Checkpointer(os.path.join(out, "tpde1")).load(last)
    set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True))
    dist.barrier()
    restore["tpde (1 process)"] = time.perf_counter() - t
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump({"save_seconds": times, "restore_seconds": restore}, f)
    end_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--every", type=int, default=2, help="optimizer steps between saves")
    p.add_argument("--json", default=os.path.join(HERE, "results", "dcp_bench.json"))
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        rank_main(args)
        return
    out = tempfile.mkdtemp(prefix="tpde-dcp-bench-")
    try:
        launch_ranks([sys.executable, __file__, "--rank", "--out", out, "--dim", str(args.dim),
                      "--layers", str(args.layers), "--vocab", str(args.vocab),
                      "--saves", str(args.saves), "--every", str(args.every)])
        with open(os.path.join(out, "times.json")) as f:
            measured = json.load(f)
        stored = {"dcp": folder_bytes(os.path.join(out, "dcp")),
                  "dcp+zstd": folder_bytes(os.path.join(out, "dcp+zstd")),
                  "tpde.dcp": folder_bytes(os.path.join(out, "tpde.dcp")),
                  "tpde.dcp, host ref": folder_bytes(os.path.join(out, "tpde.dcp-host")),
                  "tpde (1 process)": folder_bytes(os.path.join(out, "tpde1"))}
        state_bytes = folder_bytes(os.path.join(out, "dcp", "0"))
        chain = {}

        for m in ("tpde.dcp", "tpde1"):
            c = Chain(os.path.join(out, m))
            steps = c.steps()
            framed = c.store.read(f"steps/{steps[-1]:020d}.json")
            chain[m] = {"stored_bytes_per_save": [c.manifest(s).stored_bytes for s in steps],
                        "records_per_save": len(c.manifest(steps[-1]).records),
                        "manifest_bytes": len(framed), "manifest_json_bytes": len(plain(framed))}
        ours = chain["tpde.dcp"]
        per_save = [round(b / 1e6, 1) for b in ours["stored_bytes_per_save"]]
        print(f"tpde.dcp per save: {per_save} MB; manifest {ours['manifest_bytes'] / 1e3:.1f} kB "
              f"stored, {ours['manifest_json_bytes'] / 1e3:.1f} kB of JSON for "
              f"{ours['records_per_save']} records")
        rows = []
        print(f"{args.saves} saves of a {state_bytes / 1e6:.1f} MB FSDP2 state (2 ranks); "
              "bytes at rest, ratio against DCP, median save seconds, restore of the last step")
        for m in METHODS:
            saves = sorted(measured["save_seconds"][m])
            row = {"method": m, "stored_bytes": stored[m],
                   "ratio_vs_dcp": stored["dcp"] / stored[m],
                   "save_seconds_median": saves[len(saves) // 2],
                   "save_seconds": measured["save_seconds"][m],
                   "restore_seconds": measured["restore_seconds"][m]}
            rows.append(row)
            print(f"  {m:19s} {stored[m] / 1e6:8.1f} MB  {row['ratio_vs_dcp']:5.2f}x  "
                  f"save {row['save_seconds_median']:6.2f} s  "
                  f"restore {row['restore_seconds']:6.2f} s")
        with open(args.json, "w") as f:
            json.dump({"state_bytes_per_save": state_bytes, "saves": args.saves,
                       "every": args.every, "dim": args.dim, "layers": args.layers,
                       "vocab": args.vocab, "rows": rows, "chains": chain}, f, indent=1)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
