"""A mounted run's reads (``tpde.mount``): a chain's reads of the mounted records served from
compressed bytes held in memory (``resident="host"``), so that a just-in-time decode never goes
back to the store for them, or range reads of the store (``resident="store"``: no held bytes).
A mount never writes: every write is refused."""

from __future__ import annotations

import bisect
from contextlib import AbstractContextManager
from typing import BinaryIO, Iterator, NoReturn

from tpde.errors import TPDEError
from tpde.store.protocol import ByteStore
from tpde.store.blob import BlobWriter
from tpde.store.store import Entry


class ResidentStore(ByteStore):
    """``store`` read-only, its reads of ``held`` ranges served from memory: whole sections,
    or parts of them (a streamed decode reads frame by frame). Blobs are read by range, never
    whole (a module's records are a small part of their step's blob)."""

    whole_blob_reads = False

    def __init__(self, store: ByteStore, held: dict[str, dict[tuple[int, int], bytes]]) -> None:
        self._store, self._held = store, held
        self._starts = {blob: sorted(ranges) for blob, ranges in held.items()}
        self.url, self.local, self.location = store.url, store.local, store.location

    def _part(self, rel: str, a: int, b: int) -> memoryview | None:
        starts = self._starts.get(rel, [])
        i = bisect.bisect_right(starts, (a, float("inf"))) - 1
        if i < 0 or starts[i][1] < b:
            return None
        a0 = starts[i][0]
        return memoryview(self._held[rel][starts[i]])[a - a0 : b - a0]

    # ------------------------------------------------------------------ reads
    def read_range(self, rel: str, a: int, b: int) -> bytes | memoryview:
        part = self._part(rel, a, b)
        return part if part is not None else self._store.read_range(rel, a, b)

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        parts = [self._part(rel, a, b) for a, b in ranges]
        if all(p is not None for p in parts):
            return parts  # type: ignore[return-value]
        return self._store.read_ranges(rel, ranges)

    def descriptor(self, rel: str) -> int | None:
        """None where bytes are held: the mounted records are read from memory, not from the
        files. Without held bytes, the store's."""
        return None if self._held else self._store.descriptor(rel)

    def read(self, rel: str, size_hint: int = 0) -> bytes | memoryview:
        return self._store.read(rel, size_hint)

    def open_read(self, rel: str) -> BinaryIO:
        return self._store.open_read(rel)

    def kept_open(self) -> AbstractContextManager[None]:
        return self._store.kept_open()

    def exists(self, rel: str) -> bool:
        return self._store.exists(rel)

    def kind(self, rel: str) -> str | None:
        return self._store.kind(rel)

    def size(self, rel: str) -> int:
        return self._store.size(rel)

    def list(self, prefix: str) -> Iterator[Entry]:
        return self._store.list(prefix)

    def contents(self, prefix: str) -> tuple[list[Entry], list[str]]:
        return self._store.contents(prefix)

    # ------------------------------------------------------------------ writes
    def _refuse(self, rel: str) -> NoReturn:
        raise TPDEError(f"a mounted run is read-only: nothing writes {rel} through a mount; "
                        "save through tpde.Checkpointer instead", run=self.url)

    def put_atomic(self, rel: str, data: bytes) -> None:
        self._refuse(rel)

    def open_write(self, rel: str) -> BlobWriter:
        self._refuse(rel)

    def delete(self, rel: str) -> None:
        self._refuse(rel)

    def delete_tree(self, rel: str) -> None:
        self._refuse(rel)
