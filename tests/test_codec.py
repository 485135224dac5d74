"""Tensor codec and chunked zstd: bit-exact round trips over dtypes, shapes and densities."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from tpde import FormatError
from tpde.codec import decoder, dtypes, encoder, encoding, frames, transform, unframe, weigh
from tpde.runtime import frame_threads

from helpers import ZSTD, zstd_path

DTYPES = sorted(dtypes.BY_NAME)
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
SMALL = encoder.Settings(chunk=frames.MIN_CHUNK)


def random_tensor(dt: dtypes.DType, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * dt.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dt.name == "bool":
        raw &= 1
    return raw.view(dt.torch_dtype).reshape(shape)


def round_trip(new: torch.Tensor, ref: torch.Tensor | None, settings: encoder.Settings = SMALL,
               choice: encoder.Choice | None = None) -> encoder.Encoding:
    dt = dtypes.of_tensor(new)
    nw = transform.to_words(new, dt.word_dtype)
    rw = None if ref is None else transform.to_words(ref, dt.word_dtype)
    enc = encoder.encode(nw, rw, dt.kind, settings, choice=choice)
    sections = {k: unframe.decompress(list(s.frames), s.raw, s.chunk)
                for k, s in enc.sections.items()}
    out = decoder.decode(enc.codec, enc.residual, sections, rw, nw.numel(), dt.word_dtype, dt.kind)
    assert torch.equal(out, nw)
    return enc


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


def test_a_device_compressor_plugs_into_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU side plugs its compressor into the codec (``DEVICE_COMPRESSORS``); the codec
    hands it the byte planes of words on its device and compresses them on the host where it
    answers None. Here a compressor registered for the CPU stands in for a GPU's."""
    planes_seen: list[torch.Tensor] = []

    def on_device(planes: torch.Tensor, level: int | None, chunk: int) -> frames.Section | None:
        planes_seen.append(planes)
        if len(planes_seen) > 1:
            return None  # as a device whose library is missing
        return frames.compress(planes.numpy().tobytes(), level=level, chunk=chunk)

    monkeypatch.setitem(encoder.DEVICE_COMPRESSORS, "cpu", on_device)
    g = torch.Generator().manual_seed(0)
    words = transform.to_words(torch.randn(5000, generator=g), torch.int32)
    first = round_trip(words.view(torch.float32), None)
    assert len(planes_seen) == 1 and torch.equal(planes_seen[0], transform.shuffle(words))
    second = round_trip(words.view(torch.float32), None)
    assert len(planes_seen) == 2 and first.stored == second.stored


def test_the_gpu_side_registers_its_compressor() -> None:
    nvcomp = pytest.importorskip("tpde.kernels.nvcomp", reason="tpde.kernels.nvcomp does not "
                                 "import here")
    assert encoder.DEVICE_COMPRESSORS["cuda"] is nvcomp._on_device


@given(st.sampled_from(DTYPES), shapes, st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_delta_round_trip_every_dtype(name: str, shape: tuple, density: float, seed: int) -> None:
    dt = dtypes.BY_NAME[name]
    ref = random_tensor(dt, shape, seed)
    new = ref.reshape(-1).view(torch.uint8).clone().view(dt.torch_dtype).reshape(shape)
    flat = new.reshape(-1).view(torch.uint8)
    if flat.numel():
        g = torch.Generator().manual_seed(seed + 1)
        mask = torch.rand(flat.numel(), generator=g) < density
        flat[mask] ^= 1  # lowest bit of some bytes: valid for every dtype, bool included
    enc = round_trip(new, ref)
    if torch.equal(new.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
        assert enc.codec == "same" and enc.stored == 0


@given(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31))
def test_keyframe_round_trip_every_dtype(name: str, shape: tuple, seed: int) -> None:
    enc = round_trip(random_tensor(dtypes.BY_NAME[name], shape, seed), None)
    assert enc.codec == "key"


@pytest.mark.parametrize("how", ["xor", "sub"])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "float64", "int32", "uint8", "float8_e4m3fn"])
def test_residuals_invert(how: str, name: str) -> None:
    dt = dtypes.BY_NAME[name]
    a = transform.to_words(random_tensor(dt, (999,), 1), dt.word_dtype)
    b = transform.to_words(random_tensor(dt, (999,), 2), dt.word_dtype)
    r = transform.residual(a, b, how, dt.kind)
    assert torch.equal(transform.apply_residual(b, r, how, dt.kind), a)


def test_sub_residual_is_small_for_nearby_floats() -> None:
    a = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    b = torch.nextafter(a, torch.full_like(a, float("inf")))  # one ulp up, across sign changes
    r = transform.residual(transform.to_words(b, torch.int32), transform.to_words(a, torch.int32),
                           "sub", "float")
    assert int(r.abs().max()) <= 2


