"""The committed golden chains must decode bit-exactly forever: format 1 (whole spans), format 2
(large spans stored in pieces), format 3 (steps re-based into new blobs), format 4
(error-bounded records: within their bounds of the saved states, and hash-checked) and format 5
(sharded steps written by two ranks through torch.distributed.checkpoint), format 6 (record
hashes by XXH3-128; and a run whose deltas are coded against keyframe records) and format 7
(small tensors saved in packs)."""

from __future__ import annotations

import os
import sys

import pytest

import tpde
from helpers import assert_same

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from states import (LOSSY_BOUNDS, golden_states, lossy_states, packed_states,  # noqa: E402
                    sharded_states)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CHAINS = ("chain-v1", "chain-v2", "chain-v3", "chain-v6", "chain-v6-keyframe")
#: Where each chain stores golden state i (chain-v3 kept the odd steps of its run).
STEP = {"chain-v1": lambda i: i, "chain-v2": lambda i: i, "chain-v3": lambda i: 2 * i + 1,
        "chain-v6": lambda i: i, "chain-v6-keyframe": lambda i: i}


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("i", range(5))
def test_golden_steps_decode_bit_exactly(name: str, i: int) -> None:
    ck = tpde.Checkpointer(os.path.join(GOLDEN, name))
    assert_same(golden_states()[i], ck.load(STEP[name](i)))


@pytest.mark.parametrize("name", CHAINS)
def test_golden_chain_exercises_every_codec_and_residual(name: str) -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, name)).chain
    used = {(r.codec, r.residual) for s in chain.steps() for r in chain.manifest(s).records}
    assert {("key", None), ("same", None), ("sparse", "xor"), ("dense", "sub")} <= used
    assert chain.verify(STEP[name](4)) == []


@pytest.mark.parametrize("name", [*CHAINS, "chain-v4", "chain-v5", "chain-v7"])
def test_golden_chains_say_what_a_restore_decodes(name: str) -> None:
    """``tpde info``'s figures on every format: committed steps up to the one asked for, a
    keyframe step alone, one delta at most against keyframes, and never deeper than the depth
    the manifest recorded when it was saved (a re-base since can only have made it shallower:
    chain-v5's step 3 recorded 3, and reads 2 since step 1 went)."""
    chain = tpde.Checkpointer(os.path.join(GOLDEN, name)).chain
    for step in chain.steps():
        m, reads = chain.manifest(step), chain.reads(step)
        assert set(reads.steps) <= {s for s in chain.committed() if s <= step}
        assert 0 < reads.stored_bytes and reads.deepest <= m.depth
        if m.keyframe:
            assert reads.steps == [step] and reads.deepest == 0
        if name == "chain-v6-keyframe":
            assert reads.deepest <= 1


def test_golden_v3_is_rebased_and_keeps_its_first_names() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v3")).chain
    assert chain.committed() == [1, 3, 5, 7, 9]
    for step in chain.steps():
        m = chain.manifest(step)
        assert m.format == 3 and m.origin is not None and m.origin != m.blob
        assert all(r.ref is None or r.ref in chain.steps() for r in m.records)



@pytest.mark.parametrize("i", range(5))
def test_golden_v4_steps_hold_their_bounds(i: int) -> None:
    """The hash check pins every decoded bit; the bounds are checked against the saved states
    here, in numpy, and every tensor without a bound is bit-exact."""
    import numpy as np

    from test_lossy import holds

    ck = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v4"))
    got, saved = ck.load(i), lossy_states()[i]
    assert ck.chain.verify(i) == []
    assert ck.chain.manifest(i).format == 4
    bounded = {"model/w": got["model"]["w"], "model/f": got["model"]["f"], "edge": got["edge"]}
    for name, tensor in bounded.items():
        how, value = LOSSY_BOUNDS[name]
        want = saved["edge"] if name == "edge" else saved["model"][name.split("/")[1]]
        bound = tpde.Abs(value) if how == "abs" else tpde.Rel(value)
        assert np.all(holds(want, tensor, bound)), name
    exact = {**saved, "model": {k: v for k, v in saved["model"].items() if k not in ("w", "f")},
             "edge": None}
    mine = {**got, "model": {k: v for k, v in got["model"].items() if k not in ("w", "f", "tied")},
            "edge": None}
    exact["model"].pop("tied")
    assert_same(exact, mine)
    assert got["model"]["tied"] is got["model"]["w"]


