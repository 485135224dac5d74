"""Elias-delta coding of the sorted positions that changed, with sync points for parallel decode.

Gaps ``g >= 1`` between consecutive positions are coded (the first gap is ``position + 1``):
``N = floor(log2 g)``, ``L = floor(log2(N + 1))``; ``L`` zero bits, ``N + 1`` in ``L + 1`` bits,
then the low ``N`` bits of ``g``, MSB first.  Every ``block`` codes a sync point records the bit
offset of the block's first code and the *base* (last position before the block, plus one), so
blocks decode independently.  On the CPU the C coder (``_elias.c``) codes and decodes a stream
in one pass without the GIL; where it was not built, the numpy coder runs all blocks in lockstep
— the same shape of work a GPU kernel does with one thread per block — so no Python loop runs
per element.  Both write the same streams and refuse the same damage.

Stream layout (all little-endian)::

    u64 count | u32 block | u32 reserved (0) | u64 nbits
    count_sync × (u64 bit_offset, u64 base)       count_sync = ceil(count / block)
    ceil(nbits / 8) bytes of codes
"""

from __future__ import annotations

import struct

import numpy as np

from tpde.errors import FormatError
from tpde.runtime import extensions

# The same coder in C (_elias.c), built with the package where a compiler is found; else
# numpy's.
native = extensions.load("_elias")

HEADER = struct.Struct("<QIIQ")
DEFAULT_BLOCK = 256
#: Positions must stay below 2**56 so every suffix fits one 57-bit read.
MAX_POSITION = (1 << 56) - 1
_U64 = np.uint64


def bit_length(x: np.ndarray) -> np.ndarray:
    """Exact ``int.bit_length`` for a uint64 array.

    ``frexp`` is exact below 2**53; the rare larger values take an exact shift ladder.
    """
    x = np.asarray(x, dtype=_U64)
    n = np.frexp(x.astype(np.float64))[1].astype(np.int64)
    big = np.flatnonzero(x >= _U64(1 << 53))
    if big.size:
        n[big] = _bit_length_exact(x[big])
    return n


