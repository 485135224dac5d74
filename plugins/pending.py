"""A checkpoint path's entry through its save: a pending entry written at once (it keeps the
committed entry it replaces), made final once the step commits, and withdrawn, the replaced
entry put back, where the save will not commit (``docs/format.md`` §9)."""

from __future__ import annotations

import uuid
from typing import Any

from tpde.entries import entry as entries
from tpde.errors import TPDEError


def announce(path: str, options: dict[str, Any], chain_dir: str,
             chain_url: str, *, begin: bool = True) -> entries.PendingEntry | None:
    """Write the pending entry at ``path``, keeping the committed entry it replaces. A plain
    checkpoint there (a run that switched to tpde) stays until the step commits: None. Either
    way readers in this process wait for the save (``entries.PENDING``) until ``PENDING.end``
    (``begin=False``: the caller began that wait itself, and ends it).
    """
    previous, plain = entries.replaced(path, options)
    if plain:
        if begin:
            entries.PENDING.begin(path)
        return None
    pending = entries.PendingEntry(run=chain_dir, run_url=chain_url,
                                   writer=entries.this_writer(), token=uuid.uuid4().hex,
                                   previous=previous)
    if not begin:
        at, name = entries.store_at(path, options)
        at.put_atomic(name, entries.to_bytes(pending))
        return pending
    entries.PENDING.begin(path)
    try:
        at, name = entries.store_at(path, options)
        at.put_atomic(name, entries.to_bytes(pending))
    except BaseException:
        entries.PENDING.end(path)
        raise
    return pending


def withdraw(path: str, options: dict[str, Any], pending: entries.PendingEntry) -> None:
    """A save that will not commit: ``path`` gets back the entry its pending one replaced (or
    goes, if it had none), unless something else was written there since."""
    try:
        found = entries.read_any(path, options)
    except (FileNotFoundError, TPDEError):
        return
    if not (isinstance(found, entries.PendingEntry) and found.token == pending.token):
        return
    at, name = entries.store_at(path, options)
    if pending.previous is None:
        at.delete(name)
    else:
        at.put_atomic(name, entries.to_bytes(pending.previous))


def publish(path: str, options: dict[str, Any], entry: entries.CheckpointEntry
            ) -> entries.CheckpointEntry | None:
    """Write the final entry at ``path``; the committed entry it replaced, if any."""
    replaced, _ = entries.replaced(path, options)
    at, name = entries.store_at(path, options)
    at.put_atomic(name, entries.to_bytes(entry))
    return replaced
