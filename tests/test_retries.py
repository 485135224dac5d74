"""Remote stores fail transiently: writes and reads retry, a lost reply is resolved by the object."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Iterator

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import tpde
from tpde.store import store


class Failing(MemoryFileSystem):
    """An in-memory store whose next calls fail as a flaky object store's do."""

    protocol = "failing"
    faults: list[str] = []
    #: Set when the test ends: a stalled write then lands (after its deadline passed).
    release = threading.Event()
    stalled: list[threading.Thread] = []

    def _fault(self, op: str) -> str | None:
        if self.faults and self.faults[0].startswith(op):
            return self.faults.pop(0)
        return None

    def pipe_file(self, path, value, **kwargs):
        fault = self._fault("put")
        if fault == "put-500":
            raise OSError(500, "InternalError (injected)")
        if fault == "put-stall":  # a server that stops answering for longer than the deadline
            self.stalled.append(threading.current_thread())
            self.release.wait(10)
        super().pipe_file(path, value, **kwargs)
        if fault == "put-lost":
            raise TimeoutError("reply lost after the write landed (injected)")

    def cat_file(self, path, start=None, end=None, **kwargs):
        if self._fault("get"):
            raise ConnectionResetError("connection dropped (injected)")
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture()
def failing(monkeypatch) -> Iterator[str]:
    """A run in the failing store; afterwards the protocol is unregistered, the writes that
    stalled past their deadline have landed, and the run's bytes are gone from memory."""
    monkeypatch.setattr(store, "BACKOFF_S", 0.001)
    fsspec.register_implementation("failing", Failing, clobber=True)
    Failing.faults, Failing.stalled = [], []
    Failing.release.clear()
    url = f"failing://{uuid.uuid4().hex[:10]}"
    yield url
    Failing.release.set()
    for thread in Failing.stalled:
        thread.join()
    sys.modules["fsspec.registry"]._registry.pop("failing", None)  # no public unregister
    for key in [k for k in MemoryFileSystem.store if k.startswith(url)]:
        del MemoryFileSystem.store[key]


def test_transient_failures_are_retried(failing) -> None:
    ck = tpde.Checkpointer(failing)
    ck.save(0, {"w": torch.ones(10)})
    Failing.faults = ["put-500", "put-500"]
    ck.save(1, {"w": torch.zeros(10)})
    assert Failing.faults == []  # every injected fault was hit and retried
    Failing.faults = ["get", "get"]
    assert torch.equal(tpde.Checkpointer(failing).load(1)["w"], torch.zeros(10))
    assert Failing.faults == []


def test_a_lost_reply_after_the_write_counts_as_committed(failing) -> None:
    ck = tpde.Checkpointer(failing, lease_seconds=2.0)
    ck.save(0, {"w": torch.ones(10)})
    time.sleep(1.1)  # the lease is due for renewal (half of it has passed): written again
    Failing.faults = ["put-lost"] * 2  # the lease, then the manifest: both landed
    info = ck.save(1, {"w": torch.zeros(10)})
    assert Failing.faults == []
    assert info.step == 1 and tpde.Checkpointer(failing).steps() == [0, 1]


def test_persistent_failure_is_a_clean_store_error(failing) -> None:
    ck = tpde.Checkpointer(failing)
    ck.save(0, {"w": torch.ones(10)})
    Failing.faults = ["put-500"] * (store.RETRIES * 2)
    with pytest.raises(tpde.StoreError, match="InternalError"):
        ck.save(1, {"w": torch.zeros(10)})
    Failing.faults = []
    assert tpde.Checkpointer(failing).steps() == [0]


def test_a_server_that_stops_answering_is_a_bounded_failure(failing, monkeypatch) -> None:
    monkeypatch.setattr(store, "OP_TIMEOUT_S", 0.2)
    ck = tpde.Checkpointer(failing)
    ck.save(0, {"w": torch.ones(10)})
    Failing.faults = ["put-stall"]  # one stalled PUT: the retry goes through
    ck.save(1, {"w": torch.zeros(10)})
    assert tpde.Checkpointer(failing).steps() == [0, 1]
    Failing.faults = ["put-stall"] * store.RETRIES
    # Every attempt gives up at its deadline: the stalled writes only land when the test ends.
    with pytest.raises(tpde.StoreError, match="may still complete"):
        ck.save(2, {"w": torch.full((10,), 2.0)})
    assert Failing.faults == [] and len(Failing.stalled) == 1 + store.RETRIES


def test_ranges_from_a_server_that_ignores_range_are_cut_from_its_answer(tmp_path) -> None:
    """Some HTTP servers (Python's own among them) answer a ranged GET with the whole file."""
    import http.server
    from functools import partial

    data = bytes(range(256)) * 40
    (tmp_path / "blob").write_bytes(data)

    class Whole(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(Whole, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        s = store.Store(f"http://127.0.0.1:{server.server_address[1]}")
        ranges = [(10, 20), (300, 310), (5000, 10240)]
        assert [bytes(b) for b in s.read_ranges("blob", ranges)] == [data[a:b] for a, b in ranges]
        assert bytes(s.read_range("blob", 7, 9)) == data[7:9]
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_keeps_stalling_fails_within_the_retry_budget(failing, monkeypatch) -> None:
    """Deadlines do not multiply into minutes: no attempt starts that could end past the
    operation's budget (here 0.5 s, where six attempts would need 1.2 s)."""
    monkeypatch.setattr(store, "OP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(store, "RETRY_BUDGET_S", 0.5)
    ck = tpde.Checkpointer(failing)
    ck.save(0, {"w": torch.ones(10)})
    Failing.faults = ["put-stall"] * store.RETRIES
    with pytest.raises(tpde.StoreError, match="may still complete"):
        ck.save(1, {"w": torch.zeros(10)})
    assert 1 <= len(Failing.stalled) < store.RETRIES


def test_a_store_that_accepts_connections_and_never_answers_fails_at_once(monkeypatch) -> None:
    """A server that takes the connection and says nothing (a wrong port, a hung proxy): the
    first request's deadline ends it, with the same message as a refused connection, and no
    retry waits out another deadline."""
    import socket

    pytest.importorskip("s3fs", reason="needs s3fs: pip install 'tpde[dev]'")
    monkeypatch.setattr(store, "OP_TIMEOUT_S", 2.0)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])  # kept open, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.getsockname()[1]}"},
               "key": "testing", "secret": "testing"}
    try:
        s = store.Store("s3://tpde/silent-run", options)
        with pytest.raises(tpde.StoreError, match=r"nothing answers at its store.*no answer "
                                                  r"within 2 s"):
            s.exists("tpde.json")
        # One request, not one per retry (none at all where a loaded machine had not sent it
        # before the deadline).
        assert len(held) <= 1
    finally:
        server.close()
        for conn in held:
            conn.close()