def test_codec_choice_follows_the_data() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g).bfloat16()
    few = w.clone()
    few.view(-1)[torch.randint(0, w.numel(), (500,), generator=g)] += 1
    assert round_trip(few, w).codec == "sparse"
    assert round_trip(w.clone(), w).codec == "same"
    assert round_trip(torch.randn(256, 1024, generator=g).bfloat16(), w).codec == "key"
    one_ulp_up = (w.view(torch.int16) + 1).view(torch.bfloat16)
    enc = round_trip(one_ulp_up, w)
    assert (enc.codec, enc.residual) == ("dense", "sub")


OPTIONS = [("dense", "xor"), ("dense", "sub"), ("sparse", "xor")]


@given(st.sampled_from(["float32", "bfloat16", "int32", "uint8"]), st.integers(1, 3000),
       st.floats(0.0, 1.0), st.sampled_from(OPTIONS), st.floats(0.01, 8.0), st.floats(0.01, 8.0),
       st.floats(0.0, 1.0), st.integers(0, encoder.REVALIDATE), st.integers(0, 2**31))
def test_any_carried_choice_round_trips(name: str, n: int, density: float, option: tuple,
                                        per_word: float, key_per_word: float, changed: float,
                                        uses: int, seed: int) -> None:
    """A carried choice, however stale or wrong, only changes how the words are coded."""
    dt = dtypes.BY_NAME[name]
    ref = random_tensor(dt, (n,), seed)
    new = ref.view(torch.uint8).clone()
    g = torch.Generator().manual_seed(seed + 1)
    new[torch.rand(new.numel(), generator=g) < density] ^= 1
    choice = encoder.Choice(option, per_word, key_per_word, changed, uses)
    enc = round_trip(new.view(dt.torch_dtype), ref, choice=choice)
    if enc.codec == "same":
        assert enc.choice == choice  # carried past an unchanged tensor
    elif enc.codec == "key":
        assert enc.choice is None  # chosen in full: a keyframe is no delta coding to carry
    elif enc.choice.uses:
        assert (enc.codec, enc.residual) == option and enc.choice.uses == uses + 1
    else:
        assert enc.choice.option == (enc.codec, enc.residual)


def same_encoding(a: encoder.Encoding, b: encoder.Encoding) -> bool:
    return (a.codec, a.residual, a.count, a.choice, a.sections.keys()) == \
        (b.codec, b.residual, b.count, b.choice, b.sections.keys()) and all(
            (s.raw, s.chunk, [bytes(f) for f in s.frames])
            == (b.sections[k].raw, b.sections[k].chunk, [bytes(f) for f in b.sections[k].frames])
            for k, s in a.sections.items())


job = st.tuples(st.sampled_from(["float32", "bfloat16", "int32", "uint8", "float64"]),
                st.integers(0, 70_000), st.sampled_from([0.0, 0.1, 0.6, 1.0]),
                st.sampled_from([None, "same shape", "other shape"]),
                st.one_of(st.none(), st.builds(encoder.Choice, st.sampled_from(OPTIONS),
                                               st.floats(0.01, 8.0), st.floats(0.01, 8.0),
                                               st.floats(0.0, 1.0),
                                               st.integers(0, encoder.REVALIDATE))))


@given(st.lists(job, min_size=1, max_size=6), st.sampled_from([SMALL, encoder.Settings()]),
       st.integers(0, 2**31))
