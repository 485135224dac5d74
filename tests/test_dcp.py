"""tpde as the storage layer under torch.distributed.checkpoint: real multi-process runs (gloo on
the CPU, free ports), DTensor and FSDP2 states saved as deltas, restored bit-exactly on the same
world size, resharded 2 -> 1 and 1 -> 2, and consolidated into one state dict."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import tpde
import tpde.dcp
from forked import Forked
from tpde.chain import Chain

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "dcp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(world: int, *args: object, env: dict[str, str] | None = None) -> list[Forked]:
    """``dcp_worker.py`` started as ``world`` processes of one gloo group (forked from a
    server that imported torch and tpde once: ``forked.py``)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(Forked(WORKER, [str(a) for a in args], env))
    return procs


def ranks(world: int, *args: object, timeout: float = 120, check: bool = True,
          env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``dcp_worker.py`` as ``world`` processes of one gloo group; with ``check`` every
    rank must pass."""
    return finish(start(world, *args, env=env), args, timeout=timeout, check=check)


def finish(procs: list[Forked], args: tuple, *, timeout: float = 120,
           check: bool = True) -> list[subprocess.CompletedProcess]:
    """Wait for ranks started by ``start``."""
    world = len(procs)
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:  # one rank failing leaves the others waiting in a collective
            p.kill()
            p.wait()  # reaped: a killed coordinator's pid no longer looks alive to its lease
    for rank, d in enumerate(done):
        assert d.returncode == 0 or not check, \
            f"rank {rank} of {world} ({args[0]}) failed:\n{d.stderr[-4000:]}"
    return done


def test_dtensor_steps_are_deltas_restore_exactly_and_reshard(tmp_path) -> None:
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    ranks(2, "dtensor-save", run, 3, want)
    chain = Chain(run)
    assert chain.steps() == [0, 1, 2]
    for step in (1, 2):
        m = chain.manifest(step)
        assert m.format == 6 and len(m.shards) == 2 and m.dcp["world_size"] == 2
        codecs = {r.name: r.codec for r in m.records}
        # Each rank's chunk of the row- and column-sharded tensors is a delta of itself.
        assert codecs["model.rows[0:32,0:48]"] in ("dense", "sparse")
        assert codecs["model.cols[0:40,15:30]"] in ("dense", "sparse")
        assert codecs["model.rep[0:16]"] == "same"
    assert chain.manifest(2).stored_bytes < chain.manifest(0).stored_bytes
    for step in (0, 1, 2):
        ranks(2, "dtensor-load", run, step, want)  # 2 -> 2
    ranks(1, "dtensor-load", run, 2, want)  # 2 -> 1
    full = tpde.dcp.load_full(run, 2)  # one process, no process group
    expected = torch.load(want / "step2.pt")
    for k, v in expected["model"].items():
        assert torch.equal(full["model"][k], v), k
    assert full["meta"] == expected["meta"]

    # The same run saved by one process: its chunks have another layout, so they are keyframe
    # records (nothing is coded against a chunk of another shape), and both steps load.
    ranks(1, "dtensor-save", run, "3:4", want)
    step3 = Chain(run).manifest(3)
    assert step3.dcp["world_size"] == 1 and len(step3.shards) == 1
    assert {r.codec for r in step3.records if r.name.startswith("model.rows")} == {"key"}
    ranks(2, "dtensor-load", run, 3, want)
    ranks(2, "dtensor-load", run, 2, want)

    # 1 -> 2: a step saved by one process (new chunk layouts: keyframe records) loads on two.
    one = str(tmp_path / "one")
    ranks(1, "dtensor-save", one, 2, want)
    assert all(r.codec != "key" for r in Chain(one).manifest(1).records
               if r.name.startswith("model.rows"))
    ranks(2, "dtensor-load", one, 1, want)
    ranks(2, "dtensor-load", one, "latest=1", want)


def test_a_latest_load_never_mixes_steps_when_a_save_commits_meanwhile(tmp_path) -> None:
    """``Reader(run)`` without a step: rank 0 resolves step 0, step 1 commits, then rank 1
    resolves. The load is refused on every rank before anything is read; loading again reads
    step 1 on both."""
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    ranks(2, "dtensor-save", run, 1, want)
    loading = start(2, "dtensor-load-racing", run, "latest=1", want)
    deadline = time.monotonic() + 120
    while not (want / "r0-read").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in loading), \
            "rank 0 never read the metadata"
        time.sleep(0.05)
    ranks(1, "dtensor-save", run, "1:2", want)  # step 1 commits while the load is under way
    (want / "committed").touch()
    finish(loading, ("dtensor-load-racing",))


def test_a_save_without_collectives_is_refused_on_two_ranks_and_whole_on_one(tmp_path) -> None:
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    ranks(2, "dtensor-save-without-collectives", run, 0, want)
    assert not os.path.exists(run)  # refused before anything was written
    ranks(1, "dtensor-save-without-collectives", run, 0, want)
    ranks(2, "dtensor-load", run, 0, want)


def test_sharded_tensors_as_fsdp_saves_them(tmp_path) -> None:
    """ShardedTensor, what FSDP's sharded state dicts (``FSDPStrategy(state_dict_type=
    "sharded")``) hold: saved as deltas, restored on 2 ranks and resharded onto 1."""
    from dcp_worker import full_states

    run = str(tmp_path / "run")
    ranks(2, "sharded-tensor-save", run, 3, tmp_path)
    m = Chain(run).manifest(2)
    assert len(m.shards) == 2 and {r.codec for r in m.records} <= {"dense", "sparse"}
    for step in (0, 2):
        ranks(2, "sharded-tensor-load", run, step, tmp_path)
    ranks(1, "sharded-tensor-load", run, 1, tmp_path)
    full = tpde.dcp.load_full(run, 2)
    assert all(torch.equal(full["model"][k], v) for k, v in full_states(2).items() if k != "rep")


def test_fsdp2_model_and_optimizer_restore_exactly(tmp_path) -> None:
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    ranks(2, "fsdp-save", run, 3, want)
    m = Chain(run).manifest(2)
    assert any(r.ref is not None for r in m.records)
    assert any(name.startswith("optim.state.") for name in m.dcp["tensors"])
    for step in (0, 2):
        ranks(2, "fsdp-load", run, step, want)
    ranks(1, "fsdp-load", run, 2, want)
    full = tpde.dcp.load_full(run, 2)
    expected = torch.load(want / "step2.pt")
    for k, v in expected["model"].items():
        assert torch.equal(full["model"][k], v), k

    # Every front end reads the sharded step as one checkpoint.
    sys.path.insert(0, os.path.dirname(WORKER))
    from dcp_worker import Net

    weights = tpde.load_state_dict(run, 2, model=Net())
    assert all(torch.equal(weights[k], v) for k, v in expected["model"].items())
    dense = Net()
    dense.load_state_dict(expected["model"])
    x = torch.randn(5, 24)
    mounted = tpde.mount(run, 2, model=Net().to("meta"), budget=0)
    assert torch.equal(mounted(x), dense(x))
    out = tmp_path / "full.pt"
    subprocess.run([sys.executable, "-m", "tpde.cli", "restore", run, "--step", "2",
                    "--output", str(out)], check=True, capture_output=True)
    restored = torch.load(out)
    assert restored["optim"]["param_groups"] == full["optim"]["param_groups"]
    for k, v in expected["model"].items():
        assert torch.equal(restored["model"][k], v), k
    verify = subprocess.run([sys.executable, "-m", "tpde.cli", "verify", run],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    listed = json.loads(subprocess.run([sys.executable, "-m", "tpde.cli", "ls", run, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert [s["ranks"] for s in listed["steps"]] == [2, 2, 2]

    # Removing a step re-bases the one that reads from it into one blob of its own.
    ck = tpde.Checkpointer(run)
    ck.remove(1)
    ck.gc(grace_seconds=0)
    m = Chain(run).manifest(2)
    assert m.shards == [] and m.format == 6 and all(r.ref != 1 for r in m.records)
    again = tpde.dcp.load_full(run, 2)
    for k, v in expected["model"].items():
        assert torch.equal(again["model"][k], v), k
    ranks(2, "fsdp-load", run, 2, want)


def test_a_single_process_save_and_bad_loads(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    run = str(tmp_path / "run")
    state = {"w": torch.arange(12.0).reshape(3, 4), "n": 7}
    dcp.save(state, storage_writer=tpde.dcp.Writer(run, 0))
    with pytest.raises(BaseException, match="tensor 'w'.*saved as torch.float32"):
        dcp.load({"w": torch.zeros(3, 4, dtype=torch.float64), "n": 0},
                 storage_reader=tpde.dcp.Reader(run))
    with pytest.raises(BaseException, match="Size mismatch"):  # DCP's own check
        dcp.load({"w": torch.zeros(3, 5), "n": 0}, storage_reader=tpde.dcp.Reader(run))
    with pytest.raises(BaseException, match="already committed"):
        dcp.save(state, storage_writer=tpde.dcp.Writer(run, 0))
    with pytest.raises(tpde.TPDEError, match="checkpoint_id"):
        dcp.save(state, checkpoint_id=str(tmp_path / "elsewhere"),
                 storage_writer=tpde.dcp.Writer(run, 1))
    tpde.Checkpointer(str(tmp_path / "plain")).save(0, {"w": state["w"]})
    with pytest.raises(tpde.UnsupportedError, match="Checkpointer"):
        tpde.dcp.load_full(str(tmp_path / "plain"), 0)



def test_held_words_serve_only_the_save_that_made_them(tmp_path) -> None:
    """``reference="host"`` (the default) codes a delta against this process's words of the
    step before, which must be that very save: not a step of the same number in a run made
    again at the same place (here by a save that holds nothing, ``reference="store"``)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    run = str(tmp_path / "run")
    again = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    first = again.clone()
    first[1000:1064] -= 1.0  # close enough that a delta against it would be taken
    dcp.save({"w": first}, storage_writer=tpde.dcp.Writer(run, 0))
    shutil.rmtree(run)
    dcp.save({"w": again}, storage_writer=tpde.dcp.Writer(run, 0, reference="store"))
    later = again.clone()
    later[:64] += 1.0
    dcp.save({"w": later}, storage_writer=tpde.dcp.Writer(run, 1))
    assert Chain(run).manifest(1).record("w[0:4096]").codec != "key"  # a delta of step 0
    assert torch.equal(tpde.dcp.load_full(run, 1)["w"], later)
    assert tpde.Checkpointer(run).verify() == []

