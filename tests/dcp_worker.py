"""One rank of a multi-process ``torch.distributed.checkpoint`` run through ``tpde.dcp``
(gloo on the CPU), started by ``tests/test_dcp.py`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set.

    python dcp_worker.py MODE RUN STEP(S) EXPECTED_DIR    # STEPS: N or A:B for a save

Modes: ``dtensor-save`` / ``dtensor-load`` (DTensors sharded by rows and by columns, a
replicated one and plain values; odd steps saved with ``dcp.async_save``), ``fsdp-save`` /
``fsdp-load`` (a small model under FSDP2 ``fully_shard`` with AdamW), and
``sharded-tensor-save`` / ``-load`` (ShardedTensors, what FSDP's sharded state dicts hold).
A save writes steps ``0..STEPS-1`` and rank 0 writes the full state of each to
``EXPECTED_DIR``; a load restores step STEP and compares it with that file.

``TPDE_FAULT=RANK,STEP,KIND,N`` makes rank RANK's save of step STEP meet a fault at its N-th
store operation: ``kill`` (SIGKILL, as ``campaigns/crash.py`` does) or ``fail`` (the disk
refuses a write). After a failed save every rank saves the same step again.
``TPDE_REFERENCE`` is the Writers' ``reference``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import tpde.dcp

warnings.filterwarnings("ignore")


FSYNC = os.fsync
#: fsspec storage options of the run (an S3 server's endpoint and keys), as JSON.
OPTIONS = json.loads(os.environ.get("TPDE_STORAGE_OPTIONS", "null"))


def writer(run: str, step: int) -> tpde.dcp.Writer:
    return tpde.dcp.Writer(run, step, storage_options=OPTIONS,
                           reference=os.environ.get("TPDE_REFERENCE", "store"))


def reader(run: str, step: int | None) -> tpde.dcp.Reader:
    return tpde.dcp.Reader(run, step, storage_options=OPTIONS)


def fault(rank: int, step: int) -> None:
    """Arm ``TPDE_FAULT`` for this rank's save of ``step``."""
    spec = os.environ.get("TPDE_FAULT")
    if not spec:
        return
    at_rank, at_step, kind, n = spec.split(",")
    if (int(at_rank), int(at_step)) != (rank, step):
        return
    if kind == "kill":
        sys.path.insert(0, os.path.dirname(__file__))
        from campaigns.crash import arm

        arm(int(n))
        return
    # The disk refuses the n-th fsync, below tpde's writer: what reaches DCP is tpde's own
    # StoreError for a full disk, as on a real one.
    original, count = os.fsync, [0]

    def failing(fd):
        count[0] += 1
        if count[0] == int(n):
            raise OSError(28, "No space left on device")
        return original(fd)

    os.fsync = failing


def full_states(step: int) -> dict[str, torch.Tensor]:
    """The same on every rank: small updates step after step, as training makes them."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 48, generator=g)
    cols = torch.randn(40, 30, generator=g).bfloat16()
    rep = torch.randn(16, generator=g)
    for k in range(1, step + 1):
        g.manual_seed(k)
        rows = rows + 1e-3 * torch.randn(64, 48, generator=g)
        cols = (cols.float() + 1e-2 * torch.randn(40, 30, generator=g)).bfloat16()
    return {"rows": rows, "cols": cols, "rep": rep}


def dtensor_state(step: int, mesh, empty: bool = False) -> dict:
    full = full_states(step)
    if empty:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {"model": {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                      "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                      "rep": distribute_tensor(full["rep"], mesh, [Replicate()])},
            "meta": {"step": -1 if empty else step, "lr": 0.0 if empty else 0.1 * step}}


def sharded_tensor_state(step: int, empty: bool = False) -> dict:
    """The same tensors as ShardedTensors (what FSDP's sharded state dicts hold): rows split
    by rows, columns by columns, over every rank."""
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    places = [f"rank:{r}/cpu" for r in range(dist.get_world_size())]
    out = {}
    for key, dim in (("rows", 0), ("cols", 1)):
        full = full_states(step)[key]
        t = sharded_empty(ChunkShardingSpec(dim=dim, placements=places), *full.shape,
                          dtype=full.dtype)
        for shard in t.local_shards():
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(torch.zeros(h, w) if empty else full[r:r + h, c:c + w])
        out[key] = t
    return {"model": out, "meta": {"step": -1 if empty else step}}


def local_shards(state: dict) -> dict:
    """Each ShardedTensor's shards on this rank, by their offsets."""
    return {(k, tuple(s.metadata.shard_offsets)): s.tensor
            for k, t in state["model"].items() for s in t.local_shards()}


def gathered(state: dict) -> dict:
    out = {}
    for k, v in state["model"].items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return {"model": out, "meta": dict(state["meta"])}


def same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype)
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                           if b.dim() else b), where
    else:
        assert a == b, (where, a, b)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(24, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def fsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 24, generator=g)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def fsdp_full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    return {"model": m, "optim": o}