def _bit_length_exact(x: np.ndarray) -> np.ndarray:
    x = x.astype(_U64, copy=True)
    n = np.zeros(x.shape, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        big = x >= (_U64(1) << _U64(shift))
        n += big * shift
        x = np.where(big, x >> _U64(shift), x)
    return n + (x > 0)


def code_lengths(gaps: np.ndarray) -> np.ndarray:
    """Bits each gap takes: ``2 L + 1 + N``."""
    n = bit_length(gaps) - 1
    ell = bit_length((n + 1).astype(_U64)) - 1
    return 2 * ell + 1 + n


#: Bits of the code of a gap of bit length ``N + 1``, by ``N``: a code's length depends on
#: nothing else.
_BITS_BY_N = np.array([2 * ((n + 1).bit_length() - 1) + 1 + n for n in range(64)], np.int64)


def encoded_bits(positions: np.ndarray, *, use_native: bool = True) -> int:
    """Exact size in bits of the codes for ``positions``, without building them: in C where
    built, otherwise a histogram of the gaps' bit lengths (twice as fast as summing
    ``code_lengths``)."""
    p = _checked(positions)
    if native is not None and use_native:
        return native.encoded_bits(np.ascontiguousarray(p))
    total = 0
    for lo, hi in _pieces(p.size, 1):
        counts = np.bincount(bit_length(_gaps(p, lo, hi)) - 1, minlength=64)
        total += int(counts @ _BITS_BY_N)
    return total


#: Positions coded at once. The encoder's temporaries (about 16 arrays of 8 bytes per position)
#: stay bounded however many positions changed, and pieces that fit in cache code several
#: times faster than the whole at once.
PIECE = 1 << 16


def _pieces(count: int, block: int) -> list[tuple[int, int]]:
    step = max(block, PIECE // block * block)
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


def _checked(positions: np.ndarray) -> np.ndarray:
    p = np.asarray(positions, dtype=np.int64)
    if p.ndim != 1:
        raise ValueError("positions must be one-dimensional")
    if p.size and (p[0] < 0 or p[-1] > MAX_POSITION):
        raise ValueError(f"positions must lie in [0, {MAX_POSITION}]")
    return p


def _gaps(p: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Gaps of ``p[lo:hi]``, the first one from the position before ``lo`` (or from -1)."""
    gaps = np.empty(hi - lo, dtype=np.int64)
    if hi > lo:
        gaps[0] = p[lo] - (p[lo - 1] if lo else -1)
        np.subtract(p[lo + 1 : hi], p[lo : hi - 1], out=gaps[1:])
        if (gaps <= 0).any():
            raise ValueError("positions must be strictly increasing")
    return gaps.view(_U64)


def _segment_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Indices where a run of equal keys starts in a sorted array."""
    if sorted_keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(([0], np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1))


def _pack(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Concatenate codes of ``lengths`` bits (each in 1..64) MSB-first into 64-bit words."""
    ends = np.cumsum(lengths)
    nbits = int(ends[-1]) if ends.size else 0
    nwords = (nbits + 63) // 64
    words = np.zeros(nwords + 1, dtype=_U64)
    if nbits:
        starts = ends - lengths
        word = starts >> 6
        ln = lengths.astype(_U64)
        room = _U64(64) - (starts & 63).astype(_U64)
        fits = ln <= room
        # The part that lands in `word`: left-aligned after the bits already there, or, for a
        # code that spills into the next word, its top `room` bits.
        head = np.where(fits, values << ((room - ln) * fits), values >> ((ln - room) * ~fits))
        seg = _segment_starts(word)
        words[word[seg]] = np.bitwise_or.reduceat(head, seg)
        spill = np.flatnonzero(~fits)
        rest = ln[spill] - room[spill]
        words[word[spill] + 1] |= values[spill] << (_U64(64) - rest)
    return words[:nwords], nbits


class _BitWriter:
    """Appends MSB-first runs of 64-bit words at any bit offset."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.tail, self.nbits = _U64(0), 0

    def append(self, words: np.ndarray, nbits: int) -> None:
        used = self.nbits % 64
        joined = np.zeros(words.size + 1, dtype=_U64)
        if used:
            joined[:-1] = words >> _U64(used)
            joined[1:] |= words << _U64(64 - used)
        else:
            joined[:-1] = words
        joined[0] |= self.tail
        full = (used + nbits) // 64
        self.parts.append(joined[:full].astype(">u8").tobytes())
        self.tail = joined[full]
        self.nbits += nbits

    def getvalue(self) -> bytes:
        rest = (self.nbits % 64 + 7) // 8
        return b"".join(self.parts) + int(self.tail).to_bytes(8, "big")[:rest]


def _codes(gaps: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """The packed codes of ``gaps``, their bit count, and each code's length."""
    n = bit_length(gaps) - 1
    ell = bit_length((n + 1).astype(_U64)) - 1
    lengths = 2 * ell + 1 + n
    un = n.astype(_U64)
    low = gaps & ((_U64(1) << un) - _U64(1))
    long = np.flatnonzero(lengths > 64)
    if long.size == 0:
        words, nbits = _pack(((un + _U64(1)) << un) | low, lengths)
        return words, nbits, lengths
    # Codes longer than 64 bits (gaps >= 2**53) go as two pieces: prefix, then low bits.
    pieces = np.ones(gaps.size, dtype=np.int64)
    pieces[long] = 2
    at = np.cumsum(pieces) - pieces
    values = ((un + _U64(1)) << un) | low
    plen = lengths.copy()
    values[long], plen[long] = un[long] + _U64(1), 2 * ell[long] + 1
    v = np.zeros(int(pieces.sum()), dtype=_U64)
    ln = np.zeros(v.size, dtype=np.int64)
    v[at], ln[at] = values, plen
    v[at[long] + 1], ln[at[long] + 1] = low[long], n[long]
    words, nbits = _pack(v, ln)
    return words, nbits, lengths


def encode(positions: np.ndarray, block: int = DEFAULT_BLOCK, *,
           use_native: bool = True) -> bytes:
    """Code strictly increasing flat positions into a self-describing stream.

    The C coder, where built, codes several times faster than numpy and without the GIL
    (``benchmarks/sparse_bench.py``). numpy codes
    ``PIECE`` positions at a time (a whole number of blocks), so memory stays bounded; the
    stream is the same as coding them all at once, and the same as the C coder's.
    """
    if block < 1 or block >= 1 << 32:
        raise ValueError("block must be in [1, 2**32)")
    p = _checked(positions)
    if native is not None and use_native:
        return native.encode(np.ascontiguousarray(p), block)
    count = p.size
    sync = np.empty((-(-count // block), 2), dtype="<u8")
    out = _BitWriter()
    for lo, hi in _pieces(count, block):
        words, nbits, lengths = _codes(_gaps(p, lo, hi))
        first = np.arange(0, hi - lo, block)
        starts = np.cumsum(lengths) - lengths
        sync[lo // block : lo // block + first.size, 0] = out.nbits + starts[first]
        sync[lo // block : lo // block + first.size, 1] = np.where(
            lo + first > 0, p[np.maximum(lo + first - 1, 0)] + 1, 0)
        out.append(words, nbits)
    return HEADER.pack(count, block, 0, out.nbits) + sync.tobytes() + out.getvalue()


class _BitReader:
    """Reads up to 57 bits at arbitrary bit offsets, many offsets at once."""

    def __init__(self, data: bytes) -> None:
        # Reads may run up to 16 bytes past the last code byte on damaged input; pad for that.
        padded = np.zeros(len(data) + 24, dtype=np.uint8)
        padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        # The 8 bytes starting at every byte, as native integers: one gather per read.
        self._windows = np.ndarray(shape=(len(data) + 16,), dtype=">u8", buffer=padded,
                                   strides=(1,)).astype(_U64)

    def window(self, offset: np.ndarray) -> np.ndarray:
        """64 bits whose top 57 at least start at ``offset``."""
        return self._windows[offset >> 3] << (offset & 7).astype(_U64)

    def read(self, offset: np.ndarray, width: np.ndarray) -> np.ndarray:
        w = np.asarray(width, dtype=_U64)
        return np.where(w > 0, self.window(offset) >> (_U64(64) - np.maximum(w, _U64(1))), _U64(0))


_LEADING_ZEROS_16 = (16 - bit_length(np.arange(1 << 16, dtype=_U64))).astype(_U64)


def _parse(stream: bytes | memoryview, limit: int | None) -> tuple[int, int, int, np.ndarray, memoryview]:
    """Header fields, sync table and code bytes of one stream, checked against each other."""
    buf = memoryview(stream).cast("B")
    if len(buf) < HEADER.size:
        raise FormatError("position stream is shorter than its header")
    count, block, _, nbits = HEADER.unpack_from(buf)
    if block < 1:
        raise FormatError("position stream has block size 0")
    if limit is not None and count > limit:
        raise FormatError(f"position stream claims {count} positions in a tensor of {limit}")
    nsync = -(-count // block)
    code_start = HEADER.size + 16 * nsync
    if len(buf) != code_start + (nbits + 7) // 8 or nbits < count:
        raise FormatError("position stream length does not match its header")
    sync = np.frombuffer(buf[HEADER.size : code_start], dtype="<u8").reshape(nsync, 2)
    if nsync and ((sync[:, 0] >= nbits).any() or (np.diff(sync[:, 0].astype(np.int64)) <= 0).any()):
        raise FormatError("position stream has sync points out of order")
    return count, block, nbits, sync, buf[code_start:]


def decode(stream: bytes | memoryview, *, limit: int | None = None,
           use_native: bool = True) -> np.ndarray:
    """Decode one stream into int64 positions; any inconsistency raises ``FormatError``.

    ``limit`` (the number of elements of the tensor) bounds every position, so a hostile stream
    cannot make the caller allocate or index outside the tensor.
    """
    return decode_many([stream], [limit], use_native=use_native)[0]


def decode_many(streams: list[bytes | memoryview], limits: list[int | None], *,
                use_native: bool = True) -> list[np.ndarray]:
    """Decode several streams: each in one pass of the C decoder where it is built, or all in
    one lockstep pass of numpy over all their blocks (one Python iteration per code *within a
    block*, vectorised over every block of every stream: a step's sparse tensors cost one
    pass, not one pass each)."""
    parsed = [_parse(s, lim) for s, lim in zip(streams, limits)]
    out = [_decode_native(p) for p in parsed] if native is not None and use_native \
        else _decode_lockstep(parsed)
    for p, limit in zip(out, limits):
        if limit is not None and p.size and p[-1] >= limit:
            raise FormatError(f"position stream points past the end of a tensor of {limit} "
                              "elements")
    return out


def _decode_lockstep(parsed: list[tuple[int, int, int, np.ndarray, memoryview]]
                     ) -> list[np.ndarray]:
    """``decode_many`` with numpy, every block of every stream in lockstep."""
    live = [i for i, p in enumerate(parsed) if p[0]]
    out = [np.zeros(0, dtype=np.int64) for _ in parsed]
    if not live:
        return out
    # Lay every stream's code bytes end to end; lanes are blocks, with global bit offsets.
    starts, offsets, ends, bases, sizes, owner = [], [], [], [], [], []
    at = 0
    for i in live:
        count, block, nbits, sync, codes = parsed[i]
        nsync = sync.shape[0]
        local = sync[:, 0].astype(np.int64)
        starts.append(at)
        offsets.append(local + 8 * at)
        ends.append(np.append(local[1:], nbits) + 8 * at)
        bases.append(sync[:, 1])
        sizes.append(np.minimum(block, count - np.arange(nsync) * block))
        owner.append(np.full(nsync, i))
        at += len(codes)
    reader = _BitReader(b"".join(bytes(parsed[i][4]) for i in live))
    offsets, ends = np.concatenate(offsets), np.concatenate(ends)
    bases, sizes = np.concatenate(bases), np.concatenate(sizes)
    owner = np.concatenate(owner)
    # Lanes longest first (stable: a stream's blocks keep their order, its short last block
    # comes after its full ones), so that the lanes still running at code i are a prefix:
    # every step below works on slices, with no gather or scatter by lane.
    order = np.argsort(-sizes, kind="stable")
    offsets, ends, bases, sizes, owner = (a[order] for a in (offsets, ends, bases, sizes, owner))
    width = int(sizes[0])
    running = sizes.size - np.searchsorted(sizes[::-1], np.arange(width), side="right")
    gaps = np.zeros((sizes.size, width), dtype=_U64)
    pos = offsets.copy()
    for i in range(width):
        at_bits = pos[: running[i]]  # a view: advanced in place at the end of the step
        if (at_bits >= ends[: running[i]]).any():
            raise FormatError("position stream ends inside a code")
        # One 64-bit window holds the whole code unless it is longer than 57 bits (rare).
        # All in uint64, without a conversion or a select: ``n + 1`` is read as ``ell + 1``
        # bits (it has a leading one), and a code's ``n`` low bits are shifted out in two
        # steps, so that n = 0 shifts everything out instead of shifting by 64.
        w = reader.window(at_bits)
        ell = _LEADING_ZEROS_16[w >> _U64(48)]
        if (ell > 6).any():
            raise FormatError("position stream has an invalid Elias-delta prefix")
        n = ((w << ell) >> (_U64(63) - ell)) - _U64(1)
        if (n > 56).any():
            raise FormatError("position stream codes a gap beyond 2**57")
        head = ell + ell + _U64(1)
        low = ((w << head) >> _U64(1)) >> (_U64(63) - n)
        long = np.flatnonzero(head + n > 57)
        if long.size:
            low[long] = reader.read(at_bits[long] + head[long].view(np.int64), n[long])
        gaps[: running[i], i] = (_U64(1) << n) | low
        at_bits += (head + n).view(np.int64)
    if (pos != ends).any():
        raise FormatError("position stream blocks do not end at the next sync point")

    # In place: a large stream's positions are held about twice, not five times.
    total = np.cumsum(gaps, axis=1, dtype=_U64, out=gaps)
    total += bases[:, None] - _U64(1)
    del gaps
    valid = np.arange(width)[None, :] < sizes[:, None]
    for i in live:
        rows = owner == i
        mine = (total, valid) if len(live) == 1 else (total[rows], valid[rows])
        p = mine[0][mine[1]].view(np.int64)  # gaps stay below 2**57: no sign to lose
        block = parsed[i][1]
        heads = np.arange(1, rows.sum()) * block - 1
        if (p < 0).any() or (p[1:] <= p[:-1]).any() or (bases[rows][1:] != p[heads] + 1).any():
            raise FormatError("position stream decodes to positions that are not increasing")
        out[i] = p
    return out


def _decode_native(parsed: tuple[int, int, int, np.ndarray, memoryview]) -> np.ndarray:
    count, block, nbits, sync, codes = parsed
    out = np.empty(count, dtype=np.int64)
    if count:
        try:
            native.decode(codes, nbits, sync, count, block, out)
        except ValueError as exc:
            raise FormatError(str(exc)) from None
    return out
