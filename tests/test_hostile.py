"""Hostile manifests: damaged bytes, or a valid digest around lies. Only TPDEErrors escape."""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpde import FormatError, manifest

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
STEP_1 = os.path.join("steps", "00000000000000000001.json")
RAW = open(os.path.join(GOLDEN, "chain-v1", STEP_1), "rb").read()
BODY = json.loads(RAW)["body"]
#: A manifest whose first span (bf16 ``model/w``) is stored in pieces.
PIECES = json.loads(open(os.path.join(GOLDEN, "chain-v2", STEP_1), "rb").read())["body"]


def signed(body: dict) -> bytes:
    """A manifest whose digest is right: only the field checks can refuse it."""
    canon = manifest.canonical(body)
    return manifest.canonical({"body": body, "blake2b": manifest.content_hash(canon)})


@given(st.integers(0, len(RAW) - 1), st.integers(1, 255))
def test_any_damaged_byte_is_refused(at: int, xor: int) -> None:
    damaged = bytearray(RAW)
    damaged[at] ^= xor
    with pytest.raises(FormatError):
        manifest.parse(bytes(damaged), step=1)


@given(st.integers(0, len(RAW)))
def test_truncation_is_refused(n: int) -> None:
    if n == len(RAW):
        assert manifest.parse(RAW, step=1).step == 1
    else:
        with pytest.raises(FormatError):
            manifest.parse(RAW[:n], step=1)


def read(data: bytes, lazy: bool) -> manifest.Manifest:
    """A manifest parsed, and (read lazily, as a chain's reader does) every record asked for."""
    m = manifest.parse(data, step=1, lazy=lazy)
    list(m.records)
    return m


def lie(path: tuple, value: object, body: dict = BODY) -> bytes:
    body = copy.deepcopy(body)
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return signed(body)


@pytest.mark.parametrize("path, value", [
    (("records", 0, "numel"), 10**15),
    (("records", 0, "numel"), -1),
    (("records", 0, "dtype"), "float128"),
    (("records", 0, "codec"), "magic"),
    (("records", 0, "ref"), 99),
    (("records", 0, "count"), 10**12),
    (("records", 0, "sections", "values", "raw"), 2**40),
    (("records", 0, "sections", "values", "chunk"), 1),
    (("records", 0, "sections", "values", "offset"), 2**40),
    (("records", 0, "sections", "values", "frames"), [1] * 3),
    (("blob_size",), 3),
    (("step",), 2),
    (("format",), 99),
    (("records",), "nope"),
    (("records", 0), "nope"),
    (("records", 0, "name"), BODY["records"][1]["name"]),
])
@pytest.mark.parametrize("lazy", [False, True])
def test_lies_behind_a_valid_digest_are_refused(path: tuple, value: object, lazy: bool) -> None:
    with pytest.raises(FormatError):
        read(lie(path, value), lazy)


def test_a_record_read_lazily_is_checked_when_asked_for_and_its_error_says_where() -> None:
    """Read lazily, a lie in one record lets the others be read, and is refused (naming the
    run, step and tensor) whenever that record is asked for: by name, by index, in a loop."""
    name = BODY["records"][0]["name"]
    m = manifest.parse(lie(("records", 0, "numel"), -1), step=1, lazy=True, run="memory://r")
    assert m.record(BODY["records"][1]["name"]).numel == BODY["records"][1]["numel"]
    for ask in (lambda: m.record(name), lambda: m.records[0], lambda: list(m.records),
                lambda: m.raw_bytes):
        with pytest.raises(FormatError) as err:
            ask()
        assert (err.value.run, err.value.step, err.value.tensor) == ("memory://r", 1, name)
    assert m.record("no such tensor") is None


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "7", None, 2**63])
def test_a_chunk_table_entry_that_is_no_frame_size_is_refused(bad: object) -> None:
    table = list(BODY["records"][0]["sections"]["values"]["frames"])
    assert manifest.parse(lie(("records", 0, "sections", "values", "frames"), table), step=1)
    table[0] = bad
    with pytest.raises(FormatError):
        manifest.parse(lie(("records", 0, "sections", "values", "frames"), table), step=1)
    with pytest.raises(FormatError):
        manifest.parse(lie(("records", 0, "sections", "values", "frames"), "nope"), step=1)


