"""A chain's reads served from compressed bytes a mount holds in memory (``resident="host"``),
so that a just-in-time decode never goes back to the store for them."""

from __future__ import annotations

import bisect
from typing import Any

from tpde.store.store import Store


class ResidentStore:
    """Serves a chain's reads of the mounted records from compressed bytes held in memory:
    whole sections, or parts of them (a streamed decode reads frame by frame)."""

    whole_blob_reads = False

    def __init__(self, store: Store, held: dict[str, dict[tuple[int, int], bytes]]) -> None:
        self._store, self._held = store, held
        self._starts = {blob: sorted(ranges) for blob, ranges in held.items()}

    def _part(self, rel: str, a: int, b: int) -> memoryview | None:
        starts = self._starts.get(rel, [])
        i = bisect.bisect_right(starts, (a, float("inf"))) - 1
        if i < 0 or starts[i][1] < b:
            return None
        a0 = starts[i][0]
        return memoryview(self._held[rel][starts[i]])[a - a0 : b - a0]

    def read_range(self, rel: str, a: int, b: int) -> Any:
        part = self._part(rel, a, b)
        return part if part is not None else self._store.read_range(rel, a, b)

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[Any]:
        parts = [self._part(rel, a, b) for a, b in ranges]
        if all(p is not None for p in parts):
            return parts
        return self._store.read_ranges(rel, ranges)

    def descriptor(self, rel: str) -> None:
        """None: the mounted records' bytes are read from memory, not from the files."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
