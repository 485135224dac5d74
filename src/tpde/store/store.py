"""Bytes in and out of any fsspec location; the only module that does I/O.

Commit semantics come from here: ``put_atomic`` makes an object appear whole or not at all (a
rename on local disk after fsync, a single PUT on object stores, which are atomic per object).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tpde.errors import StoreError
from tpde.store.blob import BlobWriter, fsync_dir, write_error

_INSTALL_HINT = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
T = TypeVar("T")
#: Attempts per remote operation and the backoff between them (doubling, with jitter).
RETRIES, BACKOFF_S, BACKOFF_MAX_S = 6, 0.1, 4.0
#: A remote attempt that has not answered after OP_TIMEOUT_S plus its bytes at MIN_RATE
#: (bytes/s) counts as failed, and an operation's retries stop once RETRY_BUDGET_S (plus its
#: bytes at MIN_RATE) would be passed: a server that stops answering ends in a StoreError
#: within the budget, and one that never answered fails at its first deadline.
OP_TIMEOUT_S, RETRY_BUDGET_S, MIN_RATE = 20.0, 60.0, 1 << 20


_UNREACHABLE = ("EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError",
                "gaierror", "NameResolutionError", "ConnectTimeoutError", "InvalidURL",
                "StoreTimeout")


class StoreTimeout(TimeoutError):
    """A remote attempt that did not answer by its deadline."""


def cannot_connect(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) says no connection could be made at all."""
    seen = 0
    while exc is not None and seen < 8:
        if any(cls.__name__ in _UNREACHABLE for cls in type(exc).__mro__):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def unreachable(url: str, exc: BaseException) -> StoreError:
    """A store that cannot be connected to, named as ``url``."""
    return StoreError(f"cannot open {url!r}: nothing answers at its store "
                      f"({type(exc).__name__}: {exc}); check the URL, the endpoint (storage "
                      "option client_kwargs.endpoint_url) and the network")


def bounded(op: Callable[[], T], nbytes: int = 0) -> T:
    """Run ``op`` with a deadline. A late op keeps running on its daemon thread, its result
    unused; a daemon thread, so that a server that never answers cannot hold up exit either."""
    limit = OP_TIMEOUT_S + nbytes / MIN_RATE
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = op()
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="tpde-store", daemon=True).start()
    if not done.wait(limit):
        raise StoreTimeout(f"no answer within {limit:.3g} s (it may still complete)")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the store root
    size: int
    mtime: float | None
    #: What identifies this write of the object (an ETag, a generation, an inode and its
    #: mtime), or None where the listing has nothing exact.
    version: Any = None


#: Ranges of one object closer than this are read as one request (the bytes between are read
#: and dropped), up to this many bytes per request.
COALESCE_GAP, COALESCE_SPAN = 64 << 10, 64 << 20
#: Local reads of at least this many bytes map the file instead of copying it: reading a
#: large blob into new memory spends most of its time faulting in fresh pages, many times
#: what mapping it costs. Smaller reads cost less as copies than as mappings.
MAP_BYTES = 1 << 20
#: Files a thread keeps open at most within ``Store.kept_open``.
KEPT_OPEN = 32


