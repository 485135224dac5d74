"""Elias-delta position stream: the spec's bit patterns, round trips, hostile streams, with
both coders (C and numpy), which must write the same streams and read them alike."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpde import FormatError
from tpde.codec import elias

CODERS = pytest.mark.parametrize("use_native", [True, False], ids=["c", "numpy"])


def test_the_c_coder_is_built() -> None:
    # Built by `pip install -e .` wherever a C compiler is found; without it every test below
    # would silently run numpy twice.
    assert elias.native is not None, \
        "tpde.codec._elias was not built: install a C compiler, reinstall"


@given(st.lists(st.integers(1, 2**56 // 512), max_size=600), st.integers(1, 70))
def test_the_c_and_numpy_coders_write_the_same_stream(gaps: list[int], block: int) -> None:
    p = np.cumsum(np.array(gaps, dtype=np.int64)) - 1
    c = elias.encode(p, block)
    assert c == elias.encode(p, block, use_native=False)
    for use_native in (True, False):
        assert np.array_equal(elias.decode(c, limit=2**56, use_native=use_native), p)



@given(st.sampled_from([2, 8, 60, 130, 300, 5000]), st.data())
def test_dense_positions_read_from_the_short_code_table(widest: int, data: st.DataObject) -> None:
    # Gaps up to `widest`, over four blocks of 256 and more: the C decoder reads codes of gaps
    # under 128 from a table where a group of blocks averages at most 10 bits a code
    # (sparse_bench.py times it), every code bit by bit elsewhere; the positions are numpy's.
    gaps = data.draw(st.lists(st.integers(1, widest), min_size=1024, max_size=2100))
    p = np.cumsum(np.array(gaps, dtype=np.int64)) - 1
    stream = elias.encode(p)
    assert np.array_equal(elias.decode(stream, limit=2**56), p)
    assert np.array_equal(elias.decode(stream, limit=2**56, use_native=False), p)

@pytest.mark.parametrize("block", [1, 3, 256])
def test_the_c_coder_writes_the_longest_codes_as_numpy_does(block: int) -> None:
    # Codes of more than 56 bits (gaps from 2**47 on) are written in two parts, after codes of
    # every other length have left from 0 to 7 bits waiting.
    gaps = [1, 2, 3, 2**47, 5, 2**55 - 2**48, 1, 7, 2**50, 1, 2**54 - 2**51 - 300]
    p = np.cumsum(np.array(gaps, dtype=np.int64)) - 1
    assert p[-1] < 2**56
    stream = elias.encode(p, block)
    assert stream == elias.encode(p, block, use_native=False)
    assert np.array_equal(elias.decode(stream, limit=2**56), p)


def code_bits(positions: list[int], block: int = 256) -> str:
    stream = elias.encode(np.array(positions, dtype=np.int64), block)
    count, _, _, nbits = elias.HEADER.unpack_from(stream)
    body = stream[elias.HEADER.size + 16 * -(-count // block):]
    return "".join(f"{b:08b}" for b in body)[:nbits]


@pytest.mark.parametrize("gap, bits", [
    (1, "1"), (2, "0100"), (3, "0101"), (4, "01100"), (7, "01111"),
    (8, "00100000"), (15, "00100111"), (16, "001010000"), (17, "001010001"),
    (100, "00111100100"), (2**16, "0000" + "10001" + "0" * 16),
])
def test_known_codes(gap: int, bits: str) -> None:
    # First gap is position + 1, so position gap - 1 alone codes exactly `gap`.
    assert code_bits([gap - 1]) == bits


def test_gaps_between_positions_and_msb_first_packing() -> None:
    # positions 0, 1, 3, 10 -> gaps 1, 1, 2, 7 -> 1 1 0100 01111
    assert code_bits([0, 1, 3, 10]) == "11" + "0100" + "01111"
    stream = elias.encode(np.array([0, 1, 3, 10]))
    assert stream[-2:] == bytes([0b11010001, 0b11100000])


def test_sync_points_record_bit_offset_and_base() -> None:
    stream = elias.encode(np.array([0, 1, 3, 10, 11]), block=2)
    sync = np.frombuffer(stream[elias.HEADER.size:elias.HEADER.size + 48], "<u8").reshape(3, 2)
    # block 1 starts after codes "1","1" (2 bits) with base 1 + 1; block 2 after 2 + 4 + 5 bits.
    assert sync.tolist() == [[0, 0], [2, 2], [11, 11]]


@CODERS
@given(st.sets(st.integers(0, 2**56 - 1), max_size=300), st.integers(1, 64))
def test_round_trip(use_native: bool, positions: set[int], block: int) -> None:
    p = np.array(sorted(positions), dtype=np.int64)
    out = elias.decode(elias.encode(p, block, use_native=use_native), limit=2**56,
                       use_native=use_native)
    assert np.array_equal(out, p)


@CODERS
@given(st.integers(1, 5000), st.floats(0.0001, 1.0), st.integers(0, 2**31))
def test_round_trip_dense_ranges(use_native: bool, n: int, density: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(n / density) + 1
    p = np.sort(rng.choice(size, size=min(n, size), replace=False))
    stream = elias.encode(p, use_native=use_native)
    assert np.array_equal(elias.decode(stream, limit=size, use_native=use_native), p)
    assert elias.encoded_bits(p, use_native=use_native) == elias.HEADER.unpack_from(stream)[3]


@given(st.sets(st.integers(0, 2**56 - 1), max_size=400), st.integers(1, 8),
       st.sampled_from([1, 8, 24, 64]))
def test_coding_in_pieces_gives_the_same_stream(positions: set[int], block: int,
                                                piece: int) -> None:
    """Pieces of a few positions (codes stitched at odd bit offsets) equal one piece."""
    p = np.array(sorted(positions), dtype=np.int64)
    whole = elias.encode(p, block)
    saved = elias.PIECE
    try:
        elias.PIECE = piece
        assert elias.encode(p, block, use_native=False) == whole
        assert elias.encoded_bits(p, use_native=False) == elias.HEADER.unpack_from(whole)[3]
    finally:
        elias.PIECE = saved


@CODERS
@pytest.mark.parametrize("bad", [[1, 1], [3, 2], [-1], [2**56]])
def test_encoder_rejects_bad_positions(use_native: bool, bad: list[int]) -> None:
    with pytest.raises(ValueError):
        elias.encode(np.array(bad, dtype=np.int64), use_native=use_native)
    with pytest.raises(ValueError):
        elias.encoded_bits(np.array(bad, dtype=np.int64), use_native=use_native)


@CODERS
@given(st.binary(max_size=200))
def test_hostile_bytes_raise_format_error_only(use_native: bool, data: bytes) -> None:
    try:
        elias.decode(data, limit=10**6, use_native=use_native)
    except FormatError:
        pass


@CODERS
@given(st.data())
def test_flipped_bits_never_escape_as_other_errors(use_native: bool, data: st.DataObject) -> None:
    p = np.array(sorted(data.draw(st.sets(st.integers(0, 10**6), min_size=1, max_size=200))))
    stream = bytearray(elias.encode(p, block=16))
    i = data.draw(st.integers(0, len(stream) - 1))
    stream[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        out = elias.decode(bytes(stream), limit=10**6 + 1, use_native=use_native)
    except FormatError:
        return
    assert (np.diff(out) > 0).all() and out.size <= 10**6 + 1


@CODERS
def test_claimed_count_beyond_limit_is_refused_before_allocation(use_native: bool) -> None:
    stream = elias.HEADER.pack(10**15, 256, 0, 10**15)
    with pytest.raises(FormatError, match="claims"):
        elias.decode(stream, limit=10**6, use_native=use_native)


@CODERS
def test_a_position_past_the_tensor_is_refused(use_native: bool) -> None:
    stream = elias.encode(np.array([2, 5]), use_native=use_native)
    assert elias.decode(stream, limit=6, use_native=use_native).tolist() == [2, 5]
    with pytest.raises(FormatError, match="past the end of a tensor of 5"):
        elias.decode(stream, limit=5, use_native=use_native)


@given(st.data())
def test_the_c_and_numpy_decoders_refuse_the_same_damage(data: st.DataObject) -> None:
    p = np.array(sorted(data.draw(st.sets(st.integers(0, 10**9), min_size=1, max_size=300))))
    stream = bytearray(elias.encode(p, block=data.draw(st.integers(1, 40))))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(stream) - 1))
        stream[i] ^= 1 << data.draw(st.integers(0, 7))
    got = []
    for use_native in (True, False):
        try:
            got.append(elias.decode(bytes(stream), limit=10**9 + 1,
                                    use_native=use_native).tolist())
        except FormatError:
            got.append("refused")
    assert got[0] == got[1]



def one_block_at_a_time(stream: bytes) -> list[int] | str:
    """The C decoder handed a single block per call, checked against the block before here:
    where it has no four blocks to read side by side."""
    count, block, nbits, sync, codes = elias._parse(stream, None)
    out, last = [], -1
    for b in range(sync.shape[0]):
        if b and int(sync[b, 1]) != last + 1:
            return "position stream decodes to positions that are not increasing"
        end = int(sync[b + 1, 0]) if b + 1 < sync.shape[0] else nbits
        part = np.empty(min(block, count - b * block), dtype=np.int64)
        try:
            elias.native.decode(codes, end, np.ascontiguousarray(sync[b : b + 1]), part.size,
                                block, part)
        except ValueError as exc:
            return str(exc)
        out += part.tolist()
        last = out[-1]
    return out


@given(st.data())
def test_blocks_decoded_side_by_side_read_as_one_at_a_time(data: st.DataObject) -> None:
    """The C decoder reads four blocks at a time and hands a group with anything wrong to its
    one-block decoder: the positions, or the first error in block order, are those of reading
    block after block, whichever of the four is damaged and however (a flipped bit, a long
    code among short ones, a block that does not start where the one before ended)."""
    gaps = data.draw(st.lists(st.one_of(st.integers(1, 9), st.integers(2**40, 2**48)),
                              min_size=8, max_size=400))
    p = np.cumsum(np.array(gaps, dtype=np.int64)) - 1
    stream = bytearray(elias.encode(p, block=data.draw(st.integers(1, 6))))
    for _ in range(data.draw(st.integers(0, 2))):
        i = data.draw(st.integers(elias.HEADER.size, len(stream) - 1))
        stream[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        elias._parse(bytes(stream), None)
    except FormatError:
        return  # refused before any block is read
    try:
        got: list[int] | str = elias.decode(bytes(stream), limit=2**56).tolist()
    except FormatError as exc:
        got = str(exc)
    assert got == one_block_at_a_time(bytes(stream))


def test_a_block_that_ends_before_the_next_sync_point_is_refused_side_by_side() -> None:
    # Five blocks of four gaps of 1 (one bit each); the first four are read side by side.
    # A spare 1 bit sits between blocks 2 and 3, and the sync points after it are moved on by
    # one: every block still decodes to the right positions, but block 2 no longer ends where
    # block 3 begins.
    assert elias.encode(np.arange(20), block=4)[elias.HEADER.size + 80:] == b"\xff\xff\xf0"
    sync = [(0, 0), (4, 4), (8, 8), (13, 12), (17, 16)]
    stream = elias.HEADER.pack(20, 4, 0, 21) + \
        b"".join(o.to_bytes(8, "little") + p.to_bytes(8, "little") for o, p in sync) + \
        b"\xff\xff\xf8"
    with pytest.raises(FormatError, match="do not end at the next sync point"):
        elias.decode(stream, limit=20)
