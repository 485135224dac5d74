"""Spans larger than the in-flight limit are stored as pieces: each its own record, coded and
restored on its own, reassembled into one tensor (and its views) on load, export and mount."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpde
from helpers import assert_same
from tpde.chain.plan import cut
from tpde.cli import main as cli

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.complex64, torch.int16,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.int3]


def random_tensor(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def pieces_of(m: tpde.manifest.Manifest, span: str) -> list[tpde.manifest.Record]:
    return [r for r in m.records if r.span == span]


@settings(max_examples=30)
@given(st.sampled_from(DTYPES), st.integers(1, 3000), st.integers(1, 2048),
       st.sampled_from(["host", "store"]), st.integers(0, 2**31))
def test_pieces_restore_bit_exactly_over_dtypes_sizes_and_piece_sizes(
        dtype: torch.dtype, n: int, inflight: int, reference: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    run = f"memory://tpde-tests/{uuid.uuid4().hex[:10]}"
    t = random_tensor(dtype, n, g)
    states = []
    with tpde.Checkpointer(run, keyframe_every=3, max_inflight_bytes=inflight,
                           reference=reference) as ck:
        for step in range(4):
            if step:  # a few scattered changes, then every element of the tail
                at = torch.randint(0, n, (3,), generator=g)
                t.view(torch.uint8).view(-1, t.element_size())[at] = \
                    random_tensor(dtype, 3, g).view(torch.uint8).view(-1, t.element_size())
                if step == 2:  # as bytes: some dtypes (int3) have no copy kernel
                    size = t.element_size()
                    t.view(torch.uint8)[n // 2 * size :] = \
                        random_tensor(dtype, n - n // 2, g).view(torch.uint8)
            state = {"t": t, "tail": t[n // 3 :], "small": torch.tensor([step])}
            states.append({"t": t.view(torch.uint8).clone().view(dtype),
                           "small": state["small"]})
            ck.save(step, state)
    for step, expected in enumerate(states):
        got = tpde.Checkpointer(run).load(step)
        assert_same(expected["t"], got["t"])
        assert_same(expected["small"], got["small"])
        assert got["tail"].untyped_storage().data_ptr() == got["t"].untyped_storage().data_ptr()
        pieces = pieces_of(tpde.Checkpointer(run).chain.manifest(step), "t")
        assert sum(r.numel for r in pieces) == n
        # Pieces of at most half the in-flight limit (two are encoded at once), never empty.
        most = max(inflight // 2, t.element_size())
        assert all(0 < r.raw_bytes <= most for r in pieces)
        assert (len(pieces) > 1) == (n * t.element_size() > most)
    assert tpde.Checkpointer(run).verify() == []


@pytest.fixture()
def pieced(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """Two steps of a 64 kB tensor stored in 8 kB pieces; one changed element in step 1."""
    run = str(tmp_path / "run")
    w = torch.arange(16384, dtype=torch.float32)
    with tpde.Checkpointer(run, max_inflight_bytes=16384) as ck:
        ck.save(0, {"w": w, "b": torch.ones(4)})
        w[5000] = -1.0
        ck.save(1, {"w": w, "b": torch.ones(4)})
    return run, {"w": w, "b": torch.ones(4)}


def test_a_delta_stores_only_the_pieces_that_changed(pieced) -> None:
    run, _ = pieced
    m = tpde.Checkpointer(run).chain.manifest(1)
    codecs = {r.name: r.codec for r in pieces_of(m, "w")}
    assert len(codecs) == 8 and codecs.pop("w/4096") == "sparse"
    assert set(codecs.values()) == {"same"}
    assert m.format == 6


def test_new_steps_are_written_as_zstd_framed_manifests_with_xxh3_hashes(tmp_path) -> None:
    import zstandard

    with tpde.Checkpointer(str(tmp_path / "run")) as ck:
        ck.save(0, {"w": torch.zeros(1000)})
        assert ck.chain.manifest(0).format == 6
        assert ck.chain.manifest(0).records[0].hash.startswith("xxh3:")
    raw = (tmp_path / "run" / "steps" / f"{0:020d}.json").read_bytes()
    text = zstandard.ZstdDecompressor().decompress(raw)  # any zstd decoder reads it
    assert json.loads(text)["body"]["format"] == 6


def test_a_damaged_piece_is_named_and_the_others_still_restore(pieced) -> None:
    run, state = pieced
    chain = tpde.Checkpointer(run).chain
    m = chain.manifest(0)
    victim = m.record("w/8192").sections["values"]
    path = f"{run}/{m.blob}"
    blob = bytearray(open(path, "rb").read())
    blob[victim.offset + victim.length // 2] ^= 0x40
    open(path, "wb").write(bytes(blob))
    problems = tpde.Checkpointer(run).verify(1)
    assert {p.tensor for p in problems} == {"w/8192"} and all(p.step == 0 for p in problems)
    with pytest.raises(tpde.CorruptionError) as err:
        tpde.Checkpointer(run).load(1)
    assert err.value.tensor == "w/8192" and "w/8192" in str(err.value)
    words = tpde.Checkpointer(run).chain.materialize(1, ["w/0", "w/4096"])
    assert torch.equal(words["w/4096"].view(torch.float32), state["w"][4096:6144])


def test_changing_the_piece_size_between_saves_restores_every_step(tmp_path) -> None:
    """A span the step before stored in pieces is cut the same way while those pieces fit
    the writer's memory bound (half of ``max_inflight_bytes``), whatever its own piece size:
    its pieces stay deltas. A span first cut, or cut again, starts from keyframe records."""
    run = str(tmp_path / "run")
    g = torch.Generator().manual_seed(1)
    w, states = torch.randn(20000, generator=g), []
    for step, inflight in enumerate([1 << 20, 8192, 8192, 30000, 1 << 20, 4096]):
        w[step * 7] += 1
        states.append(w.clone())
        with tpde.Checkpointer(run, max_inflight_bytes=inflight, reference="store") as ck:
            if step:
                ck.load(step - 1)
            ck.save(step, {"w": w})
    for step, expected in enumerate(states):
        assert torch.equal(tpde.Checkpointer(run).load(step)["w"], expected)
    chain = tpde.Checkpointer(run).chain
    codecs = [{r.codec for r in chain.manifest(s).records} for s in range(6)]
    assert codecs == [{"key"}, {"key"}] + [{"sparse", "same"}] * 3 + [{"key"}]
    assert [len(chain.manifest(s).records) for s in range(6)] == [1, 20, 20, 20, 20, 40]


def test_export_reassembles_spans_under_their_own_names(pieced, tmp_path, capsys) -> None:
    run, state = pieced
    out = str(tmp_path / "exported")
    assert cli(["export", run, "--step", "1", "--to", out, "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert_same(state, tpde.Checkpointer(out).load(1))
    # The default piece size holds the 64 kB span whole, under the span's name.
    assert [r.name for r in tpde.Checkpointer(out).chain.manifest(1).records] == ["w", "b"]


@pytest.mark.parametrize("resident", ["host", "store"])
@pytest.mark.parametrize("budget", [None, 0])
def test_a_mounted_model_reads_weights_stored_in_pieces(tmp_path, resident: str,
                                                        budget: int | None) -> None:
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(3000, 24), torch.nn.Linear(24, 5))

    model = build()
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run, max_inflight_bytes=32768) as ck:
        ck.save(0, {"model": model.state_dict()})
        with torch.no_grad():
            model[0].weight[17] += 1
        ck.save(1, {"model": model.state_dict()})
    assert len(pieces_of(ck.chain.manifest(1), "model/0.weight")) == 18
    mounted = tpde.mount(run, model=build, budget=budget, resident=resident, device="cpu")
    ids = torch.tensor([[17, 2999, 0, 1500]])
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(mounted(ids), model(ids))
    mounted.tpde_mount.close()


def test_bounded_pieces_restore_within_their_bound(tmp_path) -> None:
    """Error-bounded pieces are rebuilt in new words, not in the span's buffer as exact ones
    are; they land in their part of the span all the same."""
    run = str(tmp_path / "r")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200_000, generator=g)
    saved = []
    with tpde.Checkpointer(run, max_inflight_bytes=1 << 20,
                           error_bound={"w": tpde.Rel(1e-3)}) as ck:
        for step in range(3):
            saved.append(w.clone())
            ck.save(step, {"w": w})
            w = w + 1e-4 * torch.randn(w.shape, generator=g)
    reader = tpde.Checkpointer(run)
    for step, expected in enumerate(saved):
        pieces = pieces_of(reader.chain.manifest(step), "w")
        assert len(pieces) > 1 and any(r.codec == "quant" for r in pieces)
        with pytest.warns(tpde.LossyWarning):
            got = reader.load(step)["w"]
        assert got.shape == expected.shape
        assert bool(((got - expected).abs() <= 1e-3 * expected.abs()).all())


@given(n=st.integers(1, 5000), per=st.integers(1, 3000), most=st.integers(1, 6000),
       starts=st.one_of(st.none(), st.lists(st.integers(0, 6000), min_size=1, max_size=8)
                        .map(lambda xs: sorted(set(xs)))))
def test_a_span_is_cut_at_its_reference_s_starts_or_afresh(n: int, per: int, most: int,
                                                          starts: list[int] | None) -> None:
    parts, whole = cut(n, per, starts, most)
    assert [lo for lo, _ in parts][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # they tile the span
    followed = bool(starts) and [lo for lo, _ in parts] == starts and not whole
    fits = bool(starts) and starts[0] == 0 and starts[-1] < n and all(
        b - a <= most for a, b in zip(starts, [*starts[1:], n]))
    assert followed == fits
    if not followed:
        assert all(hi - lo <= per for lo, hi in parts) or whole
        assert whole == (n <= per)