HOLDER = """
import sys, torch, tpde
ck = tpde.Checkpointer(sys.argv[1])
ck.save(0, {"w": torch.ones(4)})
print("held", flush=True)
sys.stdin.read()
ck.close()
"""


def test_the_coordinator_holds_the_writer_lease(tmp_path) -> None:
    """A second job saving into a run is refused before anything is written; the lease passes
    on when the first job lets go, and this process's saves are one writer."""
    import torch.distributed.checkpoint as dcp

    run = str(tmp_path / "run")
    other = subprocess.Popen([sys.executable, "-c", HOLDER, run], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        with pytest.raises(BaseException, match="another writer holds this run") as refused:
            dcp.save({"w": torch.zeros(4)}, storage_writer=tpde.dcp.Writer(run, 1))
        assert "WriterConflictError" in repr(refused.value)
        assert Chain(run).steps() == [0]
        assert not list((tmp_path / "run" / "data").glob(f"{'0' * 19}1*"))  # no blob of step 1
    finally:
        other.communicate("", timeout=60)
    assert other.returncode == 0
    for step in (1, 2):  # two Writers, one job: the second holds the lease the first took
        dcp.save({"w": torch.full((4,), float(step))},
                 storage_writer=tpde.dcp.Writer(run + "/", step))
    with pytest.raises(tpde.WriterConflictError):
        tpde.Checkpointer(run).save(3, {"w": torch.ones(4)})
    assert Chain(run).steps() == [0, 1, 2]


def test_a_rank_killed_mid_save_leaves_every_committed_step(tmp_path) -> None:
    """Rank 1 is SIGKILLed while it writes its blob of step 2: the step never appears, steps
    0 and 1 restore exactly, the next save of step 2 works, and gc deletes what was left."""
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    done = ranks(2, "dtensor-save", run, 3, want, check=False,
                 env={"TPDE_FAULT": "1,2,kill,2"})
    assert done[1].returncode == -9, done[1].stderr[-2000:]
    chain = Chain(run)
    assert chain.steps() == [0, 1]
    for step in (0, 1):
        ranks(2, "dtensor-load", run, step, want)
    leftovers = chain.at_rest().leftovers
    assert leftovers > 0  # rank 0's blob of step 2, and the part rank 1 wrote
    cleaner = tpde.Checkpointer(run)
    cleaner.gc(grace_seconds=0)
    cleaner.close()  # gc holds the writer lease until then
    assert Chain(run).at_rest().leftovers == 0 and Chain(run).steps() == [0, 1]
    ranks(2, "dtensor-save", run, "2:3", want)
    ranks(2, "dtensor-load", run, 2, want)


def test_a_rank_that_fails_commits_nothing_and_the_next_save_works(tmp_path) -> None:
    """Rank 1's disk refuses a write of step 1: every rank sees the failure, the step is not
    committed, and saving it again on every rank commits it."""
    run, want = str(tmp_path / "run"), tmp_path / "expected"
    want.mkdir()
    done = ranks(2, "dtensor-save", run, 3, want, env={"TPDE_FAULT": "1,1,fail,1"})
    assert all("step 1 failed" in d.stdout for d in done)
    # The coordinator names rank 1's StoreError: the cause, and what to do.
    assert "StoreError" in done[0].stdout and "No space left on device" in done[0].stdout
    assert "every committed step is intact" in done[0].stdout
    assert Chain(run).steps() == [0, 1, 2]
    for step in (1, 2):
        ranks(2, "dtensor-load", run, step, want)


@pytest.mark.s3
def test_sharded_steps_on_s3(tmp_path, s3_server) -> None:
    import json
    import uuid

    options = s3_server["options"]
    run, want = f"s3://tpde/dcp-{uuid.uuid4().hex[:10]}", tmp_path / "expected"
    want.mkdir()
    env = {"TPDE_STORAGE_OPTIONS": json.dumps(options)}
    ranks(2, "dtensor-save", run, 3, want, env=env)
    assert Chain(run, options).manifest(2).shards
    ranks(2, "dtensor-load", run, 2, want, env=env)
    ranks(1, "dtensor-load", run, 1, want, env=env)
    full = tpde.dcp.load_full(run, 2, storage_options=options)
    expected = torch.load(want / "step2.pt")
    for k, v in expected["model"].items():
        assert torch.equal(full["model"][k], v), k


def test_large_chunks_are_stored_in_pieces_and_coded_as_deltas(tmp_path) -> None:
    """A chunk larger than half of max_inflight_bytes is stored as pieces, each a delta of the
    same piece at the previous step; loads put the chunk back together."""
    import torch.distributed.checkpoint as dcp

    run = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 100, generator=g)
    for step in range(3):
        w = w + 1e-3 * torch.randn(100, 100, generator=g)
        dcp.save({"w": w}, storage_writer=tpde.dcp.Writer(run, step, max_inflight_bytes=8192))
        assert torch.equal(tpde.dcp.load_full(run, step)["w"], w)
    m = Chain(run).manifest(2)
    assert len(m.records) == 10 and all(r.name.startswith("w[0:100,0:100]/") for r in m.records)
    assert all(r.ref == 1 for r in m.records)
    back = {"w": torch.zeros(100, 100)}
    dcp.load(back, storage_reader=tpde.dcp.Reader(run))
    assert torch.equal(back["w"], w)


def test_host_references_code_exactly_as_store_references(tmp_path) -> None:
    """reference="host" keeps each rank's words between saves instead of reading them back:
    the same records, byte for byte, and the steps restore."""
    want = tmp_path / "expected"
    want.mkdir()
    runs = {}
    for how in ("store", "host"):
        runs[how] = str(tmp_path / how)
        ranks(2, "dtensor-save", runs[how], 3, want, env={"TPDE_REFERENCE": how})
    a, b = Chain(runs["store"]), Chain(runs["host"])
    for step in (1, 2):
        mine = {r.name: (r.codec, r.ref, r.hash, r.stored_bytes) for r in b.manifest(step).records}
        assert mine == {r.name: (r.codec, r.ref, r.hash, r.stored_bytes)
                        for r in a.manifest(step).records}
    ranks(2, "dtensor-load", runs["host"], 2, want)
