"""Chunked Zstandard: a byte stream cut into fixed-size chunks, each a standard zstd frame.

Independent frames are what let the CPU (zstandard's multi-threaded batch API) and the GPU
(nvCOMP's batched zstd in RAW mode) compress and decompress many chunks at once, and what let
either side read frames the other wrote.  The chunk table (compressed size of every frame) is
kept by the caller; raw chunk sizes follow from the chunk size and the total.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zstandard

from . import heap
from .errors import FormatError

DEFAULT_CHUNK = 256 * 1024
MIN_CHUNK, MAX_CHUNK = 4 * 1024, 16 * 1024 * 1024
#: None: the parameters of ``compressor`` below, measured for byte planes; an int: that zstd level.
DEFAULT_LEVEL: int | None = None


def compressor(level: int | None, chunk: int) -> zstandard.ZstdCompressor:
    """The zstd compressor for chunks of ``chunk`` bytes.

    The default (``level=None``) is zstd's fast strategy told to look for few, long matches
    (``min_match=7``, a 64-entry hash table) in a window that covers the chunk. A byte plane of
    floats is mostly a skewed alphabet with little repetition, so zstd's gain there is its
    Huffman coding of literals; short matches found by level 1 cost more than the literals they
    replace, and level 1's small-input tables cut each chunk into small blocks with a Huffman
    table each. Measured on the top plane of real fp32 weights (benchmarks/README.md): 2.925x
    where the order-0 entropy allows 2.927x, against 2.55x for level 1, and 2-3x faster.
    Frames are standard either way: any zstd decoder (nvCOMP included) reads them.
    """
    if level is not None:
        return zstandard.ZstdCompressor(level=level, write_content_size=True)
    window = max(10, (chunk - 1).bit_length())
    return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=window, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
        strategy=zstandard.STRATEGY_FAST, write_content_size=True))


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class Section:
    """One compressed stream: its raw size, its raw chunk size and its frames."""

    raw: int
    chunk: int
    frames: tuple[bytes, ...]

    @property
    def stored(self) -> int:
        return sum(len(f) for f in self.frames)

    def table(self) -> list[int]:
        return [len(f) for f in self.frames]


def raw_sizes(raw: int, chunk: int) -> list[int]:
    """Raw size of every chunk of a stream of ``raw`` bytes."""
    full, rest = divmod(raw, chunk)
    return [chunk] * full + ([rest] if rest else [])


def compress(data: memoryview | bytes, *, level: int | None = DEFAULT_LEVEL,
             chunk: int = DEFAULT_CHUNK, threads: int | None = None) -> Section:
    """Compress ``data`` chunk by chunk on the CPU."""
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in [{MIN_CHUNK}, {MAX_CHUNK}] bytes")
    view = memoryview(data).cast("B")
    cctx = compressor(level, chunk)
    if len(view) <= chunk:
        return Section(len(view), chunk, (cctx.compress(view),) if len(view) else ())
    # The chunks are segments of the caller's buffer: no copy of the data before compressing.
    starts = range(0, len(view), chunk)
    segments = struct.pack(f"={2 * len(starts)}Q",
                           *(v for a in starts for v in (a, min(chunk, len(view) - a))))
    out = cctx.multi_compress_to_buffer(zstandard.BufferWithSegments(view, segments),
                                        threads=threads or default_threads())
    return Section(len(view), chunk, tuple(seg.tobytes() for seg in out))


def check_table(raw: int, chunk: int, table: list[int], *, limit: int) -> None:
    """Reject a chunk table that is inconsistent or larger than ``limit`` raw bytes."""
    if raw < 0 or raw > limit:
        raise FormatError(f"stream claims {raw} raw bytes where at most {limit} are possible")
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise FormatError(f"chunk size {chunk} is outside [{MIN_CHUNK}, {MAX_CHUNK}]")
    if len(table) != len(raw_sizes(raw, chunk)) or any(n <= 0 for n in table):
        raise FormatError("chunk table does not match the stream's raw size")


def check_declared(frames: Sequence[memoryview | bytes], sizes: list[int]) -> bool:
    """Refuse a frame whose header declares another size than its chunk's; True when every
    frame declares its size (some GPU encoders omit it)."""
    try:
        declared = [zstandard.get_frame_parameters(f).content_size for f in frames]
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame cannot be decoded: {exc}") from None
    for d, size in zip(declared, sizes):
        if d not in (size, zstandard.CONTENTSIZE_UNKNOWN):
            raise FormatError(f"zstd frame declares {d} bytes where {size} are expected")
    return zstandard.CONTENTSIZE_UNKNOWN not in declared


#: Frames decompressed per call on all cores (32 of the default 256 KiB chunks: 8 MiB).
DECOMPRESS_GROUP = 32


def decompress(frames: list[memoryview | bytes], raw: int, chunk: int, *,
               threads: int | None = None, group: int | None = None) -> bytearray:
    """Decompress frames back to one stream of exactly ``raw`` bytes.

    The expected size of every chunk is passed to zstd, so a frame that claims or produces more
    is refused before anything large is allocated. ``group`` frames (default
    ``DECOMPRESS_GROUP``) are decompressed at a time, beside the result.
    """
    group_of = group or DECOMPRESS_GROUP
    sizes = raw_sizes(raw, chunk)
    if len(sizes) != len(frames):
        raise FormatError("chunk count does not match the stream's raw size")
    if not frames:
        return bytearray()
    dctx = zstandard.ZstdDecompressor()
    try:
        # zstd allocates what a frame declares, whatever max_output_size says: sizes first,
        # and nothing allocated before the frames have been checked.
        if not check_declared(frames, sizes):
            # A frame that declares no size (some GPU encoders omit it) is bounded by its
            # chunk's.
            grown = bytearray()
            for frame, n in zip(frames, sizes):
                part = dctx.decompress(frame, max_output_size=n)
                if len(part) != n:
                    raise FormatError("a zstd frame decoded to the wrong number of bytes")
                grown += part
            return grown
        whole = bytearray(raw)  # writable: callers wrap it in a tensor without a copy
        view, at = memoryview(whole), 0
        # On all cores, a group of frames at a time, straight into the result: what is held
        # beside it stays small however large the stream.
        for i in range(0, len(frames), group_of):
            group = sizes[i : i + group_of]
            parts: Any = dctx.multi_decompress_to_buffer(
                list(frames[i : i + group_of]), threads=threads or default_threads(),
                decompressed_sizes=struct.pack(f"={len(group)}Q", *group))
            for part, n in zip(parts, group):
                if len(part) != n:
                    raise FormatError("a zstd frame decoded to the wrong number of bytes")
                view[at : at + n] = part
                at += n
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd frame cannot be decoded: {exc}") from None
    return whole


class Framed:
    """A section's frames, decompressed only as its bytes are asked for.

    What a decode reads when memory comes first (a mount at budget 0): the stream is never
    held whole beside the words it becomes, and ``frames`` may be a sequence that reads each
    frame from the store only when it is asked for. Frames are decompressed into a few reused
    buffers, the last ``keep`` of them kept, so that reading a slice of words plane after
    plane, slice after slice, decompresses each frame once.
    """

    def __init__(self, frames: Sequence[memoryview | bytes], raw: int, chunk: int) -> None:
        self.sizes = raw_sizes(raw, chunk)
        if len(self.sizes) != len(frames):
            raise FormatError("chunk count does not match the stream's raw size")
        self.frames, self.raw, self.chunk = frames, raw, chunk
        self.keep = 2  # enough to read planes in order; a slice-wise reader asks for more
        self._dctx = zstandard.ZstdDecompressor()
        self._held: dict[int, np.ndarray] = {}  # frame index -> its buffer, oldest first
        self._spare: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.raw

    def _frame(self, i: int) -> np.ndarray:
        n = self.sizes[i]
        if i in self._held:
            return self._held[i][:n]
        while len(self._held) >= self.keep:
            self._spare.append(self._held.pop(next(iter(self._held))))
        buf = self._spare.pop() if self._spare else heap.outside_heap(self.chunk)
        frame, view, got = self.frames[i], memoryview(buf)[:n], 0
        check_declared([frame], [n])
        try:
            with self._dctx.stream_reader(frame, read_across_frames=False) as reader:
                while got < n:
                    step = reader.readinto(view[got:])
                    if not step:
                        break
                    got += step
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd frame cannot be decoded: {exc}") from None
        if got != n or extra:
            raise FormatError("a zstd frame decoded to the wrong number of bytes")
        self._held[i] = buf
        return buf[:n]

    def read_into(self, lo: int, out: np.ndarray) -> None:
        """Fill ``out`` (bytes, strided or not) with the stream's bytes from ``lo`` on."""
        at = 0
        while at < len(out):
            i, off = divmod(lo + at, self.chunk)
            frame = self._frame(i)
            m = min(len(frame) - off, len(out) - at)
            out[at : at + m] = frame[off : off + m]
            at += m
