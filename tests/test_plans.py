"""A save's plan (``plan.plan_save``) read without a store: manifests built by hand, saved one
after another as the plan says, and every plan checked against the rules a chain keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpde.chain.plan import KEYFRAME, PREVIOUS, SavePlan, keyed_at, plan_save
from tpde.manifest import Manifest, Record
from tpde.state import tree


def flat_of(sizes: dict[str, int]) -> tree.Flat:
    """A state's structure alone: the plan reads sizes, never values."""
    return tree.Flat(None, [tree.Span(n, torch.empty(k), "cpu") for n, k in sizes.items()])


def committed(plan: SavePlan, changed: set[str]) -> Manifest:
    """The manifest a save of ``plan`` writes where ``changed`` names the spans that changed:
    a re-keyed piece is a keyframe record, an unchanged one points at its reference's data."""
    records = []
    for p in plan.pieces:
        src = plan.source(p.name)
        codec = "key" if src is None else "delta" if p.span.name in changed else "same"
        records.append(Record(p.name, "float32", p.hi - p.lo, "cpu", codec, f"h{plan.step}",
                              src, start=p.start))
    refs = {r.ref for r in records if r.ref is not None}
    return Manifest(step=plan.step, keyframe=not refs, depth=0,
                    parent=max(refs) if refs else None, blob="b", blob_size=0, created=0.0,
                    seconds=0.0, skeleton=None, records=records, format=1)


@settings(max_examples=40)
@given(sizes=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 40), min_size=1),
       changes=st.lists(st.sets(st.sampled_from("abcdef")), min_size=1, max_size=24),
       keyframe_every=st.integers(1, 6), piece=st.integers(4, 64),
       against=st.sampled_from([PREVIOUS, KEYFRAME]))
def test_plans_bound_every_lineage_and_cut_every_span_whole(
        sizes, changes, keyframe_every, piece, against) -> None:
    manifests: dict[int, Manifest] = {}
    flat = flat_of(sizes)
    for step, changed in enumerate(changes):
        plan = plan_save(manifests, step, flat, step - 1 if step else None,
                         keyframe_every=keyframe_every, piece_bytes=piece, most_bytes=2 * piece,
                         against=against)
        for name, numel in sizes.items():  # each span cut end to end, in order
            cuts = [(p.lo, p.hi) for p in plan.pieces if p.span.name == name]
            assert cuts[0][0] == 0 and cuts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        manifests[step] = committed(plan, changed)
        for p in plan.pieces:
            deltas, key = keyed_at(manifests, step, p.name)
            assert deltas < keyframe_every  # a restore decodes at most keyframe_every - 1
            if against == KEYFRAME:
                assert deltas <= 1 and manifests[key].record(p.name).ref is None
            assert deltas == plan.depth_after(p.name, plan.source(p.name),
                                              p.span.name not in changed) or step == 0


def test_a_plan_follows_the_reference_steps_cuts_and_is_frozen() -> None:
    """A writer with another piece size keeps the pieces the reference step stored, so its
    deltas stay deltas; nothing in a plan can be changed once made."""
    first = plan_save({}, 0, flat_of({"w": 100}), None, keyframe_every=4, piece_bytes=160,
                      most_bytes=400)
    assert [(p.lo, p.hi) for p in first.pieces] == [(0, 40), (40, 80), (80, 100)]
    assert first.keyed == {"w/0", "w/40", "w/80"} and first.reference is None
    manifests = {0: committed(first, set())}
    again = plan_save(manifests, 1, flat_of({"w": 100}), 0, keyframe_every=4, piece_bytes=40,
                      most_bytes=400)
    assert [(p.lo, p.hi) for p in again.pieces] == [(0, 40), (40, 80), (80, 100)]
    assert again.keyed == set() and {again.source(p.name) for p in again.pieces} == {0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.reference = 3  # type: ignore[misc]


def test_a_tensor_new_at_a_step_is_a_keyframe_record_and_the_rest_stay_deltas() -> None:
    manifests = {0: committed(plan_save({}, 0, flat_of({"a": 8}), None, keyframe_every=8,
                                        piece_bytes=1 << 20, most_bytes=1 << 20), set())}
    plan = plan_save(manifests, 1, flat_of({"a": 8, "b": 8}), 0, keyframe_every=8,
                     piece_bytes=1 << 20, most_bytes=1 << 20)
    assert plan.keyed == {"b"} and plan.source("a") == 0 and plan.source("b") is None


def test_stale_keyframe_words_are_named_by_the_step_of_their_keyframe_now() -> None:
    """Against keyframes, words held for a keyframe record re-based away since are read back
    from where that tensor's keyframe record is now."""
    flat = flat_of({"a": 4, "b": 4})
    first = plan_save({}, 0, flat, None, keyframe_every=8, piece_bytes=64, most_bytes=64,
                      against=KEYFRAME)
    manifests = {0: committed(first, set())}
    plan = plan_save(manifests, 1, flat, 0, keyframe_every=8, piece_bytes=64, most_bytes=64,
                     against=KEYFRAME)
    assert plan.stale({"a": 0, "b": 0}) == {}
    assert plan.stale({"a": 0, "b": 7}) == {0: ["b"]}
    assert plan_save(manifests, 1, flat, 0, keyframe_every=8, piece_bytes=64,
                     most_bytes=64).stale({"b": 7}) == {}  # against the step before: none
