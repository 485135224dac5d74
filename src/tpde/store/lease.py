"""One writer per run: a lease object with an owner and an expiry, on any store.

Writers (save, remove, gc) hold ``lease.json``; readers never look at it, so they are never
blocked.  A second writer is refused while the lease is live.  It takes over when the lease has
expired, when the owner's process is gone on this same host, or when asked to (``takeover``).

Taking the lease is one conditional operation (``exclusive``): on local disk and ``memory://``
the lease is read and written under a lock; on S3-protocol stores it is created only if absent
(``If-None-Match``) and taken over only if unchanged since it was read (``If-Match``). Of two
writers racing in the same instant exactly one gets it. Other stores write and read back: the
write that landed last wins, the other writer is refused on its read-back.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from tpde.errors import WriterConflictError
from tpde.store import exclusive
from tpde.store.store import Store

LEASE = "lease.json"
DEFAULT_LEASE_SECONDS = 3600.0
#: Seconds after which a write renews the lease it holds (half the lease, if that is less).
RENEW_AFTER = 60.0


@dataclass(frozen=True)
class Holder:
    owner: str
    host: str
    pid: int
    expires: float

    def alive(self, now: float) -> bool:
        if now >= self.expires:
            return False
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class Lease:
    """The writer's claim on a run; checked on every write, renewed by a write once
    ``RENEW_AFTER`` seconds have passed, released by ``release``."""

    def __init__(self, store: Store, seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.store, self.seconds = store, seconds
        self.owner = uuid.uuid4().hex
        self.held = False

    def current(self) -> Holder | None:
        return self._read()[0]

    def _read(self) -> tuple[Holder | None, str | None, bool]:
        """The holder (None where there is none or the lease is damaged: a damaged lease
        protects nothing), the version ``exclusive.replace_if`` compares, and whether a lease
        object is there at all."""
        try:
            seen = exclusive.version(self.store, LEASE)
            data = json.loads(self.store.read(LEASE))
        except FileNotFoundError:
            return None, None, False
        except (ValueError, KeyError, TypeError):
            return None, seen, True
        try:
            holder = Holder(str(data["owner"]), str(data["host"]), int(data["pid"]),
                            float(data["expires"]))
        except (KeyError, TypeError, ValueError):
            return None, seen, True
        return holder, seen, True

    def acquire(self, *, takeover: bool = False) -> None:
        """Hold (or renew) the lease; raises ``WriterConflictError`` if another writer holds it.

        A lease this writer renewed less than ``RENEW_AFTER`` seconds ago (or half its time,
        if shorter) is only read, not written again: a renewal is a write, a read-back and
        their syncs, and a writer renews before every save and removal. A writer that took the
        run over in the meantime is seen in the read either way, and a lease never lapses
        between two writes less than ``seconds - RENEW_AFTER`` apart."""
        with exclusive.locked(self.store, LEASE):
            holder, seen, present = self._read()
            now = time.time()
            if holder and holder.owner != self.owner and holder.alive(now) and not takeover:
                raise self._conflict(holder)
            if self.held and holder and holder.owner == self.owner \
                    and holder.expires - now > self.seconds - min(RENEW_AFTER, self.seconds / 2):
                return
            mine = Holder(self.owner, socket.gethostname(), os.getpid(), now + self.seconds)
            data = json.dumps(asdict(mine)).encode()
            if self.store.local or exclusive.under_lock(self.store):
                self.store.put_atomic(LEASE, data)
                won = True
            elif not present:
                try:
                    exclusive.create(self.store, LEASE, data)
                    won = True
                except FileExistsError:
                    won = False
            else:
                won = exclusive.replace_if(self.store, LEASE, data, seen)
            check = self.current() if won else None
        if check is None or check.owner != self.owner:
            self.held = False
            raise self._conflict(check or self.current() or mine)
        self.held = True

    def release(self) -> None:
        """Give the run up, if this writer still holds it."""
        if not self.held:
            return
        with exclusive.locked(self.store, LEASE):
            holder = self.current()
            if holder is not None and holder.owner == self.owner:
                self.store.delete(LEASE)
        self.held = False

    def _conflict(self, h: Holder) -> WriterConflictError:
        return WriterConflictError(
            f"another writer holds this run (host {h.host}, pid {h.pid}, lease until "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h.expires))}); two writers would "
            "corrupt each other's deltas. Wait for it to finish, or pass takeover=True "
            "(CLI: --force) if that job is dead.", run=self.store.url)
