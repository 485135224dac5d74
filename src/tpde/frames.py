"""Chunked Zstandard: a byte stream cut into fixed-size chunks, each a standard zstd frame.

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
from typing import Callable, Iterable, Sequence

import numpy as np
import zstandard

from . import heap
from .errors import FormatError
from .frame_threads import spread

try:  # byte planes and residuals in C (_planes.c), with the GIL released
    from . import _planes as native
except ImportError:  # built without a compiler: numpy's passes
    native = None

DEFAULT_CHUNK = 256 * 1024
#: Streams held in memory up to this size are decompressed whole, a call per frame, and
#: their words joined (or applied) in one more call (``whole``, ``join_whole``); larger ones a
#: slice at a time on the frame threads, where a few buffers per thread cost less than the
#: whole stream beside the words.
WHOLE_BYTES = 1 << 20
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
#: threads take whole slices, and fewer leave one thread with a large share (3 slices of a
#: 2.4 MB fp32 residual on 2 threads: 0.98 ms, against 0.83 made whole first; split whole
#: into its planes now, as every smaller residual is).
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
    one pass (3-10% faster than made whole and gathered frame by frame, from 4K to 1.5M fp32
    words). The frames are those ``compress`` makes of the shuffled stream.

    The words themselves (a keyframe) are gathered frame by frame, plane by plane: a frame's
    words are read from memory straight into the cache where they are compressed
    (``_columns``' slice of every plane of 256K fp32 words does not fit one core's L2 here: a
    64 MiB keyframe piece took 25 ms that way, 22 gathered).
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

    def work(mine: Iterable[int]) -> None:
        cctx = _compressor(level, chunk)
        buf = np.empty(min(chunk, raw), dtype=np.uint8)
        for j in mine:
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
    made whole: a 64 MiB piece's ``sub`` residual and its planes took 45 ms (33 of them
    faulting in the residual's fresh pages), and take 10.5 ms split.

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


def check_table(raw: int, chunk: int, table: Sequence[int], *, limit: int) -> None:
    """Reject a chunk table that is inconsistent or larger than ``limit`` raw bytes (its
    entries are positive integers: the manifest's parser checks each as it reads it)."""
    if raw < 0 or raw > limit:
        raise FormatError(f"stream claims {raw} raw bytes where at most {limit} are possible")
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise FormatError(f"chunk size {chunk} is outside [{MIN_CHUNK}, {MAX_CHUNK}]")
    if len(table) != -(-raw // chunk):
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


def decompress(frames: Sequence[memoryview | bytes], raw: int, chunk: int, *,
               threads: int | None = None) -> np.ndarray:
    """Decompress frames back to one stream of exactly ``raw`` bytes, on ``threads`` of the
    frame threads, each frame straight into its place in the result (a writable array that
    callers wrap in a tensor without a copy); beside it, one frame per thread at a time.

    The expected size of every chunk is passed to zstd, so a frame that claims or produces more
    is refused before anything large is allocated.
    """
    whole = np.empty(raw, dtype=np.uint8)  # not zero-filled first, as a bytearray would be
    unshuffle_into(Frames(frames, raw, chunk), whole.reshape(-1, 1), threads=threads)
    return whole


@dataclass(frozen=True)
class Frames:
    """A section's frames, left for the decode to decompress where their bytes go
    (``unshuffle_into``)."""

    frames: Sequence[memoryview | bytes]
    raw: int
    chunk: int


def by_slices(stream: Frames | Framed, n: int,
              work: Callable[[Framed, Iterable[int]], None], *, threads: int | None = None
              ) -> None:
    """``work(framed, starts)`` over the slices of a stream of the byte planes of ``n`` words,
    each slice ``chunk`` words (its part of every plane spans at most two frames), given by
    its first word. A ``Framed`` is read on this thread, as its frames may be fetched as they
    are reached; frames held in memory are shared out in runs of slices over the frame
    threads, each reading them through a ``Framed`` of its own, which checks each frame's
    declared size as its thread reaches it (not all of them first on this thread: 0.5 ms of a
    32 MiB piece's 12 that nothing else ran beside)."""
    per = stream.chunk
    if isinstance(stream, Framed):
        work(stream, range(0, n, per))
        return
    spread(-(-n // per), threads,
           lambda mine: work(Framed(stream.frames, stream.raw, stream.chunk),
                             (i * per for i in mine)), stream.raw)


def unshuffle_into(stream: Frames | Framed, rows: np.ndarray, *,
                   threads: int | None = None) -> None:
    """Decompress a stream of byte planes straight into the words they hold: ``rows`` is the
    words' bytes, one row per word, and byte ``i`` of plane ``k`` goes to ``rows[i, k]``.

    Slice by slice (``by_slices``), a slice's part of every plane is decompressed (each frame
    once, as ``Framed`` keeps the last ones) and its words are joined from the frames in cache,
    in one write pass (``Framed.words_into``). No copy of the planes is held beside the words,
    and the words are not written once per plane: put plane by plane, a 200 MB keyframe
    restored at 2.0-2.2 GB/s, 57% of its samples in the puts.
    """
    n, width = rows.shape
    if len(raw_sizes(stream.raw, stream.chunk)) != len(stream.frames) or n * width != stream.raw:
        raise FormatError("chunk count does not match the stream's raw size")
    if isinstance(stream, Frames) and stream.raw <= WHOLE_BYTES:
        join_whole(whole(stream), rows)
        return

    def work(framed: Framed, starts: Iterable[int]) -> None:
        for lo in starts:
            framed.words_into(n, lo, rows[lo : lo + stream.chunk])

    by_slices(stream, n, work, threads=threads)


def whole(stream: Frames) -> list[bytes]:
    """A small stream's frames, each decompressed in one call: through ``Framed`` and the frame
    threads, E's small records took 16 us each where this and ``join_whole`` take 6. Each
    frame's declared size is checked first, and zstd is told the size, so a frame that claims
    or produces more is refused before anything large is allocated."""
    sizes = raw_sizes(stream.raw, stream.chunk)
    if len(sizes) != len(stream.frames):
        raise FormatError("chunk count does not match the stream's raw size")
    dctx, out = _decompressor(), []
    for i, size in enumerate(sizes):
        frame = stream.frames[i]  # once: a memory-first decode's frames are read as asked for
        check_declared([frame], [size])
        try:
            data = dctx.decompress(frame, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd frame cannot be decoded: {exc}") from None
        if len(data) != size:
            raise FormatError("a zstd frame decoded to the wrong number of bytes")
        out.append(data)
    return out


def join_whole(parts: list[bytes], rows: np.ndarray, mode: int = 0) -> None:
    """Words from a whole stream of their byte planes, decompressed frame by frame (``whole``),
    into ``rows`` (their bytes, one row per word): stored or, with a ``mode`` of ``_planes.c``
    (``native_words`` rows only), applied to them as a residual, in one pass. Frames that are
    the planes (a small record's chunk is its plane) are joined where they are."""
    n, width = rows.shape
    if len(parts) != width or any(len(p) != n for p in parts):
        joined = memoryview(b"".join(parts))
        parts = [joined[k * n : (k + 1) * n] for k in range(width)]
    if native_words(rows):
        native.join(parts, width, rows, mode)
    else:  # stored only: residuals are applied here to native words alone (apply_streamed)
        for k, plane in enumerate(parts):
            rows[:, k] = np.frombuffer(plane, dtype=np.uint8)


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


def join(planes: np.ndarray, rows: np.ndarray) -> None:
    """Words from their byte planes: ``rows[j, k] = planes[k, j]`` (``planes`` contiguous)."""
    if native_words(rows):
        native.join(planes, rows.shape[1], rows, 0)
    else:
        for k in range(rows.shape[1]):
            rows[:, k] = planes[k]


# ---------------------------------------------------------------- each thread's zstd contexts
_local = threading.local()


def _compressor(level: int | None, chunk: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for these parameters (zstd contexts are not thread-safe, and
    making one per frame costs more than compressing a small frame). Kept by what sets its
    parameters: tensors of different sizes get different chunks (``codec.plane_chunk``), and
    keyed by the chunk, C-minilm-bf16's save made a compressor for most tensors (3% of the
    time its threads held the GIL), each thread keeping every one it made."""
    made = _local.__dict__.setdefault("compressors", {})
    key = (level, None if level is not None else _window(chunk))
    if key not in made:
        made[key] = compressor(level, chunk)
    return made[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx


class Framed:
    """A section's frames, decompressed only as its bytes are asked for.

    What a decode reads when memory comes first (a mount at budget 0): the stream is never
    held whole beside the words it becomes, and ``frames`` may be a sequence that reads each
    frame from the store only when it is asked for. Frames are decompressed into a few reused
    buffers, the last ``keep`` of them kept, so that reading a slice of words plane after
    plane, slice after slice, decompresses each frame once. The restore path reads frames held
    in memory the same way, a run of slices per frame thread (``by_slices``).
    """

    def __init__(self, frames: Sequence[memoryview | bytes], raw: int, chunk: int) -> None:
        self.sizes = raw_sizes(raw, chunk)
        if len(self.sizes) != len(frames):
            raise FormatError("chunk count does not match the stream's raw size")
        self.frames, self.raw, self.chunk = frames, raw, chunk
        self.keep = 2  # frames held decompressed: enough to read a plane in order
        self._held: dict[int, np.ndarray] = {}  # frame index -> its buffer, oldest first
        self._spare: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.raw

    def _frame(self, i: int) -> np.ndarray:
        n = self.sizes[i]
        if i in self._held:  # now the most recently used: what is evicted is the oldest
            self._held[i] = self._held.pop(i)
            return self._held[i][:n]
        while len(self._held) >= self.keep:
            self._spare.append(self._held.pop(next(iter(self._held))))
        buf = self._spare.pop() if self._spare else heap.in_heap(self.chunk)
        frame, view, got = self.frames[i], memoryview(buf)[:n], 0
        check_declared([frame], [n])
        try:
            with _decompressor().stream_reader(frame, read_across_frames=False) as reader:
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
        """Fill ``out`` (contiguous bytes) with the stream's bytes from ``lo`` on."""
        at = 0
        while at < len(out):
            i, off = divmod(lo + at, self.chunk)
            frame = self._frame(i)
            m = min(len(frame) - off, len(out) - at)
            out[at : at + m] = frame[off : off + m]
            at += m

    def planes_into(self, n: int, lo: int, planes: np.ndarray) -> None:
        """Words ``lo:lo + m`` of a stream of the byte planes of ``n`` words, as their own
        byte planes: ``planes`` is ``(width, m)``, contiguous."""
        self.keep = max(self.keep, 2 * planes.shape[0] + 2)  # see join_into
        for k in range(planes.shape[0]):
            self.read_into(k * n + lo, planes[k])

    def join_into(self, n: int, lo: int, rows: np.ndarray, mode: int = 0) -> None:
        """Words ``lo:lo + len(rows)`` of a stream of the byte planes of ``n`` words joined
        into ``rows`` (``native_words``) straight from the decompressed frames, stored or, with
        a ``mode`` of ``_planes.c``, applied to them as a residual."""
        m, width = rows.shape
        # The two frames each plane's part may span stay held for the next slice, which
        # starts in the second: each frame is decompressed once.
        self.keep = max(self.keep, 2 * width + 2)
        # Cut where any plane's part crosses into its next frame: between two cuts every
        # plane's part lies in one frame, and the words are joined from the frames in place.
        cuts = {lo, lo + m}
        for k in range(width):
            first = -(-(k * n + lo + 1) // self.chunk) * self.chunk - k * n
            cuts.update(range(first, lo + m, self.chunk))
        edges = sorted(cuts)
        for a, b in zip(edges, edges[1:]):
            parts = []
            for k in range(width):
                i, off = divmod(k * n + a, self.chunk)
                parts.append(self._frame(i)[off : off + b - a])
            native.join(parts, width, rows[a - lo : b - lo], mode)

    def words_into(self, n: int, lo: int, rows: np.ndarray) -> None:
        """Words ``lo:lo + len(rows)`` of a stream of the byte planes of ``n`` words into
        ``rows`` (their bytes, one row per word)."""
        m, width = rows.shape
        if width == 1:
            self.read_into(lo, rows.reshape(-1))
        elif native_words(rows):
            self.join_into(n, lo, rows)
        else:
            planes = heap.in_heap(m * width).reshape(width, m)
            self.planes_into(n, lo, planes)
            join(planes, rows)