def test_a_batch_codes_each_tensor_as_it_is_coded_alone(jobs: list, settings: encoder.Settings,
                                                        seed: int) -> None:
    """``encode_many`` codes keyframes, carried dense choices and small dense deltas weighed in
    full exactly as ``encode`` codes each alone (the same choice, the same frames), and leaves
    the others (None) to it."""
    made = []
    for k, (name, n, density, ref_of, choice) in enumerate(jobs):
        dt = dtypes.BY_NAME[name]
        ref = random_tensor(dt, (n,), seed + k)
        new = ref.view(torch.uint8).clone()
        g = torch.Generator().manual_seed(seed + k + 1)
        new[torch.rand(new.numel(), generator=g) < density] ^= 1
        nw = transform.to_words(new.view(dt.torch_dtype), dt.word_dtype)
        rw = None if ref_of is None else transform.to_words(ref, dt.word_dtype)
        if ref_of == "other shape":
            rw = rw[: n // 2]
        made.append((nw, rw, dt.kind, choice))
    for j, got in zip(made, encoder.encode_many(made, settings)):
        alone = encoder.encode(*j[:3], settings, choice=j[3])
        assert got is None or same_encoding(got, alone)
        if j[1] is None and 0 < j[0].numel() * j[0].element_size() <= encoder.MANY_BYTES:
            assert got is not None  # a keyframe is always coded in the batch


def test_a_batch_leaves_sparse_and_sampled_deltas_to_be_weighed_alone() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(40_000, generator=g).view(torch.int32)
    dense, sparse = ref ^ 1, ref.clone()
    sparse[:100] ^= 1
    mid = torch.randn(encoder.EXACT_CHOICE_BYTES // 4 + 1, generator=g).view(torch.int32)
    large = torch.randn(encoder.MANY_BYTES // 4 + 1, generator=g).view(torch.int32)
    due = encoder.Choice(("dense", "sub"), 1.0, 4.0, 1.0, encoder.REVALIDATE)
    got = encoder.encode_many([(sparse, ref, "float", None), (mid ^ 1, mid, "float", due),
                               (large ^ 1, large, "float", None), (large, None, "float", None),
                               (dense, ref, "float", due), (ref, ref, "float", due)])
    # weighed alone: a sparse coding, samples of a mid-size tensor, anything larger
    assert got[:4] == [None, None, None, None]
    assert got[4] is not None and got[4].choice is not None and got[4].choice.uses == 0
    assert got[5] is not None and got[5].codec == "same" and got[5].choice == due


def _drifting(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ref = torch.randn(100_000, generator=g)
    return ref * (1 + 1e-4 * torch.randn(ref.shape, generator=g)), ref


def test_a_carried_choice_is_coded_straight_away_until_it_is_due() -> None:
    first = round_trip(*_drifting(0), encoder.Settings())
    assert first.codec == "dense" and first.choice is not None and first.choice.uses == 0
    wrong = dataclasses.replace(first.choice, option=("dense", "xor" if first.residual == "sub"
                                                      else "sub"), per_word=8.0)
    enc = round_trip(*_drifting(1), encoder.Settings(), choice=wrong)
    assert enc.residual == wrong.option[1] and enc.choice.uses == 1  # followed, not re-chosen
    due = dataclasses.replace(wrong, uses=encoder.REVALIDATE)
    enc = round_trip(*_drifting(2), encoder.Settings(), choice=due)
    assert enc.residual == first.residual and enc.choice.uses == 0  # chosen in full again


def test_a_carried_choice_is_dropped_when_the_data_changes() -> None:
    new, ref = _drifting(0)
    chosen = round_trip(new, ref, encoder.Settings()).choice
    few = ref.clone()
    few[::1000] += 1  # 0.1% of the words change now, where all did
    enc = round_trip(few, ref, encoder.Settings(), choice=chosen)
    assert enc.codec == "sparse" and enc.choice.uses == 0
    # Stored bytes per word past DRIFT times those of the choice: chosen again.
    grown = dataclasses.replace(chosen, per_word=chosen.per_word / 2)
    enc = round_trip(new, ref, encoder.Settings(), choice=grown)
    assert enc.choice.uses == 0 and enc.choice.per_word > grown.per_word * encoder.DRIFT
    # Within the key margin of what a keyframe stored: chosen again (a keyframe wins here).
    unrelated = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    enc = round_trip(unrelated, ref, encoder.Settings(),
                     choice=dataclasses.replace(chosen, per_word=8.0, changed=1.0))
    assert enc.codec == "key" and enc.choice is None
    # A re-key (no reference) keeps the choice for the deltas after it.
    assert round_trip(new, None, encoder.Settings(), choice=chosen).choice == chosen


def test_a_sparse_choice_holds_while_fewer_words_change() -> None:
    # Fewer changed words make a sparse coding smaller beside a dense one: it is kept. More
    # than DRIFT times as many: chosen again.
    ref = torch.randn(100_000, generator=torch.Generator().manual_seed(5))

    def every(k: int) -> torch.Tensor:
        new = ref.clone()
        new[::k] += 1
        return new

    chosen = round_trip(every(100), ref, encoder.Settings()).choice
    assert chosen is not None and chosen.option == ("sparse", "xor")
    enc = round_trip(every(400), ref, encoder.Settings(), choice=chosen)
    assert enc.codec == "sparse" and enc.choice.uses == 1
    enc = round_trip(every(50), ref, encoder.Settings(), choice=chosen)
    assert enc.choice.uses == 0


def test_non_contiguous_and_channels_last_words_are_the_logical_elements() -> None:
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert torch.equal(transform.to_words(x, torch.int32),
                       transform.to_words(x.contiguous(), torch.int32))
    round_trip(x[:, 1:], None)


def test_large_tensor_uses_many_frames() -> None:
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(600_000, generator=g)
    new = ref + 1e-6 * torch.randn(600_000, generator=g)
    enc = round_trip(new, ref, encoder.Settings(chunk=64 * 1024))
    assert enc.codec == "dense" and len(enc.sections["values"].frames) > 30


def _large_pair(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(700_000, generator=g)
    if kind == "drift":  # Adam-like: every element moves a little
        return ref * (1 + 1e-4 * torch.randn(ref.shape, generator=g)), ref
    if kind == "sparse":  # an embedding: a few rows touched
        new = ref.clone()
        new[torch.randint(0, ref.numel(), (2000,), generator=g)] += 1
        return new, ref
    if kind == "ulp":  # bf16 weights nudged by one unit in the last place
        ref = ref.bfloat16()
        return (ref.view(torch.int16) + 1).view(torch.bfloat16), ref
    return torch.randn(ref.shape, generator=g), ref  # unrelated: a keyframe is best


@pytest.mark.parametrize("kind", ["drift", "sparse", "ulp", "random"])
def test_sampled_choice_agrees_with_the_exact_choice(kind: str, monkeypatch) -> None:
    """Above EXACT_CHOICE_BYTES the codec is picked from samples; picking it from full encodes
    of every option gives the answer to check it against."""
    new, ref = _large_pair(kind)
    assert new.numel() * new.element_size() > encoder.EXACT_CHOICE_BYTES
    sampled_calls = []
    sample_starts = weigh.sample_starts
    monkeypatch.setattr(weigh, "sample_starts",
                        lambda *a: sampled_calls.append(1) or sample_starts(*a))
    sampled = round_trip(new, ref, encoder.Settings())
    assert sampled_calls, "the choice was not made on samples"
    monkeypatch.setattr(weigh, "EXACT_CHOICE_BYTES", 1 << 62)
    exact = round_trip(new, ref, encoder.Settings())
    assert (sampled.codec, sampled.residual) == (exact.codec, exact.residual)
    assert sampled.stored == exact.stored


def test_a_close_call_between_sparse_and_dense_is_settled_by_coding_both() -> None:
    """35% of a bf16 projection's words changed: the sparse and dense codings come within 10%
    of each other, closer than samples and the Elias estimate of the positions can tell; the
    smaller coding in full is the one stored."""
    g = torch.Generator().manual_seed(1)
    ref = (torch.randn(384 * 1536, generator=g) * 0.05).bfloat16()
    at = torch.rand(ref.shape, generator=g) < 0.35
    new = ref.clone()
    new[at] = (new[at].float() * (1 + 0.01 * torch.randn(int(at.sum()), generator=g))).bfloat16()
    nw, rw = new.view(torch.int16), ref.view(torch.int16)
    s = encoder.Settings()
    where = torch.nonzero(nw != rw).reshape(-1)
    sparse = transform.residual(nw[where], rw[where], "xor", "float")
    full = {("sparse", "xor"): encoding.compress(sparse, s).stored
            + encoding.compress_positions(where, s).stored}
    for how in ("xor", "sub"):
        full[("dense", how)] = encoding.compress(transform.residual(nw, rw, how, "float"), s).stored
    dense = min(full[("dense", "xor")], full[("dense", "sub")])
    assert abs(full[("sparse", "xor")] - dense) < 0.1 * dense  # a close call
    enc = round_trip(new, ref, s)
    assert enc.stored == min(full.values())
    assert (enc.codec, enc.residual) == min(full, key=full.__getitem__)


def _whole_bytes(frames: list, raw: int, chunk: int) -> bytes:
    """A small record's stream, decompressed whole (``unframe.whole``)."""
    return b"".join(bytes(p) for p in unframe.whole(unframe.Frames(frames, raw, chunk)))


@ZSTD
@given(st.binary(max_size=300_000), st.sampled_from([4096, 65536]))
def test_frames_round_trip(z: bool, data: bytes, chunk: int) -> None:
    sec = frames.compress(data, chunk=chunk)
    assert len(sec.frames) == len(frames.raw_sizes(len(data), chunk))
    with pytest.MonkeyPatch.context() as mp:
        zstd_path(mp, z)
        assert unframe.decompress(list(sec.frames), sec.raw, sec.chunk).tobytes() == data
        assert _whole_bytes(list(sec.frames), sec.raw, sec.chunk) == data


@ZSTD
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "framed"])
def test_a_frame_that_is_not_exactly_its_chunk_is_refused(z: bool, whole: bool) -> None:
    """Whether its frames are decompressed whole (a small record's) or one at a time as the
    words are joined (a large one's), a frame followed by other bytes, one that declares
    another size than its chunk's, and one that declares none but holds less or more, are
    damage; a frame that declares no size and holds its chunk's is not (some GPU encoders
    leave the size out)."""
    plain = zstandard.ZstdCompressor()
    quiet = zstandard.ZstdCompressor(write_content_size=False)
    good = plain.compress(b"x" * 4096)

    def decode(frame: bytes) -> bytes:
        if whole:
            return _whole_bytes([frame], 4096, 4096)
        out = np.empty(4096, dtype=np.uint8)
        unframe.Framed([frame], 4096, 4096).read_into(0, out)
        return out.tobytes()

    with pytest.MonkeyPatch.context() as mp:
        zstd_path(mp, z)
        assert decode(good) == decode(quiet.compress(b"x" * 4096)) == b"x" * 4096
        for frame, why in ((good + b"y", ""), (good + good, ""),
                           (plain.compress(b"x" * 4095), "declares"),
                           (quiet.compress(b"x" * 4095), ""), (quiet.compress(b"x" * 4097), ""),
                           (good[:-3], "")):
            if whole and not z and frame.startswith(good) and frame != good:
                continue  # zstandard's one-call decompress stops at the frame's end
            with pytest.raises(FormatError, match=why):
                decode(frame)


@given(st.lists(st.tuples(st.binary(max_size=70_000), st.sampled_from([4096, 5000, 65536])),
                max_size=5), st.sampled_from([None, 1, 3]), st.sampled_from([1, 2]))
def test_streams_compressed_together_are_compressed_as_alone(streams: list, level, threads: int
                                                              ) -> None:
    arrays = [(np.frombuffer(d, dtype=np.uint8), c) for d, c in streams]
    together = frames.compress_many(arrays, level=level, threads=threads)
    for (data, chunk), sec in zip(arrays, together):
        alone = frames.compress(data, level=level, chunk=chunk)
        assert (sec.raw, sec.chunk, [bytes(f) for f in sec.frames]) == \
            (alone.raw, alone.chunk, [bytes(f) for f in alone.frames])
    with pytest.raises(ValueError):
        frames.compress_many([(np.zeros(10, dtype=np.uint8), frames.MIN_CHUNK - 1)])


@ZSTD
def test_frames_refuse_a_frame_declaring_a_huge_size(z: bool, monkeypatch) -> None:
    zstd_path(monkeypatch, z)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 1_000_000)
    with pytest.raises(FormatError, match="declares"):
        unframe.decompress([bomb], 4096, 4096)
    with pytest.raises(FormatError, match="declares"):
        unframe.whole(unframe.Frames([bomb], 4096, 4096))


@ZSTD
def test_frames_without_declared_size_are_bounded(z: bool, monkeypatch) -> None:
    zstd_path(monkeypatch, z)
    quiet = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 100_000)
    with pytest.raises(FormatError):
        unframe.decompress([quiet], 4096, 4096)
    with pytest.raises(FormatError):
        unframe.whole(unframe.Frames([quiet], 4096, 4096))
    ok = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 4096)
    assert unframe.decompress([ok], 4096, 4096).tobytes() == b"x" * 4096


