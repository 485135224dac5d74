"""A manifest's bytes: each record's JSON is the canonical JSON of its fields, however it is
written (``docs/format.md`` §3: the digest covers exactly those bytes)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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
