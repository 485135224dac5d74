"""One writer per run: a second is refused, a dead one is taken over, readers never wait."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

import tpde
from tpde.cli import main


def test_second_writer_is_refused_and_readers_are_not(store_url) -> None:
    url, opts = store_url
    first = tpde.Checkpointer(url, storage_options=opts)
    first.save(0, {"w": torch.ones(10)})
    second = tpde.Checkpointer(url, storage_options=opts)
    with pytest.raises(tpde.WriterConflictError, match=f"pid {os.getpid()}"):
        second.save(1, {"w": torch.zeros(10)})
    with pytest.raises(tpde.WriterConflictError):
        second.remove(0)
    reader = tpde.Checkpointer(url, storage_options=opts)
    assert torch.equal(reader.load(0)["w"], torch.ones(10)) and reader.verify() == []
    first.save(1, {"w": torch.full((10,), 2.0)})  # the holder goes on writing
    first.close()
    second.save(2, {"w": torch.zeros(10)})
    assert second.steps() == [0, 1, 2]


def _write_then_die(url: str) -> None:
    tpde.Checkpointer(url).save(0, {"w": torch.ones(10)})
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_whose_process_died_is_taken_over(tmp_path) -> None:
    url = str(tmp_path / "run")
    child = multiprocessing.get_context("fork").Process(target=_write_then_die, args=(url,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    holder = json.loads((tmp_path / "run" / "lease.json").read_text())
    assert holder["pid"] == child.pid  # the dead job never released it
    ck = tpde.Checkpointer(url)
    ck.save(1, {"w": torch.zeros(10)})
    assert ck.steps() == [0, 1]


def test_expired_lease_is_taken_over_and_takeover_steals_a_live_one(tmp_path) -> None:
    url = str(tmp_path / "run")
    short = tpde.Checkpointer(url, lease_seconds=0.2)
    short.save(0, {"w": torch.ones(3)})
    time.sleep(0.3)
    later = tpde.Checkpointer(url)
    later.save(1, {"w": torch.ones(3)})
    with pytest.raises(tpde.WriterConflictError):
        short.save(2, {"w": torch.ones(3)})  # it lost the run while its lease was expired
    thief = tpde.Checkpointer(url, takeover=True)
    thief.save(2, {"w": torch.ones(3)})
    with pytest.raises(tpde.WriterConflictError):
        later.save(3, {"w": torch.ones(3)})


def test_a_held_lease_is_written_again_only_once_half_of_it_has_run_out(tmp_path) -> None:
    # Half of a 2 s lease is less than RENEW_AFTER: renewed after 1 s.
    url = str(tmp_path / "run")
    lease = tmp_path / "run" / "lease.json"
    ck = tpde.Checkpointer(url, lease_seconds=2.0)
    ck.save(0, {"w": torch.ones(3)})
    first = json.loads(lease.read_text())["expires"]
    ck.save(1, {"w": torch.ones(3)})
    ck.remove(0)
    assert json.loads(lease.read_text())["expires"] == first  # read, not written again
    time.sleep(1.1)
    ck.save(2, {"w": torch.ones(3)})
    assert json.loads(lease.read_text())["expires"] > first  # renewed past half its time
    thief = tpde.Checkpointer(url, takeover=True)
    thief.save(3, {"w": torch.ones(3)})
    with pytest.raises(tpde.WriterConflictError):
        ck.save(4, {"w": torch.ones(3)})  # a lease still fresh is read: the thief is seen
    assert thief.steps() == [1, 2, 3]


def test_cli_gc_waits_for_the_writer_unless_forced(tmp_path, capsys) -> None:
    url = str(tmp_path / "run")
    ck = tpde.Checkpointer(url)
    ck.save(0, {"w": torch.ones(3)})
    assert main(["gc", url, "--grace", "0"]) == 1
    assert "another writer holds this run" in capsys.readouterr().err
    assert main(["gc", url, "--grace", "0", "--force"]) == 0
    assert not (tmp_path / "run" / "lease.json").exists()
    ck.close()


@pytest.mark.parametrize("takeover", [False, True])
def test_of_two_writers_taking_the_lease_at_once_one_gets_it(store_url, takeover) -> None:
    """Writer A has read the lease and not yet written it when writer B tries: taking the lease
    is one step (a lock, or a conditional request), so exactly one of them holds it. With
    ``takeover`` both mean to take it from whoever holds it: one ends holding it, and the
    other is refused at its next write."""
    from tpde.store.lease import Lease
    from tpde.store.store import Store

    url, opts = store_url
    store = Store(url, opts)
    if takeover:
        Lease(store).acquire()  # a holder that both take the run from
    a, b = Lease(store), Lease(store)
    read, entered, go = a._read, threading.Event(), threading.Event()

    def paused() -> tuple:
        out = read()
        entered.set()
        go.wait(10)
        return out

    a._read = paused  # type: ignore[method-assign]
    said: dict[str, str] = {}

    def take(name: str, lease: Lease) -> None:
        try:
            lease.acquire(takeover=takeover)
            said[name] = "held"
        except tpde.WriterConflictError:
            said[name] = "refused"

    first = threading.Thread(target=take, args=("a", a))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=take, args=("b", b))
    second.start()
    second.join(1.0)  # where a lock decides, B waits here for A
    go.set()
    first.join(30)
    second.join(30)
    holder = Lease(store).current()
    assert holder is not None and holder.owner in (a.owner, b.owner)
    if not takeover:
        assert sorted(said.values()) == ["held", "refused"], said
        assert holder.owner == (a if said["a"] == "held" else b).owner
    else:  # one after the other is a takeover too; the one it was taken from learns it next
        other = a if holder.owner == b.owner else b
        with pytest.raises(tpde.WriterConflictError):
            other.acquire()