@ZSTD
@given(st.binary(min_size=1, max_size=2000))
def test_garbage_frames_raise_format_error(z: bool, data: bytes) -> None:
    with pytest.MonkeyPatch.context() as mp:
        zstd_path(mp, z)
        with pytest.raises(FormatError):
            unframe.decompress([data], 4096, 4096)
        with pytest.raises(FormatError):
            unframe.whole(unframe.Frames([data], 4096, 4096))


def test_dtype_table_covers_every_dtype_torch_can_allocate() -> None:
    missing = []
    for name in dir(torch):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype) or d in QUANTIZED:
            continue  # quantized tensors are kept whole through torch.save (see test_tree)
        try:
            torch.empty(2, dtype=d).view(torch.uint8)
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # quantized and placeholder dtypes (int1..int7) hold no plain data
        if d not in dtypes.BY_TORCH:
            missing.append(name)
    assert not missing


def _bytes_of(planes: torch.Tensor) -> memoryview:
    return memoryview(planes.cpu().numpy()).cast("B")


PLANES = pytest.mark.parametrize("c", [True, False], ids=["c-planes", "numpy-planes"])


def planes_path(mp: pytest.MonkeyPatch, c: bool) -> None:
    """Byte planes and residuals through ``tpde.codec._planes`` or, without it, numpy."""
    if not c:
        mp.setattr(frames, "native", None)


