"""One writer per run: a second is refused, a dead one is taken over, readers never wait."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
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
