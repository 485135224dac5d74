"""One chain writer per folder and process, shared by the Lightning plugins that write it.

A second ``Trainer`` in the same process that resumes where the first one saved continues the
same chain under the same writer lease, instead of meeting its own process's lease. The last
plugin to let go closes the writer: it frees what removed steps hold, drops the reference
words, and gives up the lease.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tpde.api import Checkpointer
from tpde.chain import GcReport
from tpde.entries import entry as entries
from tpde.store.lease import Lease


@dataclass
class Run:
    """One chain's writer, its lock (a save, a removal or a resume at a time) and its users."""

    ckpt: Checkpointer
    lock: threading.RLock = field(default_factory=threading.RLock)
    users: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    next: int | None = None  # the step the next save gets


_RUNS: dict[str, Run] = {}
#: The leases of runs whose plugins were dropped without a teardown, by folder: given up by
#: the next plugin of this process to write there (a collector may not do I/O).
_DROPPED: dict[str, Lease] = {}
_LOCK = threading.Lock()
#: Folders whose plugins were collected, looked at under ``_LOCK`` as soon as it is free: a
#: collection runs its finalizers wherever it happens, in a thread that may hold the lock
#: already (inside ``acquire``, making a writer), which waiting for it would deadlock.
_FORGOTTEN: deque[str] = deque()


def acquire(url: str, user: Any, storage_options: dict[str, Any],
            options: dict[str, Any]) -> Run:
    """The writer of ``url``, made with ``options`` by its first user."""
    key = entries.normalize(url)
    with _LOCK:
        _drop_forgotten()
        run = _RUNS.get(key)
        if run is None:
            dropped = _DROPPED.pop(key, None)
            if dropped is not None:  # this process's own lease: no other job holds the run
                dropped.release()
            run = _RUNS[key] = Run(Checkpointer(url, storage_options=storage_options,
                                                **options))
        run.users.add(user)
        return run


def forget(urls: set[str]) -> None:
    """Drop the runs at ``urls`` that no live user holds: now where the lock is free, else
    as soon as the holder lets go of it (this runs at collection, never waits and does no
    I/O). Their leases are kept until this process writes the folder again, which gives them
    up; a job elsewhere waits for them to lapse, as for a writer that died."""
    _FORGOTTEN.extend(urls)
    if _LOCK.acquire(blocking=False):
        try:
            _drop_forgotten()
        finally:
            _LOCK.release()


def _drop_forgotten() -> None:
    """``forget``'s work, under ``_LOCK``."""
    while _FORGOTTEN:
        key = entries.normalize(_FORGOTTEN.popleft())
        run = _RUNS.get(key)
        if run is not None and not list(run.users):
            del _RUNS[key]
            if run.ckpt.lease.held:
                _DROPPED[key] = run.ckpt.lease


def release(url: str, user: Any) -> GcReport:
    """``user`` is done with ``url``'s run; the last one closes it."""
    key = entries.normalize(url)
    with _LOCK:
        _drop_forgotten()
        run = _RUNS.get(key)
        if run is None:
            return GcReport()
        run.users.discard(user)
        if run.users:
            return GcReport()
        del _RUNS[key]
    with run.lock:
        return run.ckpt.close()