@PLANES
@given(n=st.integers(1, 300_000), width=st.sampled_from([1, 2, 4, 8]),
       chunk=st.sampled_from([4096, 5000, 65536]), how=st.sampled_from(["key", "xor", "sub"]),
       kind=st.sampled_from(["int", "float"]), seed=st.integers(0, 2**31),
       threads=st.sampled_from([1, 2, 3]), whole=st.sampled_from([0, 1 << 30]),
       z=st.booleans())
def test_streamed_sections_decode_as_whole_ones(c: bool, n: int, width: int, chunk: int,
                                                how: str, kind: str, seed: int,
                                                threads: int, whole: int, z: bool) -> None:
    """A section read frame by frame as the decode reaches it (a mount at budget 0; a large
    one in runs of slices on the frame threads), or held
    in memory and applied in runs of slices on the frame threads (a restore) or decompressed
    whole a frame at a time (``unframe.WHOLE_BYTES``: a small record), rebuilds the same words
    as the whole decompressed section, with chunks that tile the byte planes and chunks that
    straddle them, one slice of words or many."""
    with pytest.MonkeyPatch.context() as outer:
        planes_path(outer, c)
        zstd_path(outer, z)
        outer.setattr(unframe, "WHOLE_BYTES", whole)
        word = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        g = torch.Generator().manual_seed(seed)
        # Words of any sign: a float's order-preserving image flips the negative ones.
        ref = torch.randint(-100, 100, (n,), generator=g, dtype=torch.int64).to(word)
        new = ref + torch.randint(-3, 4, (n,), generator=g, dtype=torch.int64).to(word)
        data = new if how == "key" else transform.residual(new, ref, how, kind)
        sec = frames.compress(_bytes_of(transform.shuffle(data)), level=1, chunk=chunk)
        codec_name = "key" if how == "key" else "dense"
        for spread_from in (unframe.FRAMED_SPREAD_BYTES, 1):  # 1: every frame thread takes part
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(unframe, "FRAMED_SPREAD_BYTES", spread_from)
                streamed = decoder.decode(
                    codec_name, None if how == "key" else how,
                    {"values": unframe.Framed(list(sec.frames), sec.raw, sec.chunk)},
                    None if how == "key" else ref.clone(), n, word, kind)
            assert torch.equal(streamed, new)
        if how != "key":
            with pytest.MonkeyPatch.context() as mp:  # every frame thread takes part, however small
                mp.setattr(frame_threads, "SPREAD_BYTES", 1)
                applied = transform.apply_streamed(
                    ref.clone(), unframe.Frames(list(sec.frames), sec.raw, sec.chunk), how, kind,
                    threads=threads)
                undone = transform.apply_streamed(  # a re-base's words from the step after
                    new.clone(), unframe.Frames(list(sec.frames), sec.raw, sec.chunk), how, kind,
                    threads=threads, undo=True)
            assert torch.equal(applied, new)
            assert torch.equal(undone, ref)
            whole = unframe.decompress(list(sec.frames), sec.raw, sec.chunk)
            assert torch.equal(decoder.decode("dense", how, {"values": whole}, new.clone(), n,
                                              word, kind, undo=True), ref)


