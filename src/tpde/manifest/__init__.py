"""The step manifest: the small JSON object whose appearance commits a step.

It is compact JSON (keys in insertion order, which the checkpoint's own dicts need) carrying a
BLAKE2b digest of its own body, so a flipped bit anywhere in it is detected; tensor bytes are
covered by each record's hash of the restored words. From format 3 it is stored as one zstd
frame: its record lists repeat the same keys for every tensor and compress about tenfold, and a
run holds one manifest per step. ``parse`` validates every field before anything is allocated
from it (read lazily, as a chain's reader reads it, each record when it is first used).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``.
"""

from __future__ import annotations

from tpde.manifest.model import (BOUNDED_FORMAT, DIGEST_SIZE, FORMAT, FRAMED_FORMAT, MAX_ELEMENTS,
                    MAX_MANIFEST_BYTES, PACKED_FORMAT, PIECES_FORMAT, SHARDED_FORMAT, XXH3,
                    XXH3_FORMAT, ZSTD_MAGIC, Manifest, Record, Records, SectionRef, canonical,
                    content_hash, format_for, hash_matches, record_hash)
from tpde.manifest.parsing import collector_paused, parse, plain

__all__ = ["BOUNDED_FORMAT", "DIGEST_SIZE", "FORMAT", "FRAMED_FORMAT", "MAX_ELEMENTS",
           "MAX_MANIFEST_BYTES", "PACKED_FORMAT", "PIECES_FORMAT", "SHARDED_FORMAT", "XXH3",
           "XXH3_FORMAT", "ZSTD_MAGIC", "Manifest", "Record", "Records", "SectionRef", "canonical",
           "collector_paused", "content_hash", "format_for", "hash_matches", "parse", "plain",
           "record_hash"]