def main() -> None:
    mode, run, steps, expected = sys.argv[1:5]
    # "latest=N": load without naming a step (the latest), which must be step N; "A:B": save
    # steps A to B - 1.
    latest = steps.startswith("latest=")
    first = int(steps.split(":")[0]) if ":" in steps else 0
    steps = int(steps.removeprefix("latest=").split(":")[-1])
    # A killed rank leaves the others in a collective: they give up after this long.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "dtensor-save":
        for step in range(first, steps):
            state = dtensor_state(step, mesh)
            fault(rank, step)
            try:
                if step % 2:  # dcp.async_save: staged, then written in the background
                    dcp.async_save(state, storage_writer=writer(run, step)).result()
                else:
                    dcp.save(state, storage_writer=writer(run, step))
            except CheckpointException as exc:  # a rank failed: nothing is committed
                print(f"rank {rank}: step {step} failed: {exc}", flush=True)
                os.fsync = FSYNC
                dcp.save(state, storage_writer=writer(run, step))
            full = gathered(state)  # a collective: on every rank
            if rank == 0:
                torch.save(full, os.path.join(expected, f"step{step}.pt"))
    elif mode == "dtensor-load":
        state = dtensor_state(0, mesh, empty=True)
        dcp.load(state, storage_reader=reader(run, None if latest else steps))
        want = torch.load(os.path.join(expected, f"step{steps}.pt"))
        same(gathered(state), want)
    elif mode == "dtensor-save-without-collectives":
        state = dtensor_state(steps, mesh)
        if dist.get_world_size() == 1:  # one process: the step is whole, and loads back
            dcp.save(state, storage_writer=writer(run, steps), use_collectives=False)
            torch.save(gathered(state), os.path.join(expected, f"step{steps}.pt"))
        else:
            try:
                dcp.save(state, storage_writer=writer(run, steps), use_collectives=False)
                raise AssertionError("every rank committed its own part of the step")
            except tpde.UnsupportedError as exc:
                assert "use_collectives=False) with more than one process" in str(exc), exc
    elif mode == "dtensor-load-racing":
        # Rank 0 reads the latest step; the test commits another before rank 1 does.
        read, committed = os.path.join(expected, "r0-read"), os.path.join(expected, "committed")

        class Racing(tpde.dcp.Reader):
            def read_metadata(self, *args, **kwargs):
                while rank == 1 and not os.path.exists(committed):
                    time.sleep(0.05)
                meta = super().read_metadata(*args, **kwargs)
                if rank == 0:
                    open(read, "w").close()
                return meta

        state = dtensor_state(0, mesh, empty=True)
        try:
            dcp.load(state, storage_reader=Racing(run, None, storage_options=OPTIONS))
            raise AssertionError("the ranks loaded different steps without a word")
        except CheckpointException as exc:
            assert "read different latest steps ([0, 1])" in str(exc), exc
        same(gathered(state), gathered(dtensor_state(0, mesh, empty=True)))  # nothing loaded
        dcp.load(state, storage_reader=reader(run, None))  # again: every rank reads step 1
        same(gathered(state), torch.load(os.path.join(expected, "step1.pt")))
    elif mode == "sharded-tensor-save":
        for step in range(steps):
            dcp.save(sharded_tensor_state(step), storage_writer=writer(run, step))
    elif mode == "sharded-tensor-load":
        state = sharded_tensor_state(0, empty=True)
        dcp.load(state, storage_reader=reader(run, steps))
        same(local_shards(state), local_shards(sharded_tensor_state(steps)))
        assert state["meta"] == {"step": steps}
    elif mode == "fsdp-save":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = fsdp(mesh)
        for step in range(steps):
            train(model, opt, step)
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o}, storage_writer=writer(run, step))
            full = fsdp_full(model, opt)
            if rank == 0:
                torch.save(full, os.path.join(expected, f"step{step}.pt"))
    elif mode == "fsdp-load":
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, opt = fsdp(mesh)
        train(model, opt, 0)  # optimizer state exists, with other values than the saved ones
        m, o = get_state_dict(model, opt)
        state = {"model": m, "optim": o}
        dcp.load(state, storage_reader=reader(run, steps))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        full = fsdp_full(model, opt)
        if rank == 0:
            same(full, torch.load(os.path.join(expected, f"step{steps}.pt")))
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {mode} ok", flush=True)
    # Everything is checked and written: skip interpreter teardown, where gloo's worker threads
    # sometimes abort the process ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main()