def test_golden_v4_exercises_every_error_bounded_coding() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v4")).chain
    used = {(r.grid, "positions" in r.sections, "fixes" in r.sections, r.ref is None)
            for s in chain.steps() for r in chain.manifest(s).records if r.codec == "quant"}
    assert {("ulp", False, True, False), ("abs", False, False, False),
            ("ulp", False, False, True), ("ulp", True, False, False)} <= used


@pytest.mark.parametrize("step", [0, 2, 3])
def test_golden_v5_sharded_steps_decode_bit_exactly(step: int) -> None:
    """Through tpde alone (every front end's path) and through DCP's own consolidation."""
    import tpde.dcp

    run = os.path.join(GOLDEN, "chain-v5")
    want = sharded_states()[step]
    assert_same(want, tpde.Checkpointer(run).load(step))
    assert_same(want, tpde.dcp.load_full(run, step))


def test_golden_v5_holds_sharded_and_rebased_steps() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v5")).chain
    assert chain.steps() == [0, 2, 3]
    assert [len(chain.manifest(s).shards) for s in (0, 2, 3)] == [2, 0, 2]
    assert chain.manifest(2).origin is not None  # re-based: one blob, its first name kept
    assert {r.codec for r in chain.manifest(3).records} >= {"same", "sparse", "dense"}
    assert all(chain.manifest(s).format == 5 for s in chain.steps())


def test_golden_v6_records_hash_with_xxh3() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v6")).chain
    assert all(chain.manifest(s).format == 6 for s in chain.steps())
    assert all(r.hash.startswith("xxh3:") for s in chain.steps()
               for r in chain.manifest(s).records)


def test_golden_v6_keyframe_codes_deltas_against_keyframe_records() -> None:
    """Its deltas read keyframe records of earlier steps than the one before, and its marker
    says so (what re-bases keep to)."""
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v6-keyframe")).chain
    assert chain.deltas_against() == "keyframe"
    deltas = [(s, r) for s in chain.steps() for r in chain.manifest(s).records
              if r.codec not in ("same", "key")]
    assert all(chain.manifest(r.ref).record(r.name).codec == "key" for _, r in deltas)
    assert any(r.ref < s - 1 for s, r in deltas)


@pytest.mark.parametrize("i", range(5))
def test_golden_v7_packed_steps_decode_bit_exactly(i: int) -> None:
    """Each small tensor back as the storage it was saved as (the two views still sharing
    one), from packs coded whole, as deltas and unchanged."""
    assert_same(packed_states()[i], tpde.Checkpointer(os.path.join(GOLDEN, "chain-v7")).load(i))


def test_golden_v7_holds_packs() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v7")).chain
    assert all(chain.manifest(s).format == 7 for s in chain.steps())
    packs = {(r.name, r.parts, r.codec) for s in chain.steps() for r in chain.manifest(s).records
             if r.parts}
    assert {(n, p) for n, p, _ in packs} == {("small/<pack float32>", 14),
                                             ("small/<pack int64>", 4)}
    assert {c for *_, c in packs} >= {"key", "same", "dense"}
    assert chain.verify() == []


def test_a_chain_of_an_older_format_goes_on_with_new_hashes(tmp_path) -> None:
    """New steps on a BLAKE2b chain hash with XXH3; unchanged records keep the hash they had;
    a re-base of an older step keeps its hashes and its format; everything still verifies."""
    import shutil

    run = str(tmp_path / "v3")
    shutil.copytree(os.path.join(GOLDEN, "chain-v3"), run)
    states = golden_states()
    with tpde.Checkpointer(run) as ck:
        assert_same(states[4], ck.load(9))
        ck.save(10, states[4])  # unchanged: every record points at step 9's data
        ck.save(11, states[3])
    chain = tpde.Checkpointer(run).chain
    same = chain.manifest(10)
    assert same.format == 3 and {r.codec for r in same.records} == {"same"}
    new = chain.manifest(11)
    assert new.format == 6 and any(r.hash.startswith("xxh3:") for r in new.records)
    with tpde.Checkpointer(run) as ck:
        ck.remove(7)
        assert ck.chain.manifest(9).format == 3
        assert_same(states[4], ck.load(9))
        assert_same(states[3], ck.load(11))
        assert ck.verify() == []
