"""A blob written as a stream: frames appended as they are coded, handed to the disk as they
accumulate, made durable (file and folder) before a manifest may name the blob; the failed write
of one is discarded. The local-disk primitives beside it: a folder's fsync, and write errors
that say what to do when the disk is full."""

from __future__ import annotations

import ctypes
import errno
import os
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from tpde.errors import StoreError

if TYPE_CHECKING:
    from tpde.store.store import Store

#: A local blob's written bytes are handed to the disk every WRITEBACK_BYTES, while the rest is
#: still being coded, so that the fsync before its commit has little left to wait for; a
#: larger interval left a small step's blob half to its fsync, and made small saves slower
#: (``benchmarks/README.md``).
WRITEBACK_BYTES = 1 << 20
#: A local blob's frames are held (not copied) until this many bytes are pending, then handed
#: to the file in one ``writev``: the frames of small tensors are a few kB each, and with
#: Python's default 8 kB buffer every other one was a system call of its own; a buffered
#: file copies each frame into its buffer holding the GIL, where ``writev`` copies them into
#: the page cache without it.
WRITE_BUFFER = 1 << 20
#: Frames per ``writev`` call (Linux's IOV_MAX).
WRITE_PARTS = 1024


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_error(verb: str, where: str, exc: BaseException) -> StoreError:
    """A failed write, with what to do when the disk or quota is full."""
    hint = ""
    if isinstance(exc, OSError) and exc.errno in _FULL:
        hint = ("; the step was not committed and every committed step is intact: free space "
                "(`tpde gc` deletes data no step needs) and save again")
    return StoreError(f"cannot {verb} {where}: {exc}{hint}")


def _start_writeback() -> Callable[[int, int, int], Any] | None:
    """Linux's ``sync_file_range`` asked to start writing a range out without waiting for it,
    the way RocksDB's ``bytes_per_sync`` does (None elsewhere: the fsync does it all). Its
    result is not looked at: it is a hint, and the fsync reports what went wrong."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):  # not Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    write = 2  # SYNC_FILE_RANGE_WRITE
    return lambda fd, offset, length: call(fd, offset, length, write)


_WRITEBACK = _start_writeback()


def _bounded(op: Callable[[], Any], nbytes: int) -> Any:
    """``op`` within a remote store's deadline (``store.bounded``; that module imports this
    one)."""
    from tpde.store.store import bounded

    return bounded(op, nbytes)
_WRITEV = hasattr(os, "writev")  # POSIX; elsewhere a frame per call


class BlobWriter:
    """Appends bytes to a new object and reports offsets, so records can point into it."""

    def __init__(self, store: "Store", rel: str) -> None:
        self.store, self.rel, self.size = store, rel, 0
        self._handed = 0  # bytes of a local blob already handed to the disk
        self._pending: list[bytes | memoryview] = []  # held frames, not yet in the file
        self._written = 0  # bytes of a local blob in the file
        path = store._abs(rel)
        try:
            if store.local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._f: BinaryIO = open(path, "wb", buffering=0)
            else:
                self._f = store.fs.open(path, "wb")
        except OSError as exc:
            raise write_error("create", f"{store.url}/{rel}", exc) from exc

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns the offset it starts at. A local blob holds ``data`` until
        it is written out (``WRITE_BUFFER``): callers do not change it after handing it over."""
        at = self.size
        try:
            if self.store.local:
                self._pending.append(data)
                if at + len(data) - self._written >= WRITE_BUFFER:
                    self._flush()
            else:  # a part upload may start here
                _bounded(lambda: self._f.write(data), len(data))
        except Exception as exc:  # remote backends also raise timeouts and client errors
            raise write_error("write", f"{self.store.url}/{self.rel}", exc) from exc
        self.size += len(data)
        return at

    def _flush(self) -> None:
        """The held frames into the local file, and the bytes written since the last
        hand-over to the disk, once there are enough."""
        fd, parts = self._f.fileno(), self._pending
        while parts:
            done = os.writev(fd, parts[:WRITE_PARTS]) if _WRITEV else os.write(fd, parts[0])
            self._written += done
            whole = 0  # parts written in full
            while whole < len(parts) and done >= len(parts[whole]):
                done -= len(parts[whole])
                whole += 1
            del parts[:whole]
            if done:  # a short write ended inside the next part
                parts[0] = memoryview(parts[0])[done:]
        if _WRITEBACK is not None and self._written - self._handed >= WRITEBACK_BYTES:
            _WRITEBACK(fd, self._handed, self._written - self._handed)
            self._handed = self._written

    def close(self) -> None:
        """Make the bytes durable (fsync locally, and of the folder, so that the file's name
        survives a power loss before a manifest names it; the final multipart PUT on object
        stores)."""
        try:
            if self.store.local:
                self._flush()
                os.fsync(self._f.fileno())
                self._f.close()
                fsync_dir(os.path.dirname(self.store._abs(self.rel)))
            else:  # the last part and the completing request
                _bounded(self._f.close, self.size)
        except Exception as exc:  # remote backends also raise timeouts and client errors
            raise write_error("finish", f"{self.store.url}/{self.rel}", exc) from exc

    def abort(self) -> None:
        """Drop a failed write: a pending multipart upload is discarded, not completed."""
        try:
            discard = getattr(self._f, "discard", None)
            if discard is not None:
                discard()
            else:
                self._f.close()
        except Exception:  # the write already failed; the object is garbage either way
            pass
        self.store.delete(self.rel)