class _Gate(list):
    """A stream's frames whose first read on the calling thread waits until another thread has
    read one: a stream shared out over the frame threads is then read by two of them for sure
    (a helper that started late would find nothing left)."""

    def __init__(self, frames: list[bytes]) -> None:
        super().__init__(frames)
        self.caller, self.readers = threading.get_ident(), set()
        self.other = threading.Event()

    def __getitem__(self, i: int) -> bytes:
        me = threading.get_ident()
        first = me not in self.readers
        self.readers.add(me)
        if me != self.caller:
            self.other.set()
        elif first:
            self.other.wait(timeout=10)
        return super().__getitem__(i)


@pytest.mark.parametrize("memory_first", [True, False], ids=["framed", "frames"])
@pytest.mark.parametrize("how", ["key", "xor"])
def test_a_stream_shared_out_over_the_frame_threads_decodes_whole(memory_first: bool,
                                                                  how: str) -> None:
    """A large section's slices shared out over two frame threads, the second taking the upper
    half of what the first has not reached (a mount at budget 0 reading frame by frame, or a
    restore with the frames in memory), rebuild the words a single thread does."""
    n, chunk = 5_000_000, 65536  # 20 MB of words: twice FRAMED_SPREAD_BYTES and more
    g = torch.Generator().manual_seed(3)
    ref = torch.randint(-(2**30), 2**30, (n,), generator=g, dtype=torch.int32)
    new = ref ^ torch.randint(0, 256, (n,), generator=g, dtype=torch.int32)
    data = new if how == "key" else transform.residual(new, ref, how, "int")
    sec = frames.compress(_bytes_of(transform.shuffle(data)), level=1, chunk=chunk)
    gate = _Gate(list(sec.frames))
    stream = unframe.Framed(gate, sec.raw, sec.chunk) if memory_first else \
        unframe.Frames(gate, sec.raw, sec.chunk)
    got = decoder.decode("key" if how == "key" else "dense", None if how == "key" else how,
                         {"values": stream}, None if how == "key" else ref.clone(), n,
                         torch.int32, "int")
    assert len(gate.readers) == 2, "the stream was not shared out"
    assert torch.equal(got, new)


@PLANES
@given(n=st.integers(1, 300_000), width=st.sampled_from([1, 2, 4, 8]),
       chunk=st.sampled_from([4096, 5000, 65536]), threads=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**31), whole=st.sampled_from([0, 1 << 30]))
def test_frames_go_straight_between_words_and_planes(c: bool, n: int, width: int, chunk: int,
                                                     threads: int, seed: int,
                                                     whole: int) -> None:
    """Compressing frames gathered from the words makes the frames of the shuffled stream, and
    decompressing them into the words rebuilds the words, with chunks that tile the byte
    planes and chunks that straddle them, on any number of frame threads or whole."""
    word = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-100, 100, (n,), generator=g, dtype=torch.int64).to(word)
    rows = words.view(torch.uint8).numpy().reshape(n, width)
    with pytest.MonkeyPatch.context() as mp:  # every frame thread takes part, however small
        mp.setattr(frame_threads, "SPREAD_BYTES", 1)
        mp.setattr(unframe, "WHOLE_BYTES", whole)
        planes_path(mp, c)
        sec = frames.compress_planes(rows, level=1, chunk=chunk, threads=threads)
        back = transform.stream_words(unframe.Frames(list(sec.frames), sec.raw, sec.chunk), word,
                                   threads=threads)
    assert sec == frames.compress(_bytes_of(transform.shuffle(words)), level=1, chunk=chunk)
    assert torch.equal(back, words)


