"""What the layers above read and write bytes through: ``Store`` (any fsspec location, with
retries and deadlines) implements it, and so does ``ResidentStore`` (a mount's reads served
from memory). Nothing above ``tpde.store`` touches a filesystem any other way."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, BinaryIO, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tpde.store.blob import BlobWriter
    from tpde.store.store import Entry


@runtime_checkable
class ByteStore(Protocol):
    """Objects under one root, named by paths relative to it (``""``: the root itself).

    Writes: ``put_atomic`` makes an object appear whole or not at all; ``open_write`` streams a
    blob that nothing names until a manifest does. Reads: whole objects, ranges of them, and
    descriptors of local files for a reader outside Python, open within ``kept_open``. A
    missing object raises ``FileNotFoundError``; any other failure a ``StoreError``.
    """

    url: str
    #: The root as one URL, however ``url`` spelled it.
    location: str
    #: A local disk (renames are atomic, reads can be mapped).
    local: bool
    #: Readers may fetch a whole blob when they need most of it (one GET instead of many).
    whole_blob_reads: bool

    def put_atomic(self, rel: str, data: bytes) -> None: ...

    def open_write(self, rel: str) -> "BlobWriter": ...

    def delete(self, rel: str) -> None: ...

    def delete_tree(self, rel: str) -> None: ...

    def read(self, rel: str, size_hint: int = 0) -> bytes | memoryview: ...

    def read_range(self, rel: str, a: int, b: int) -> bytes | memoryview: ...

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]
                    ) -> list[bytes | memoryview]: ...

    def open_read(self, rel: str) -> BinaryIO: ...

    def kept_open(self) -> AbstractContextManager[None]: ...

    def descriptor(self, rel: str) -> int | None: ...

    def exists(self, rel: str) -> bool: ...

    def kind(self, rel: str) -> str | None: ...

    def size(self, rel: str) -> int: ...

    def list(self, prefix: str) -> Iterator["Entry"]: ...

    def contents(self, prefix: str) -> tuple[list["Entry"], list[str]]: ...
