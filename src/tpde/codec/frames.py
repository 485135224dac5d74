"""Chunked Zstandard, written: a byte stream cut into fixed-size chunks, each a standard zstd
frame (``unframe`` reads them back).

Independent frames are what let the CPU (the process's frame threads; zstd releases the GIL
for each frame) and the GPU (nvCOMP's batched zstd in RAW mode) compress and decompress many
chunks at once, and what let either side read frames the other wrote.  The chunk table
(compressed size of every frame) is kept by the caller; raw chunk sizes follow from the chunk
size and the total.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import zstandard

from tpde.runtime import extensions
from tpde.runtime.frame_threads import spread

# Byte planes and residuals in C (_planes.c), with the GIL released; else numpy's passes.
native = extensions.load("_planes")

DEFAULT_CHUNK = 256 * 1024
MIN_CHUNK, MAX_CHUNK = 4 * 1024, 16 * 1024 * 1024
#: zstd's levels: its negative (fast) levels from ``ZSTD_minCLevel`` up to its strongest.
MIN_LEVEL, MAX_LEVEL = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL
#: None: the parameters of ``compressor`` below, measured for byte planes; an int: that zstd level.
DEFAULT_LEVEL: int | None = None


def compressor(level: int | None, chunk: int) -> zstandard.ZstdCompressor:
    """The zstd compressor for chunks of ``chunk`` bytes.

    The default (``level=None``) is zstd's fast strategy told to look for few, long matches
    (``min_match=7``, a 64-entry hash table) in a window that covers the chunk. A byte plane of
    floats is mostly a skewed alphabet with little repetition, so zstd's gain there is its
    Huffman coding of literals; short matches found by level 1 cost more than the literals they
    replace, and level 1's small-input tables cut each chunk into small blocks with a Huffman
    table each. On the top plane of real fp32 weights these settings come within a hair of
    the plane's order-0 entropy, smaller and faster than level 1 (``benchmarks/README.md``).
    Frames are standard either way: any zstd decoder (nvCOMP included) reads them.
    """
    if level is not None:
        return zstandard.ZstdCompressor(level=level, write_content_size=True)
    return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=_window(chunk), hash_log=6, chain_log=6, search_log=1, min_match=7,
        target_length=0, strategy=zstandard.STRATEGY_FAST, write_content_size=True))


def _window(chunk: int) -> int:
    """The window log that covers a chunk: all the default compressor depends on."""
    return max(10, (chunk - 1).bit_length())


@dataclass(frozen=True)
class Section:
    """One compressed stream: its raw size, its raw chunk size and its frames."""

    raw: int
    chunk: int
    frames: tuple[bytes | memoryview, ...]

    @functools.cached_property
    def stored(self) -> int:
        """Asked several times of each option an encode weighs: summed once."""
        return sum(map(len, self.frames))

    def table(self) -> tuple[int, ...]:
        return tuple(len(f) for f in self.frames)


def raw_sizes(raw: int, chunk: int) -> list[int]:
    """Raw size of every chunk of a stream of ``raw`` bytes."""
    full, rest = divmod(raw, chunk)
    return [chunk] * full + ([rest] if rest else [])


#: The fewest slices of a frame's words over which ``_columns`` splits a residual: the frame
#: threads take whole slices, and fewer leave one thread with a large share (such a residual
#: is split whole into its planes, as every smaller one is).
MIN_COLUMNS = 8


def compress(data: memoryview | bytes, *, level: int | None = DEFAULT_LEVEL,
             chunk: int = DEFAULT_CHUNK, threads: int | None = None) -> Section:
    """Compress ``data`` chunk by chunk on the CPU, on ``threads`` of the frame threads."""
    rows = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8).reshape(-1, 1)
    return compress_planes(rows, level=level, chunk=chunk, threads=threads)


def compress_planes(rows: np.ndarray, *, against: np.ndarray | None = None, mode: int = 0,
                    level: int | None = DEFAULT_LEVEL, chunk: int = DEFAULT_CHUNK,
                    threads: int | None = None) -> Section:
    """``compress`` of the byte planes of words given as their bytes, one row per word (byte
    ``i`` of plane ``k`` is ``rows[i, k]``), without making the planes; with ``against`` (the
    reference's words, the same shape), the planes of their residual (``mode``, numbered as in
    ``_planes.c``) and without making the residual where it spans ``MIN_COLUMNS`` slices of
    a frame's words or more (``_columns``); a smaller residual is split into all its planes in
    one pass (faster than made whole and gathered frame by frame). The frames are those ``compress`` makes of the shuffled stream.

    The words themselves (a keyframe) are gathered frame by frame, one plane at a time, into
    the cache where they are compressed (``_columns``' slice of every plane of a large slice
    of words does not fit one core's L2), and the frames of one range of words follow each other, so that only the first
    reads the words from memory.
    """
    n, width = rows.shape
    raw = n * width
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be in [{MIN_CHUNK}, {MAX_CHUNK}] bytes")
    if against is not None and not (against.shape == rows.shape and native_words(rows)
                                    and native_words(against)):
        raise ValueError("a residual's planes need words that _planes takes, of one shape")
    if against is not None:
        if -(-n // chunk) >= MIN_COLUMNS:
            return _columns(rows, against, mode, level, chunk, threads)
        planes = np.empty(raw, dtype=np.uint8)  # the residual's planes: its shuffled stream
        native.diff(rows, against, width, planes, mode, n)
        return compress(planes, level=level, chunk=chunk, threads=threads)
    starts = range(0, raw, chunk)
    out: list[bytes] = [b""] * len(starts)
    # Word by word, not plane by plane: each range of words is gathered for all its planes'
    # frames in turn, read from memory once and then from the cache (faster than its planes'
    # frames in stream order).
    order = range(len(starts)) if width == 1 or len(starts) <= width else \
        sorted(range(len(starts)), key=lambda j: (starts[j] % n, starts[j] // n))

    def work(mine: Iterable[int]) -> None:
        cctx = _compressor(level, chunk)
        buf = np.empty(min(chunk, raw), dtype=np.uint8)
        for j in (order[x] for x in mine):
            size, at = min(chunk, raw - starts[j]), 0
            if width == 1:  # one plane: the frame is a slice of the caller's buffer, no copy
                out[j] = cctx.compress(rows[starts[j] : starts[j] + size, 0])
                continue
            for k, i, m in _plane_parts(starts[j], size, n):  # it may end a plane, start the next
                take(rows, k, i, buf[at : at + m])
                at += m
            out[j] = cctx.compress(buf[:size])

    spread(len(starts), threads, work, raw)
    return Section(raw, chunk, tuple(out))


def compress_many(streams: list[tuple[np.ndarray, int]], *, level: int | None = DEFAULT_LEVEL,
                  threads: int | None = None) -> list[Section]:
    """``compress`` of each of many streams (contiguous bytes, and the chunk each is cut at),
    all their frames in one tight loop, spread over the frame threads as one stream's frames
    are. Coded a tensor at a time on threads side by side, each small tensor's few frames came
    between the Python of its encode, and the threads handed the GIL back and forth: a second
    thread coded many small dense deltas no faster than one. One compressor, whose
    window covers the largest chunk, makes the frames ``compress`` makes of every stream: zstd
    fits the window to a frame's known size.

    (zstandard's ``multi_compress_to_buffer`` releases the GIL for a whole batch, but starts
    its threads on every call: on many small frames two of them were no faster than one, and
    slower than this loop; ``benchmarks/frames_bench.py``.)"""
    for _, chunk in streams:
        if not MIN_CHUNK <= chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in [{MIN_CHUNK}, {MAX_CHUNK}] bytes")
    views = [memoryview(data).cast("B") for data, _ in streams]
    parts = [v[a : a + chunk] for v, (_, chunk) in zip(views, streams)
             for a in range(0, len(v), chunk)]
    done: list[bytes] = [b""] * len(parts)
    largest = max((c for _, c in streams), default=MIN_CHUNK)

    def work(mine: Iterable[int]) -> None:
        cctx = _compressor(level, largest)
        for j in mine:
            done[j] = cctx.compress(parts[j])

    spread(len(parts), threads, work, sum(map(len, views)))
    out, k = [], 0
    for v, (_, chunk) in zip(views, streams):
        count = -(-len(v) // chunk)
        out.append(Section(len(v), chunk, tuple(done[k : k + count])))
        k += count
    return out


def _plane_parts(start: int, size: int, n: int) -> list[tuple[int, int, int]]:
    """The (plane, first word, words) pieces of the stream bytes ``start:start + size`` of
    byte planes of ``n`` words."""
    out, at = [], 0
    while at < size:
        k, i = divmod(start + at, n)
        m = min(n - i, size - at)
        out.append((k, i, m))
        at += m
    return out


def _columns(rows: np.ndarray, against: np.ndarray, mode: int, level: int | None,
             chunk: int, threads: int | None) -> Section:
    """``compress_planes`` of a residual a slice of words at a time: each frame is given to the
    slice that holds the middle of its largest piece, the slice's residual is split into all
    its planes in one pass (``_planes.diff`` given a plane size, into a buffer of the thread
    that stays in cache), and the slice's frames are compressed from there, a frame within one
    plane without a copy. The words are read once, not once per plane, and a residual is never
    made whole, which cost most of its time faulting in the residual's fresh pages.

    A frame's other pieces (where it ends one plane and starts the next) that lie outside its
    slice's words are split on their own; they are at most a frame each, at the planes' ends.
    """
    n, width = rows.shape
    raw = n * width
    span = min(chunk, n)  # words per slice
    groups: dict[int, list[tuple[int, list[tuple[int, int, int]]]]] = {}
    windows: dict[int, tuple[int, int]] = {}  # by slice: the words its frames' largest pieces span
    for j, start in enumerate(range(0, raw, chunk)):
        parts = _plane_parts(start, min(chunk, raw - start), n)
        _, i, m = max(parts, key=lambda p: p[2])
        g = (i + m // 2) // span
        groups.setdefault(g, []).append((j, parts))
        lo, hi = windows.get(g, (i, i + m))
        windows[g] = (min(lo, i), max(hi, i + m))
    cap = max(hi - lo for lo, hi in windows.values())
    order = sorted(groups)
    out: list[bytes] = [b""] * -(-raw // chunk)

    def split(lo: int, hi: int, planes: np.ndarray, room: int) -> None:
        native.diff(rows[lo:hi], against[lo:hi], width, planes, mode, room)

    def work(mine: Iterable[int]) -> None:
        cctx = _compressor(level, chunk)
        planes = np.empty(width * cap, dtype=np.uint8)
        buf = np.empty(min(chunk, raw), dtype=np.uint8)
        for g in (order[x] for x in mine):
            lo, hi = windows[g]
            split(lo, hi, planes, cap)
            for j, parts in groups[g]:
                if len(parts) == 1 and lo <= parts[0][1] and parts[0][1] + parts[0][2] <= hi:
                    k, i, m = parts[0]
                    out[j] = cctx.compress(planes[k * cap + i - lo : k * cap + i - lo + m])
                    continue
                at = 0
                for k, i, m in parts:
                    if lo <= i and i + m <= hi:
                        buf[at : at + m] = planes[k * cap + i - lo : k * cap + i - lo + m]
                    else:
                        own = np.empty(width * m, dtype=np.uint8)
                        split(i, i + m, own, m)
                        buf[at : at + m] = own[k * m : (k + 1) * m]
                    at += m
                out[j] = cctx.compress(buf[:at])

    spread(len(order), threads, work, raw)
    return Section(raw, chunk, tuple(out))


def take(rows: np.ndarray, k: int, first: int, out: np.ndarray) -> None:
    """Byte ``k`` of words ``first, first + 1, ...`` of ``rows`` (their bytes, one row per word)
    into ``out`` (contiguous bytes)."""
    if native is not None and rows.flags.c_contiguous:
        native.take(rows, rows.shape[1], k, first, out)
    else:
        out[:] = rows[first : first + len(out), k]


def native_layout(contiguous: bool, width: int, address: int) -> bool:
    """Whether ``_planes``' word loops take words laid out so: they read and write whole
    words, so the words must be contiguous, aligned to their width, and in the host's order."""
    return native is not None and contiguous and sys.byteorder == "little" \
        and width in (1, 2, 4, 8) and address % width == 0


def native_words(rows: np.ndarray) -> bool:
    """``native_layout`` of words given as their bytes, one row per word."""
    return rows.flags.c_contiguous and native_layout(True, rows.shape[1], rows.ctypes.data)


# ---------------------------------------------------------------- each thread's zstd contexts
_local = threading.local()


def _compressor(level: int | None, chunk: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for these parameters (zstd contexts are not thread-safe, and
    making one per frame costs more than compressing a small frame). Kept by what sets its
    parameters: tensors of different sizes get different chunks (``codec.plane_chunk``), and
    keyed by the chunk, a bf16 model's save made a compressor for most tensors, each thread
    keeping every one it made."""
    made = _local.__dict__.setdefault("compressors", {})
    key = (level, None if level is not None else _window(chunk))
    if key not in made:
        made[key] = compressor(level, chunk)
    return made[key]


