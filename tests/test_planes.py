"""The byte-plane and residual loops in C (``tpde.codec._planes``) against numpy's, which stays the
path wherever the extension is not built or the words do not suit it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tpde import FormatError
from tpde.codec import decoder, frames, transform, unframe

WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PATHS = pytest.mark.parametrize("c", [True, False], ids=["c", "numpy"])


def test_the_c_planes_are_built() -> None:
    # Built by `pip install -e .` wherever a C compiler is found; without it every test here
    # would silently run numpy twice.
    assert frames.native is not None, \
        "tpde.codec._planes was not built: install a C compiler, reinstall"


def words_of(width: int, n: int, seed: int, spread: int = 100) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-spread, spread, (n,), generator=g, dtype=torch.int64).to(WORDS[width])


@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 5000), seed=st.integers(0, 2**31),
       how=st.sampled_from([("xor", "raw"), ("xor", "float"), ("sub", "float"), ("sub", "int")]),
       spread=st.sampled_from([3, 100, 2**62]))
def test_residuals_in_c_are_numpy_s_and_invert(width: int, n: int, seed: int,
                                               how: tuple[str, str], spread: int) -> None:
    """Of words of any sign and any size of difference, with wrap-around; and undone."""
    ref, new = words_of(width, n, seed, spread), words_of(width, n, seed + 1, spread)
    r = transform.residual(new, ref, *how)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frames, "native", None)
        expected = transform.residual(new, ref, *how)
        by_numpy = transform.apply_residual(ref, expected, *how)
        undone_by_numpy = transform.apply_residual(new, expected, *how, undo=True)
    assert torch.equal(r, expected)
    assert torch.equal(transform.apply_residual(ref, r, *how), new)
    assert torch.equal(by_numpy, new)
    # and back: the reference from the words the residual was taken of
    assert torch.equal(transform.apply_residual(new, r, *how, undo=True), ref)
    assert torch.equal(undone_by_numpy, ref)


@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 70_000), seed=st.integers(0, 2**31),
       density=st.sampled_from([0.0, 0.001, 0.3, 1.0]))
def test_changed_words_are_numpy_s(width: int, n: int, seed: int, density: float) -> None:
    """Counted in blocks of the counter's largest value (255 words for bytes), and found."""
    rng = np.random.default_rng(seed)
    ref = words_of(width, n, seed).numpy()
    new = ref.copy()
    at = np.flatnonzero(rng.random(n) < density)
    new[at] += 1
    rows = [w.view(np.uint8).reshape(n, width) for w in (new, ref)]
    assert frames.native.changed(*rows, width) == len(at)
    out = np.empty(len(at), dtype=np.int64)
    assert frames.native.changed(*rows, width, out) == len(at)
    assert np.array_equal(out, at)
    # With planes, the changed words' XOR residual in byte planes, as numpy makes them.
    planes = np.full(len(at) * width, 0xAA, dtype=np.uint8)
    out[:] = -1
    assert frames.native.changed(*rows, width, out, planes) == len(at)
    assert np.array_equal(out, at)
    xor = (new[at] ^ ref[at]).view(np.uint8).reshape(len(at), width)
    assert np.array_equal(planes.reshape(width, len(at)), xor.T)
    if len(at):
        with pytest.raises(ValueError):  # no room for the last one: refused, not overrun
            frames.native.changed(*rows, width, np.empty(len(at) - 1, dtype=np.int64))
        with pytest.raises(ValueError):
            frames.native.changed(*rows, width, out, planes[:-1])


@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 5000), seed=st.integers(0, 2**31))
def test_the_words_own_planes_in_c_are_numpy_s(width: int, n: int, seed: int) -> None:
    """Mode 0 of ``diff``: the words themselves (a keyframe coded in a batch), as their byte
    planes with a plane size, as they are without; the reference is not read."""
    rows = np.random.default_rng(seed).integers(0, 256, size=(n, width), dtype=np.uint8)
    other = np.full_like(rows, 7)
    planes = np.full(n * width + 3, 0xAA, dtype=np.uint8)  # room past the planes, untouched
    frames.native.diff(rows, other, width, planes, 0, n)
    assert np.array_equal(planes[: n * width].reshape(width, n), rows.T)
    assert (planes[n * width :] == 0xAA).all()
    words = np.empty_like(rows)
    frames.native.diff(rows, other, width, words, 0)
    assert np.array_equal(words, rows)


@PATHS
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 3000), seed=st.integers(0, 2**31),
       data=st.data())
def test_plane_gathers_and_scatters(c: bool, width: int, n: int, seed: int, data) -> None:
    rows = np.random.default_rng(seed).integers(0, 256, size=(n, width), dtype=np.uint8)
    k = data.draw(st.integers(0, width - 1))
    first = data.draw(st.integers(0, n - 1))
    m = data.draw(st.integers(0, n - first))
    with pytest.MonkeyPatch.context() as mp:
        if not c:
            mp.setattr(frames, "native", None)
        out = np.empty(m, dtype=np.uint8)
        frames.take(rows, k, first, out)
        assert np.array_equal(out, rows[first : first + m, k])
        planes = np.ascontiguousarray(rows.T)
        back = np.empty_like(rows)
        unframe.join(planes, back)
        assert np.array_equal(back, rows)
        # Words that do not start at a multiple of their width take numpy's path.
        odd = np.empty(n * width + 1, dtype=np.uint8)[1:].reshape(n, width)
        unframe.join(planes, odd)
        assert np.array_equal(odd, rows)