@given(n=st.integers(1, 300_000), width=st.sampled_from([1, 2, 4, 8]),
       chunk=st.sampled_from([4096, 5000, 65536]), threads=st.sampled_from([1, 2, 3]),
       how=st.sampled_from([("xor", "raw"), ("sub", "float"), ("sub", "int")]),
       seed=st.integers(0, 2**31))
def test_a_residual_is_compressed_straight_from_the_words(n: int, width: int, chunk: int,
                                                          threads: int, how: tuple[str, str],
                                                          seed: int) -> None:
    """A residual's planes split from the words and their reference, slice by slice, make the
    frames of the residual's shuffled stream, with chunks that tile the planes and chunks that
    straddle them."""
    word = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    g = torch.Generator().manual_seed(seed)
    ref = torch.randint(-2**62, 2**62, (n,), generator=g, dtype=torch.int64).to(word)
    new = ref + torch.randint(-3, 3, (n,), generator=g, dtype=torch.int64).to(word)
    rows, against = (w.view(torch.uint8).numpy().reshape(n, width) for w in (new, ref))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frame_threads, "SPREAD_BYTES", 1)
        sec = frames.compress_planes(rows, against=against, mode=transform.residual_mode(*how),
                                     level=1, chunk=chunk, threads=threads)
    expected = transform.shuffle(transform.residual(new, ref, *how))
    assert sec == frames.compress(_bytes_of(expected), level=1, chunk=chunk)


@PLANES
@ZSTD
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("how", ["key", "xor", "sub"])
def test_a_small_record_whose_frames_are_its_planes_decodes_from_them(c: bool, z: bool,
                                                                       width: int,
                                                                       how: str) -> None:
    """A small record's chunk is its plane, so its frames are its byte planes and are joined
    where they were decompressed; a frame of another size than its plane is refused."""
    word = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    n = 5000
    g = torch.Generator().manual_seed(width)
    ref = torch.randint(-100, 100, (n,), generator=g, dtype=torch.int64).to(word)
    new = ref + torch.randint(-3, 4, (n,), generator=g, dtype=torch.int64).to(word)
    data = new if how == "key" else transform.residual(new, ref, how, "float")
    sec = frames.compress(_bytes_of(transform.shuffle(data)), level=1, chunk=n)
    assert len(sec.frames) == width
    with pytest.MonkeyPatch.context() as mp:
        planes_path(mp, c)
        zstd_path(mp, z)
        held = unframe.Frames(list(sec.frames), sec.raw, sec.chunk)
        if how == "key":
            back = transform.stream_words(held, word)
        else:
            back = transform.apply_streamed(ref.clone(), held, how, "float")
        assert torch.equal(back, new)
        short = frames.compress(b"\0" * (n - 1), level=1, chunk=n).frames[0]
        with pytest.raises(FormatError, match="declares"):
            transform.stream_words(unframe.Frames([short, *sec.frames[1:]], sec.raw, sec.chunk),
                                   word)


def test_a_residual_needs_words_that_the_c_loops_take() -> None:
    rows = np.zeros((10, 4), dtype=np.uint8)
    with pytest.raises(ValueError):
        frames.compress_planes(rows, against=np.zeros((9, 4), dtype=np.uint8), mode=1)
    odd = np.zeros(41, dtype=np.uint8)[1:].reshape(10, 4)  # not aligned to its words
    with pytest.raises(ValueError):
        frames.compress_planes(rows, against=odd, mode=1)


def test_a_pool_held_across_a_stop_finishes_what_it_had_and_starts_again() -> None:
    """``stop`` ends the threads once their work is done; whoever holds the pool (a restore
    under way while a plugin tears down) submits on, to new threads."""
    pool = frame_threads.pool("stoptest", 2)
    gate = threading.Event()
    first = [pool.submit(gate.wait, 30) for _ in range(3)]
    stopping = threading.Thread(target=frame_threads.stop)
    stopping.start()
    assert pool.map(lambda x: x * 2, [1, 2, 3]) is not None  # a new executor, not refused
    gate.set()
    stopping.join(timeout=30)
    assert not stopping.is_alive()
    assert [f.result() for f in first] == [True] * 3
    assert list(pool.map(lambda x: x * 2, [1, 2, 3])) == [2, 4, 6]
    frame_threads.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("tpde-stoptest")]


def test_a_spread_does_its_parts_itself_while_the_frame_threads_are_busy(monkeypatch) -> None:
    """Two encode tasks spread frames at once; a part the frame threads have not started is
    done by the caller, never waited for (here the threads are held until the end)."""
    monkeypatch.setattr(frame_threads, "SPREAD_BYTES", 1)
    pool = frame_threads._frame_pool()
    gate = threading.Event()
    held = [pool.submit(gate.wait) for _ in range(pool.size)]
    rows = np.random.default_rng(0).integers(0, 8, (1 << 19, 4), dtype=np.uint8)
    done: list[frames.Section] = []
    try:
        worker = threading.Thread(target=lambda: done.append(
            frames.compress_planes(rows, chunk=1 << 16, threads=2)))
        worker.start()
        worker.join(timeout=30)
        assert done, "the spread waited for busy frame threads"
    finally:
        gate.set()
        for f in held:
            f.result()
    assert done[0] == frames.compress_planes(rows, chunk=1 << 16, threads=1)


