"""Chunked Zstandard, read back: a section's frames decompressed straight into the words they
hold, on the frame threads or, memory first, a frame at a time (``Framed``).

Every frame's declared size is checked against its chunk's before zstd is told that size, so a
frame that claims or produces more is refused before anything large is allocated.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import zstandard

from tpde.codec import frames
from tpde.codec.frames import MAX_CHUNK, MIN_CHUNK, native_words, raw_sizes
from tpde.errors import FormatError
from tpde.runtime import extensions, heap
from tpde.runtime.frame_threads import spread

# Frames decompressed outside the GIL by the system's zstd (_zframes.c), where found.
zframes = extensions.load("_zframes")
if zframes is not None and not zframes.version():
    zframes = None

#: Streams held in memory up to this size are decompressed whole, and
#: their words joined (or applied) in one more call (``whole``, ``join_whole``); larger ones a
#: slice at a time on the frame threads, where a few buffers per thread cost less than the
#: whole stream beside the words.
WHOLE_BYTES = 1 << 20
#: The fewest raw bytes of a ``Framed`` stream worth handing to another frame thread
#: (``by_slices``).
FRAMED_SPREAD_BYTES = 8 << 20


def check_table(raw: int, chunk: int, table: Sequence[int], *, limit: int) -> None:
    """Reject a chunk table that is inconsistent or larger than ``limit`` raw bytes (its
    entries are positive integers: the manifest's parser checks each as it reads it)."""
    if raw < 0 or raw > limit:
        raise FormatError(f"stream claims {raw} raw bytes where at most {limit} are possible")
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise FormatError(f"chunk size {chunk} is outside [{MIN_CHUNK}, {MAX_CHUNK}]")
    if len(table) != -(-raw // chunk):
        raise FormatError("chunk table does not match the stream's raw size")


def cut(section: bytes | memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """A section's bytes, read in one piece, as its frames (``sizes``: their compressed
    sizes, from the manifest), without a copy."""
    view, at, out = memoryview(section), 0, []
    for n in sizes:
        out.append(view[at : at + n])
        at += n
    return out


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
    its first word, shared out in runs of slices over the frame threads, each reading the
    frames through a ``Framed`` of its own, which checks each frame's declared size as its
    thread reaches it (not all of them first on this thread, where nothing else would run
    beside the checks).

    A ``Framed`` stream (a memory-first decode, whose frames may be fetched as they are
    reached) is shared out only from ``FRAMED_SPREAD_BYTES`` a thread on: its records come
    one at a time, so a large one is the only work a second core can take, and each thread
    holds a few frames more. Each run of slices reads the frames inside ``frames.reading()``
    where they have one (a store's files kept open for the run, on its thread).
    """
    per = stream.chunk
    least = FRAMED_SPREAD_BYTES if isinstance(stream, Framed) else None
    reading = getattr(stream.frames, "reading", contextlib.nullcontext)

    def run(mine: Iterable[int]) -> None:
        with reading():
            work(Framed(stream.frames, stream.raw, stream.chunk), (i * per for i in mine))

    spread(-(-n // per), threads, run, stream.raw, least)


def unshuffle_into(stream: Frames | Framed, rows: np.ndarray, *,
                   threads: int | None = None) -> None:
    """Decompress a stream of byte planes straight into the words they hold: ``rows`` is the
    words' bytes, one row per word, and byte ``i`` of plane ``k`` goes to ``rows[i, k]``.

    Slice by slice (``by_slices``), a slice's part of every plane is decompressed (each frame
    once, as ``Framed`` keeps the last ones) and its words are joined from the frames in cache,
    in one write pass (``Framed.words_into``). No copy of the planes is held beside the words,
    and the words are not written once per plane, where a keyframe's restore spent most of
    its time.
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


def whole(stream: Frames) -> list[bytes | np.ndarray]:
    """A small stream's frames decompressed: all of them in one call by ``_zframes`` (where
    it found zstd), which holds no GIL and takes no Python per frame, else each in one call to
    zstandard. Through ``Framed`` and the frame threads, small records cost more than those
    direct calls, and ``_zframes`` less still. Each frame's declared size is checked first,
    and zstd is told the size, so a frame that claims or produces more is refused before
    anything large is allocated."""
    if zframes is not None:  # which checks the chunk count as the loop below does
        data = heap.in_heap(stream.raw)
        _unframed(stream.frames[:], stream.chunk, data)  # a memory-first decode: one read
        return [data]
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


def frame_into(frame: memoryview | bytes, buf: np.ndarray, n: int) -> None:
    """One frame of ``n`` raw bytes decompressed into ``buf[:n]``, its declared size checked
    first: by ``_zframes`` where it found zstd, else by zstandard, with a few microseconds of
    Python a frame more."""
    if zframes is not None:
        _unframed((frame,), n, buf[:n])
        return
    view, got = memoryview(buf)[:n], 0
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


def _unframed(frames: Sequence[memoryview | bytes], chunk: int, out: np.ndarray) -> None:
    """``_zframes.unframe``, what it refuses raised as damage."""
    try:
        zframes.unframe(frames, chunk, out)
    except ValueError as exc:
        raise FormatError(str(exc)) from None


def join_whole(parts: list[bytes], rows: np.ndarray, mode: int = 0) -> None:
    """Words from a whole stream of their byte planes, decompressed frame by frame (``whole``),
    into ``rows`` (their bytes, one row per word): stored or, with a ``mode`` of ``_planes.c``
    (``native_words`` rows only), applied to them as a residual, in one pass. Frames that are
    the planes (a small record's chunk is its plane) are joined where they are."""
    n, width = rows.shape
    if len(parts) != width or any(len(p) != n for p in parts):
        joined = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
        parts = [joined[k * n : (k + 1) * n] for k in range(width)]
    if native_words(rows):
        frames.native.join(parts, width, rows, mode)
    else:  # stored only: residuals are applied here to native words alone (apply_streamed)
        for k, plane in enumerate(parts):
            rows[:, k] = np.frombuffer(plane, dtype=np.uint8)


def join(planes: np.ndarray, rows: np.ndarray) -> None:
    """Words from their byte planes: ``rows[j, k] = planes[k, j]`` (``planes`` contiguous)."""
    if native_words(rows):
        frames.native.join(planes, rows.shape[1], rows, 0)
    else:
        for k in range(rows.shape[1]):
            rows[:, k] = planes[k]


_local = threading.local()  # each thread's zstd context


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
    plane, slice after slice, decompresses each frame once. Each frame thread that takes a run
    of a stream's slices reads them through a ``Framed`` of its own (``by_slices``).
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
        frame_into(self.frames[i], buf, n)
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
            frames.native.join(parts, width, rows[a - lo : b - lo], mode)

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