@PATHS
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 3000), seed=st.integers(0, 2**31),
       density=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
def test_a_sparse_residual_lands_on_its_positions(c: bool, width: int, n: int, seed: int,
                                                  density: float) -> None:
    """``apply_at`` (a sparse delta's values put back) against an XOR written out here."""
    rng = np.random.default_rng(seed)
    ref = words_of(width, n, seed, 2**62)
    at = np.flatnonzero(rng.random(n) < density)
    r = words_of(width, len(at), seed + 1, 2**62)
    expected = ref.numpy().copy()
    for j, i in enumerate(at):
        expected[i] = expected[i] ^ r.numpy()[j]
    with pytest.MonkeyPatch.context() as mp:
        if not c:
            mp.setattr(frames, "native", None)
        got = decoder.CPU().sparse(ref.clone(), torch.from_numpy(at), r)
    assert np.array_equal(got.numpy(), expected)


@PATHS
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 3000), seed=st.integers(0, 2**31))
def test_words_are_put_together_from_their_planes(c: bool, width: int, n: int,
                                                  seed: int) -> None:
    """``unshuffle`` (a section decompressed whole) against the planes transposed here."""
    rows = np.random.default_rng(seed).integers(0, 256, size=(n, width), dtype=np.uint8)
    planes = torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1))
    with pytest.MonkeyPatch.context() as mp:
        if not c:
            mp.setattr(frames, "native", None)
        words = transform.unshuffle(planes, WORDS[width])
    assert words.dtype == WORDS[width]
    assert np.array_equal(words.view(torch.uint8).numpy().reshape(n, width), rows)

def test_the_c_loops_refuse_out_of_range_planes_and_words() -> None:
    rows = np.zeros((10, 4), dtype=np.uint8)
    with pytest.raises(ValueError):
        frames.native.take(rows, 4, 0, 8, np.empty(3, dtype=np.uint8))  # words 8..10 of 10
    with pytest.raises(ValueError):
        frames.native.take(rows, 4, 4, 0, np.empty(3, dtype=np.uint8))  # no fifth plane
    with pytest.raises(ValueError):
        frames.native.join([bytes(10)] * 3, 4, rows, 0)  # a plane's part missing
    with pytest.raises(ValueError):
        frames.native.join([bytes(10)] * 3 + [bytes(9)], 4, rows, 0)  # one byte short
    with pytest.raises(ValueError):
        frames.native.apply(np.zeros(40, dtype=np.uint8), 4, rows, 0)  # no residual to apply
    with pytest.raises(ValueError):
        frames.native.diff(np.zeros(40, dtype=np.uint8), rows, 4, rows, 7)  # no such residual
    with pytest.raises(ValueError):  # a difference undone is applied, never taken
        frames.native.diff(np.zeros(40, dtype=np.uint8), rows, 4, rows, 4)
    with pytest.raises(ValueError):
        frames.native.apply(np.zeros(40, dtype=np.uint8), 4, rows, 6)  # no such residual
    with pytest.raises(ValueError):
        frames.native.join([bytes(10)] * 4, 4, rows, 6)
    with pytest.raises(ValueError):
        frames.native.join(np.zeros(40, dtype=np.uint8), 3, np.zeros(40, dtype=np.uint8), 0)
    planes = np.empty(40, dtype=np.uint8)
    with pytest.raises(ValueError):
        frames.native.diff(rows, rows, 4, planes, -1, 10)  # no such mode
    with pytest.raises(ValueError):
        frames.native.diff(rows, rows[:9], 4, planes, 1, 10)  # a reference of other words
    with pytest.raises(ValueError):
        frames.native.diff(rows, rows, 4, planes, 2, 9)  # planes of 9 bytes for 10 words
    with pytest.raises(ValueError):
        frames.native.diff(rows, rows, 4, planes, 2, 11)  # 4 planes of 11 bytes in 40
    residual = np.arange(12, dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):  # word 10 of 10, and nothing applied
        frames.native.apply_at(residual, 4, rows, np.array([0, 1, 10], dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        frames.native.apply_at(residual, 4, rows, np.array([0, -1, 2], dtype=np.int64))
    assert not rows.any()
    with pytest.raises(ValueError, match="each position"):
        frames.native.apply_at(residual[:8], 4, rows, np.array([0, 1, 2], dtype=np.int64))


@PATHS
def test_an_unknown_residual_is_a_format_error(c: bool, monkeypatch) -> None:
    if not c:
        monkeypatch.setattr(frames, "native", None)
    ref = words_of(4, 10, 0)
    with pytest.raises(FormatError):
        transform.apply_residual(ref, ref, "sub", "raw")
    with pytest.raises(FormatError):
        transform.apply_residual(ref, ref, "add", "int")
