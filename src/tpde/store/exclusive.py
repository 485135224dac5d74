"""Writes that succeed only where no other writer's did: the store layer's conditional operations.

A step's commit and the writer lease are each one such operation, so that two jobs starting on
one run at the same moment cannot both get through:

- ``create`` makes an object only if none is there: a hard link of a synced temporary file on
  local disk (``link`` fails on an existing name), a conditional PUT (``If-None-Match: *``) on
  S3-protocol stores, an exclusive open elsewhere (fsspec's ``mode="create"``).
- ``replace_if`` overwrites an object only if it is still the version read before: a PUT with
  ``If-Match`` on S3-protocol stores; on local disk and ``memory://`` the caller holds
  ``locked``, under which reading and writing are one step.
- ``locked`` is an exclusive ``flock`` of a ``.lock`` file beside the object on local disk
  (every process of the host), a lock of this process for ``memory://``, and nothing on object
  stores (their conditional requests decide).

Other fsspec backends get ``create`` where they implement ``mode="create"``; their
``replace_if`` is a plain replace (``docs/format.md`` §2 says what each store guarantees).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid
from typing import Iterator

from tpde.store.blob import fsync_dir, write_error
from tpde.store.store import Store

try:
    import fcntl
except ImportError:  # Windows: no flock; a local lease there is written and read back
    fcntl = None  # type: ignore[assignment]

#: The processes' own locks for ``memory://`` objects, by path.
_MEMORY: dict[str, threading.Lock] = {}
_MEMORY_GUARD = threading.Lock()
#: Where a hard link cannot be made, the file system says one of these.
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK)


def _s3(store: Store) -> bool:
    return "s3" in (store.fs.protocol if isinstance(store.fs.protocol, tuple)
                    else (store.fs.protocol,))


def _memory(store: Store) -> bool:
    return "memory" in (store.fs.protocol if isinstance(store.fs.protocol, tuple)
                        else (store.fs.protocol,))


def under_lock(store: Store) -> bool:
    """Whether ``locked`` makes reading and writing one step on ``store``."""
    return (store.local and fcntl is not None) or _memory(store)


def create(store: Store, rel: str, data: bytes) -> None:
    """Write ``data`` at ``rel`` whole, only if nothing is there.

    Raises:
        FileExistsError: an object is at ``rel`` (another writer's, or this one's from an
            attempt whose reply was lost, which is then taken as done).
    """
    store.changes += 1
    path = store._abs(rel)
    if store.local:
        _create_local(store, rel, path, data)
        return

    def once() -> None:
        try:
            store.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            if store.fs.cat_file(path) == data:
                return  # an earlier attempt of this call landed; only its reply was lost
            raise

    store._retry(f"create {rel} in", once, len(data), writes=True)


def _create_local(store: Store, rel: str, path: str, data: bytes) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            with locked(store, rel):  # no hard links here: check and rename under the lock
                if os.path.lexists(path):
                    raise FileExistsError(errno.EEXIST, "exists", path) from None
                os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except FileExistsError:
        raise
    except OSError as exc:
        raise write_error("write", f"{store.url}/{rel}", exc) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def version(store: Store, rel: str) -> str | None:
    """What ``replace_if`` compares: the object's ETag on S3-protocol stores, else None."""
    if not _s3(store):
        return None
    path = store._abs(rel)
    store.fs.invalidate_cache(path)  # a listing's copy may be older than the object

    def look() -> str | None:
        return store.fs.info(path).get("ETag")

    return store._retry(f"look up {rel} in", look)


def replace_if(store: Store, rel: str, data: bytes, seen: str | None) -> bool:
    """Overwrite ``rel`` with ``data`` if it is still the version ``seen`` (``version``);
    returns False, writing nothing, where another writer replaced it since."""
    if not _s3(store) or seen is None:
        store.put_atomic(rel, data)  # local and memory: under ``locked``
        return True
    store.changes += 1
    path = store._abs(rel)

    def once() -> bool:
        try:
            store.fs.pipe_file(path, data, IfMatch=seen)
            return True
        except OSError as exc:
            if not any(w in str(exc) for w in ("pre-condition", "Precondition",
                                                "ConditionalRequestConflict")):
                raise
            return store.fs.cat_file(path) == data  # ours landed, reply lost; or another's

    return bool(store._retry(f"replace {rel} in", once, len(data)))


@contextlib.contextmanager
def locked(store: Store, rel: str) -> Iterator[None]:
    """Hold the lock of ``rel`` (local disk: every process of the host; ``memory://``: this
    process; object stores: none, their conditional requests decide)."""
    if store.local and fcntl is not None:
        path = f"{store._abs(rel)}.lock"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise write_error("write", f"{store.url}/{rel}", exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock
        return
    if _memory(store):
        key = store._abs(rel)
        with _MEMORY_GUARD:
            lock = _MEMORY.setdefault(key, threading.Lock())
        with lock:
            yield
        return
    yield