@pytest.mark.parametrize("path, value", [
    (("format",), 1),                              # pieces need format 2
    (("records", 1, "start"), 4095),               # overlaps the piece before
    (("records", 1, "start"), 4097),               # leaves a gap
    (("records", 1, "start"), 2**49),
    (("records", 1, "start"), -1),
    (("records", 1, "start"), 0),                  # name says 4096
    (("records", 0, "start"), None),               # a whole span cannot continue
    (("records", 1, "name"), "model/x/4096"),      # another span
    (("records", 1, "dtype"), "float16"),          # same width, another dtype
    (("records", 1, "device"), "cuda:0"),
    (("records", 0, "name"), "/0"),                # a piece of no span
])
@pytest.mark.parametrize("lazy", [False, True])
def test_lies_about_pieces_are_refused(path: tuple, value: object, lazy: bool) -> None:
    assert read(signed(PIECES), lazy).records[1].start == 4096
    with pytest.raises(FormatError):
        read(lie(path, value, PIECES), lazy)


def test_oversized_manifest_is_refused_before_parsing() -> None:
    with pytest.raises(FormatError, match="cap"):
        manifest.parse(b" " * (manifest.MAX_MANIFEST_BYTES + 1))


def test_fuzz_campaign_lets_only_tpde_errors_escape() -> None:
    """The quick version of `tests/campaigns/fuzz.py`: every parser and decoder, mutated."""
    from campaigns.fuzz import campaign

    r = campaign(1500, seed=0)
    assert r["failures"] == []
    for kind in ("manifest", "lie", "elias", "zstd", "entry"):
        assert r["counts"].get(f"{kind} refused", 0) > 100, r["counts"]


FRAMED = open(os.path.join(GOLDEN, "chain-v3", "steps", f"{3:020d}.json"), "rb").read()


@given(st.integers(0, len(FRAMED) - 1), st.integers(1, 255))
def test_a_damaged_framed_manifest_is_refused_or_reads_as_it_was(at: int, xor: int) -> None:
    """A flipped bit that the zstd decoder never uses (padding) changes nothing; any other is
    refused: never a different manifest."""
    damaged = bytearray(FRAMED)
    damaged[at] ^= xor
    try:
        got = manifest.parse(bytes(damaged), step=3)
    except FormatError:
        return
    assert manifest.plain(bytes(damaged)) == manifest.plain(FRAMED)
    assert got == manifest.parse(FRAMED, step=3)


def test_framed_manifests_are_bounded_and_must_be_format_3() -> None:
    import zstandard

    assert manifest.parse(FRAMED, step=3).format == 3
    huge = zstandard.ZstdCompressor(write_content_size=True).compress(
        b" " * (manifest.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(FormatError, match="cap"):
        manifest.parse(huge)  # refused from its header, before anything is decompressed
    old = zstandard.ZstdCompressor(write_content_size=True).compress(RAW)  # a format 1 body
    with pytest.raises(FormatError, match="format 1"):
        manifest.parse(old, step=1)


def test_a_number_damaged_into_infinity_is_a_format_error() -> None:
    with pytest.raises(FormatError, match="not valid tpde JSON"):
        manifest.parse(RAW.replace(b'"blob_size":', b'"blob_size":1e999,"x":', 1), step=1)


def test_a_restore_checks_the_records_it_uses_and_refuses_a_lie_in_any_of_them(tmp_path) -> None:
    """A chain's reader checks the records of the steps a restore builds on as it uses them:
    the model's part of step 1 loads while a lie (behind a valid digest) in the optimizer's
    record of step 0 is refused, naming run, step and tensor, by every read that needs it.
    The walk that builds them holds the garbage collector off, and switches it back on."""
    import gc

    import torch
    import zstandard

    import tpde

    run = str(tmp_path / "run")
    w = torch.arange(64, dtype=torch.float32)
    with tpde.Checkpointer(run) as ck:
        ck.save(0, {"model": {"w": w}, "optimizer": {"m": torch.ones(64)}})
        ck.save(1, {"model": {"w": w + 1}, "optimizer": {"m": torch.ones(64)}})
    path = tmp_path / "run" / "steps" / f"{0:020d}.json"
    body = json.loads(manifest.plain(path.read_bytes()))["body"]
    (lied,) = [r for r in body["records"] if r["name"].startswith("optimizer")]
    lied["numel"] = 10**15
    path.write_bytes(zstandard.ZstdCompressor(write_content_size=True).compress(signed(body)))
    assert torch.equal(tpde.load_state_dict(run, 1)["w"], w + 1)
    for step in (1, 0):
        with pytest.raises(FormatError) as err:
            tpde.Checkpointer(run).load(step)
        assert (err.value.step, err.value.tensor) == (0, lied["name"])
        assert err.value.run is not None and err.value.run.endswith("run")
        assert gc.isenabled()