class Store:
    """A run's root folder in an fsspec filesystem."""

    #: Readers may fetch a whole blob when they need most of it (one GET instead of many).
    whole_blob_reads = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:
            proto = url.split("://", 1)[0]
            pkg = _INSTALL_HINT.get(proto, f"the fsspec backend for {proto}://")
            raise StoreError(f"cannot open {url!r}: install {pkg} ({exc})") from None
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.answered = self.local  # whether the store has answered once since it was opened
        # Mapped reads where a mapped file can still be deleted (gc) and replaced (POSIX).
        self.maps = self.local and os.name == "posix"
        #: Objects put whole or deleted through this store (a blob written is neither): a
        #: writer keeping count of its run's bytes knows from it whether anything but its own
        #: save changed them.
        self.changes = 0
        self._open = threading.local()  # files kept open by ``kept_open``, this thread's

    @property
    def location(self) -> str:
        """The root as one URL, however it was spelled (``memory://a`` and ``memory:///a``)."""
        return self.fs.unstrip_protocol(self.root)

    def _retry(self, what: str, op: Callable[[], T], nbytes: int = 0, *,
               writes: bool = False) -> T:
        """Run ``op``, retrying transient failures of remote stores with backoff.

        A missing object (or an existing one, to an exclusive create) is an answer, not a
        failure; local disks are not retried (their errors
        are not transient). Remote attempts have a deadline (``OP_TIMEOUT_S`` plus ``nbytes`` at
        ``MIN_RATE``), and no attempt starts that could end past ``RETRY_BUDGET_S``; a store that
        has not answered once since it was opened is not retried after a failed connection or
        a deadline. Any other backend exception ends as a ``StoreError``.
        """
        attempts = 1 if self.local else RETRIES
        started = time.monotonic()
        budget = RETRY_BUDGET_S + nbytes / MIN_RATE
        for attempt in range(attempts):
            try:
                value = op() if self.local else bounded(op, nbytes)
                self.answered = True
                return value
            except FileNotFoundError as exc:
                self.answered = True
                if writes and not self.local:  # nothing to write into: no such bucket
                    raise StoreError(
                        f"cannot {what} {self.url}: {exc}. Create the bucket (or container) "
                        "first, or check the URL") from None
                raise
            except FileExistsError:  # an answer (an exclusive create's)
                self.answered = True
                raise
            except Exception as exc:  # backends raise OSError, timeouts, aiohttp/botocore errors
                last = exc
                if not self.answered and cannot_connect(exc):
                    # A wrong endpoint or host is far likelier than an outage at this moment,
                    # and the backends retry connections themselves: say so in seconds
                    # instead of retrying for a minute.
                    raise unreachable(self.url, exc) from exc
                if attempt + 1 < attempts:
                    delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** attempt) * (0.5 + random.random())
                    spent = time.monotonic() - started + delay
                    if spent + OP_TIMEOUT_S + nbytes / MIN_RATE > budget:
                        break  # another attempt could outlast the budget
                    time.sleep(delay)
        raise StoreError(f"cannot {what} {self.url}: {type(last).__name__}: {last}") from last

    def _abs(self, rel: str) -> str:
        """``rel``'s path in the filesystem; ``""`` is the store's root itself."""
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root else rel

    def _rel(self, path: str) -> str:
        path = path.rstrip("/")
        prefix = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        stripped = self.fs._strip_protocol(path)
        return stripped[len(prefix):] if stripped.startswith(prefix) else stripped

    # ------------------------------------------------------------------ writes
    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that readers see the whole object or none of it."""
        self.changes += 1
        path = self._abs(rel)
        if not self.local:
            self._retry(f"write {rel} in", lambda: self._put_once(path, data), len(data),
                        writes=True)
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise write_error("write", f"{self.url}/{rel}", exc) from exc

    def _put_once(self, path: str, data: bytes) -> None:
        """One PUT; when its outcome is unknown (the reply was lost), the object decides."""
        try:
            self.fs.pipe_file(path, data)
        except FileNotFoundError:
            raise
        except Exception:
            try:
                if self.fs.cat_file(path) == data:
                    return  # the PUT landed; only the reply was lost
            except Exception:  # nothing readable yet: the PUT did not land, retry it
                pass
            raise

    def open_write(self, rel: str) -> BlobWriter:
        """A streaming writer for a new, not yet committed object."""
        return BlobWriter(self, rel)

    def delete(self, rel: str) -> None:
        self.changes += 1
        try:
            self._retry(f"delete {rel} in", lambda: self.fs.rm_file(self._abs(rel)))
        except FileNotFoundError:
            pass

    def delete_tree(self, rel: str) -> None:
        """Delete the folder ``rel`` and everything under it (a folder a sharded strategy
        wrote without tpde, at a checkpoint path)."""
        self.changes += 1
        try:
            self._retry(f"delete {rel} in", lambda: self.fs.rm(self._abs(rel), recursive=True))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ reads
    def read(self, rel: str, size_hint: int = 0) -> bytes | memoryview:
        """The whole object; a read-only view of the mapped file where the store is a local
        POSIX disk and ``size_hint`` reaches ``MAP_BYTES`` (blobs are never changed once
        written, only deleted, which leaves a mapping whole)."""
        if self.maps and size_hint >= MAP_BYTES:
            return self._retry(f"read {rel} in", lambda: _mapped(self._abs(rel)))
        return self._retry(f"read {rel} in", lambda: self.fs.cat_file(self._abs(rel)), size_hint)

    @contextlib.contextmanager
    def kept_open(self) -> Iterator[None]:
        """Keep the local files this thread range-reads open until the block ends: a decode
        that streams its sections frame by frame (a mount at budget 0) opened its blob once
        per frame, 1267 times for each forward of MiniLM two deltas deep. A blob deleted
        meanwhile still reads, as it did when opened: blobs never change once written."""
        if not self.maps or getattr(self._open, "fds", None) is not None:
            yield
            return
        self._open.fds, self._open.handed = {}, {}
        try:
            yield
        finally:
            fds, handed = self._open.fds, self._open.handed
            self._open.fds = self._open.handed = None
            for fd in (*fds.values(), *handed.values()):
                os.close(fd)

    def descriptor(self, rel: str) -> int | None:
        """A descriptor of local file ``rel`` for a reader outside Python to read ranges of
        (``chain.native``), open until ``kept_open``'s block ends; None for a store that is not
        local, outside such a block, or where ``KEPT_OPEN`` are open already."""
        handed = getattr(self._open, "handed", None)
        if handed is None:
            return None
        path = self._abs(rel)
        if path not in handed:
            if len(handed) >= KEPT_OPEN:
                return None
            handed[path] = os.open(path, os.O_RDONLY)
        return handed[path]

    def read_range(self, rel: str, a: int, b: int) -> bytes | memoryview:
        """One ``[a, b)`` range of one object, as a streamed decode asks for a frame: a local
        read skips ``read_ranges``' coalescing, a tenth of a mount's forward at budget 0."""
        if not self.maps or b - a >= MAP_BYTES:
            return self.read_ranges(rel, [(a, b)])[0]
        kept, path = getattr(self._open, "fds", None), self._abs(rel)
        data = self._retry(f"read {rel} in", lambda: _pread(path, [[a, b, 0]], kept))[0]
        return self._whole(rel, a, b, data)

    def _whole(self, rel: str, a: int, b: int, data: Any) -> Any:
        """``data``, read as ``rel``'s range ``[a, b)``, if none of it is missing. A server
        that ignores ``Range`` answers with the whole object: the range is cut from it."""
        if len(data) > b - a and len(data) >= b:
            return memoryview(data)[a:b]
        if len(data) != b - a:
            raise StoreError(f"{self.url}/{rel} is shorter than its manifest says "
                             f"(range {a}-{b} gave {len(data)} bytes)")
        return data

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """Several ``[start, end)`` ranges of one object, fetched concurrently where possible.

        Ranges that touch or nearly touch (a step's records lie back to back in its blob) are
        fetched as one: on an object store every range is a request, and a rank coding its
        chunks against the previous step reads thousands of them. An empty range (an empty
        tensor's section) is no request: asked alone, S3 answers one with the whole object.
        """
        out: list[bytes | memoryview] = [b""] * len(ranges)
        spans: list[list[int]] = []  # [start, end, first index into `order`]
        order = sorted((i for i, (a, b) in enumerate(ranges) if b > a), key=lambda i: ranges[i])
        if not order:
            return out
        for k, i in enumerate(order):
            a, b = ranges[i]
            if spans and a <= spans[-1][1] + COALESCE_GAP and b - spans[-1][0] <= COALESCE_SPAN:
                spans[-1][1] = max(spans[-1][1], b)
            else:
                spans.append([a, b, k])
        path = self._abs(rel)
        if self.maps and sum(b - a for a, b in ranges) >= MAP_BYTES:
            whole = self.read(rel, MAP_BYTES)
            got: list[bytes | memoryview] = [whole[a:b] for a, b, _ in spans]
        elif self.maps:  # one descriptor for every span (a mount reads a frame at a time)
            kept = getattr(self._open, "fds", None)
            got = self._retry(f"read {rel} in", lambda: _pread(path, spans, kept))
        else:
            got = self._retry(f"read {rel} in", lambda: self.fs.cat_ranges(
                [path] * len(spans), [a for a, _, _ in spans], [b for _, b, _ in spans],
                on_error="raise"), sum(b - a for a, b, _ in spans))
        for n, ((start, end, first), data) in enumerate(zip(spans, got)):
            data = self._whole(rel, start, end, data)
            last = spans[n + 1][2] if n + 1 < len(spans) else len(order)
            if last - first == 1:
                out[order[first]] = data
                continue
            view = memoryview(data)
            for i in order[first:last]:
                a, b = ranges[i]
                out[i] = view[a - start : b - start]
        return out

    def exists(self, rel: str) -> bool:
        return bool(self._retry(f"look up {rel} in", lambda: self.fs.exists(self._abs(rel))))

    def kind(self, rel: str) -> str | None:
        """``"file"``, ``"directory"`` or None (nothing there) for ``rel`` (``""``: the root)."""
        def look() -> str | None:
            try:
                found = self.fs.info(self._abs(rel))
            except FileNotFoundError:
                return None
            return "directory" if found.get("type") == "directory" else "file"
        return self._retry(f"look up {rel or 'the root'} in", look)

    def size(self, rel: str) -> int:
        """The bytes of object ``rel``; a missing one raises ``FileNotFoundError``."""
        return int(self._retry(f"look up {rel} in", lambda: self.fs.size(self._abs(rel))) or 0)

    def open_read(self, rel: str) -> BinaryIO:
        """A file object reading ``rel`` (a plain checkpoint handed to ``torch.load``)."""
        return self._retry(f"open {rel} in", lambda: self.fs.open(self._abs(rel), "rb"))

    def list(self, prefix: str) -> Iterator[Entry]:
        """Objects under ``prefix`` (one level), with sizes and modification times."""
        return iter(self.contents(prefix)[0])

    def contents(self, prefix: str) -> tuple[list[Entry], list[str]]:
        """The objects directly under ``prefix`` (as ``list`` gives them) and its folders, by
        path, sorted: one listing."""
        try:
            items = self._retry(f"list {prefix} in",
                                lambda: self.fs.ls(self._abs(prefix), detail=True, refresh=True))
        except FileNotFoundError:
            return [], []
        files = [Entry(self._rel(item["name"]), int(item.get("size") or 0), _mtime(item),
                       _version(item)) for item in items if item.get("type") != "directory"]
        return files, sorted(self._rel(item["name"]) for item in items
                             if item.get("type") == "directory")



def _pread(path: str, spans: list[list[int]], kept: dict[str, int] | None) -> list[bytes]:
    """The spans of ``path``, read through a descriptor ``kept`` holds (opened into it if not
    yet there), or one opened for this call."""
    fd = kept.get(path) if kept is not None else None
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
        if kept is not None:
            if len(kept) >= KEPT_OPEN:  # a step of many ranks' blobs: the oldest goes
                os.close(kept.pop(next(iter(kept))))
            kept[path] = fd
    try:
        return [os.pread(fd, b - a, a) for a, b, _ in spans]
    finally:
        if kept is None:
            os.close(fd)


def _mapped(path: str) -> memoryview:
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return memoryview(b"")  # an empty file cannot be mapped
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _mtime(item: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "created", "last_modified", "updated"):
        value = item.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def _version(item: dict[str, Any]) -> Any:
    """What identifies one write of a listed object, or None where the listing has nothing
    exact."""
    for key in ("ETag", "etag", "generation"):
        if item.get(key):
            return item[key]
    if item.get("ino") is not None:  # atomic replacement on disk makes a new inode
        return (item["ino"], item.get("mtime"))
    return None