@given(count=st.integers(0, 200), threads=st.integers(1, 4), slow=st.integers(0, 200))
def test_a_spread_does_every_index_once_in_runs_of_consecutive_ones(count: int, threads: int,
                                                                     slow: int) -> None:
    """However the threads share and steal the indices, each is done once, and each call of
    ``work`` gets consecutive ones in order (slices of words share frames with their
    neighbours). Index ``slow`` takes a while, so that the others steal around it."""
    calls: list[list[int]] = []
    lock = threading.Lock()

    def work(mine) -> None:
        got = []
        for i in mine:
            got.append(i)
            if i == slow:
                time.sleep(0.01)
        with lock:
            calls.append(got)

    frame_threads.spread(count, threads, work, count * frame_threads.SPREAD_BYTES)
    assert sorted(i for c in calls for i in c) == list(range(count))
    assert all(c == list(range(c[0], c[0] + len(c))) for c in calls if c)


def test_a_helper_that_starts_late_takes_half_of_what_is_left() -> None:
    """The frame threads are busy with another caller's work until the caller has done 10 of
    100 indices; the helper then takes the upper half of the 89 the caller has not started."""
    pool = frame_threads._frame_pool()
    gate, helped = threading.Event(), threading.Event()
    held = [pool.submit(gate.wait) for _ in range(pool.size)]
    mine = threading.get_ident()
    calls: list[tuple[bool, list[int]]] = []

    def work(indices) -> None:
        got = []
        for i in indices:
            got.append(i)
            if threading.get_ident() != mine:
                helped.set()
            elif i == 10:
                gate.set()  # the pool's threads are free from here on
                assert helped.wait(timeout=30), "no frame thread took a share"
        calls.append((threading.get_ident() == mine, got))

    try:
        frame_threads.spread(100, 2, work, 100 * frame_threads.SPREAD_BYTES)
    finally:
        gate.set()
        for f in held:
            f.result()
    stolen = [got for caller, got in calls if not caller]
    assert stolen[0] == list(range(100 - 89 // 2, 100))  # then, the caller held, the rest
    assert sorted(i for _, got in calls for i in got) == list(range(100))


def test_one_compressor_per_window_makes_the_frames_of_a_fresh_one_for_each_chunk() -> None:
    """Each tensor size gets its own chunk (``encoder.plane_chunk``); a thread keeps one
    compressor per window those chunks need, and its frames are those of a compressor made
    for the chunk alone."""
    rng = np.random.default_rng(1)
    chunks = [encoder.plane_chunk(n, frames.DEFAULT_CHUNK) for n in range(70_000, 700_000, 9_001)]
    assert len(set(chunks)) > 20
    data = rng.integers(0, 4, 1 << 20, dtype=np.uint8).tobytes()
    held: list[set] = []

    def thread() -> None:  # a thread of its own: none of its compressors made before
        for chunk in chunks:
            fresh = frames.compressor(None, chunk).compress(data[:chunk])
            assert frames._compressor(None, chunk).compress(data[:chunk]) == fresh
        held.append(set(frames._local.compressors))

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    assert held == [{(None, max(10, (c - 1).bit_length())) for c in chunks}]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or frame_threads.usable_cpus() < 2,
                    reason="needs two CPUs to hold a process to one")
def test_the_frame_threads_count_the_cpus_a_process_may_run_on_at_each_spread() -> None:
    """The frame threads count the CPUs a process may run on, not the machine's, and count them
    again at each spread: held to one CPU, a spread that would use every thread does all its
    work on the calling thread alone; let onto all of them afterwards (a launcher binding it
    late, a benchmark's one-thread phase), it spreads over them, and its decode threads number
    them, not the count it had first."""
    script = """
import os, threading, time
everywhere = os.sched_getaffinity(0)
from tpde.runtime import frame_threads
from tpde.chain import decode
def spread():
    threads, done = set(), []
    def work(part):
        for i in part:
            threads.add(threading.get_ident())
            done.append(i)
            time.sleep(0.005)
    frame_threads.spread(64, None, work, raw=1 << 30)
    return len(threads), decode.pools()[0].size, sorted(done) == list(range(64))
os.sched_setaffinity(0, {min(everywhere)})
print(*spread())
os.sched_setaffinity(0, everywhere)
print(*spread())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    held, let = out.stdout.splitlines()
    assert held.split() == ["1", "1", "True"], out
    threads, decoders, all_done = let.split()
    assert int(threads) >= 2 and int(decoders) == min(8, frame_threads.usable_cpus()), out
    assert all_done == "True", out
