"""A manifest's bytes: each record's JSON is the canonical JSON of its fields, however it is
written (``docs/format.md`` §3: the digest covers exactly those bytes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpde
from tpde.chain import Chain
from tpde.chain.base import manifest_path
from tpde.manifest import parse
from tpde.manifest.model import Record, SectionRef, _json, _record_body, _record_text

TEXT = st.text(max_size=12)  # quotes, escapes and non-ASCII included
COUNT = st.integers(0, 2**63)
SECTIONS = st.dictionaries(TEXT, st.builds(SectionRef, COUNT, COUNT, COUNT,
                                           st.lists(COUNT, max_size=4).map(tuple)), max_size=3)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
RECORDS = st.builds(
    Record, TEXT, TEXT, COUNT, TEXT, TEXT, TEXT, st.none() | COUNT, st.none() | TEXT, COUNT,
    SECTIONS, st.none() | COUNT, st.none() | TEXT, st.none() | FLOATS,
    st.none() | st.dictionaries(st.sampled_from(["abs", "rel"]), FLOATS),
    st.none() | st.dictionaries(st.sampled_from(["abs", "rel"]), FLOATS), st.none() | COUNT)


@given(RECORDS)
def test_a_records_json_is_its_fields_canonical_json(r: Record) -> None:
    assert _record_text(r) == _json(_record_body(r))


@given(RECORDS, st.sampled_from([True, 1.0]), st.booleans())
def test_a_field_of_another_type_is_written_as_json_writes_it(r: Record, odd: object,
                                                               in_frames: bool) -> None:
    """(A record parsed from a manifest holds what JSON held: a number where a count is.)"""
    if in_frames:
        r.__dict__["sections"] = {"values": SectionRef(0, 4, 4, (odd,))}
    else:
        r.__dict__["count"] = odd
    assert _record_text(r) == _json(_record_body(r))


@pytest.fixture(scope="module")
def step_bytes(tmp_path_factory) -> bytes:
    """A step's manifest as stored: a dozen tensors, each a record of its own."""
    run = str(tmp_path_factory.mktemp("named") / "run")
    state = {f"t{i}": torch.full((2000 + i,), float(i)) for i in range(12)}
    with tpde.Checkpointer(run) as ckpt:
        ckpt.save(0, state)
    chain = Chain(run)
    return chain.store.read(manifest_path(0))


@given(names=st.lists(st.sampled_from([f"t{i}" for i in range(12)] + ["gone"]), max_size=8))
def test_a_steps_records_are_found_by_name_in_its_order(step_bytes: bytes,
                                                        names: list[str]) -> None:
    """Found by name (what a mount asks for, a module at a time), a step's records are those
    its manifest lists under the names it holds, in the manifest's order, whether the records
    are built as they are asked for (a reader's) or all at once."""
    lazy, eager = parse(step_bytes, lazy=True), parse(step_bytes)
    listed = [r.name for r in eager.records]
    assert sorted(listed) == sorted(f"t{i}" for i in range(12))
    expected = [n for n in listed if n in names]
    assert [r.name for r in lazy.records_named(names)] == expected
    assert [r.name for r in eager.records_named(set(names))] == expected
    assert lazy.records_named(names) == [eager.record(n) for n in expected]
