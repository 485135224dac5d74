"""Checkpointer over real stores: local files, memory://, and S3 through a moto server."""

from __future__ import annotations

import contextlib
import copy
import gc
import glob
import itertools
import json
import os
import threading
import warnings
from collections import OrderedDict
from typing import Iterator

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import tpde
import tpde.dcp
from helpers import assert_same, decode_depths
from tpde.codec import encoder, weigh
from tpde.store import blob, store

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf")


@contextlib.contextmanager
def collections_counted() -> Iterator[list[int]]:
    """The generations of the collections set off inside the block, where the collector would
    run at nearly every allocation (threshold 1, switched on); its threshold and state are as
    they were after."""
    started: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.callbacks.append(seen)
    try:
        gc.set_threshold(1)
        gc.enable()
        yield started
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def odd_state() -> dict:
    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(10, 4, generator=g))
    x = torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
    sd = OrderedDict(weight=emb.detach(), tied=emb.detach())
    sd._metadata = {"": {"version": 1}}
    return {
        "sd": sd, "param": emb, "x": x, "slice": x[:, 1:], "t": x.transpose(0, 1),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3), "bf16": torch.ones(3).bfloat16(),
        "fp8": torch.ones(4).to(torch.float8_e4m3fn), "c": torch.randn(3, dtype=torch.complex64),
        "b": torch.tensor([True, False]), "u16": torch.arange(5).to(torch.uint16),
        "opt": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0]}]},
        "meta": {"epoch": 3, "nan": float("nan"), "inf": float("-inf"), "bytes": b"\x00\x01",
                 "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "none": None, "$odd": 1,
                 "tuple": (1, "a", 2.5), 7: "int key", "set": {1, 2}, "cplx": 1 + 2j},
    }


def test_every_kind_of_value_round_trips(store_url) -> None:
    url, opts = store_url
    state = odd_state()
    ck = tpde.Checkpointer(url, storage_options=opts)
    ck.save(0, state)
    out = tpde.Checkpointer(url, storage_options=opts).load(0)
    assert_same(state, out)
    assert out["sd"]["weight"].data_ptr() == out["sd"]["tied"].data_ptr()
    assert out["slice"].untyped_storage().data_ptr() == out["x"].untyped_storage().data_ptr()
    assert isinstance(out["param"], torch.nn.Parameter)


def test_the_manifest_a_writer_keeps_is_the_one_its_bytes_parse_to(tmp_path) -> None:
    """A writer keeps each manifest as it built it instead of parsing back what it wrote: the
    two must not differ in anything, for every kind of value and record."""
    run = str(tmp_path / "r")
    ck = tpde.Checkpointer(run, max_inflight_bytes=1 << 20, error_bound={"q": tpde.Rel(1e-3)})
    q = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        q = q + 1e-4
        ck.save(step, {**odd_state(), "q": q, "step": step})
    ck.remove(1)
    for step in ck.chain.committed():
        kept = ck.chain.manifest(step)
        data = ck.chain.store.read(tpde.chain.base.manifest_path(step))
        assert tpde.manifest.parse(data, step=step) == kept
        assert kept.__dict__["_size"] == len(data)
        # Laid out otherwise, the same content still checks against its digest.
        outer = json.loads(tpde.manifest.plain(data))
        assert tpde.manifest.parse(json.dumps(outer, indent=1).encode(), step=step) == kept
        outer["body"]["depth"] += 1
        with pytest.raises(tpde.FormatError, match="digest"):
            tpde.manifest.parse(json.dumps(outer).encode(), step=step)
    ck.close()


def test_saves_restores_and_removals_set_off_no_garbage_collection_and_leave_the_collector_on(
        tmp_path) -> None:
    """A save builds a record, its sections and a task for every tensor, a restore as many,
    and a removal that re-bases codes steps again; the collections their containers would set
    off walk every object of the process, so the collector waits until the call is done. It
    is on again after, a refused save included, and stays off where the program switched it
    off."""
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(200)}
    moved = {k: v + 1 for k, v in state.items()}
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, state)
    # This save with the collector on sets off thousands.
    with collections_counted() as started:
        ck.save(1, moved)
        assert len(started) < 50 and gc.isenabled()
        started.clear()
        assert torch.equal(ck.load(1)["t7"], moved["t7"])
        assert len(started) < 50 and gc.isenabled()
        started.clear()
        report = ck.remove(0)  # step 1 reads from it: re-based first
        assert report.rebased_steps == [1]
        assert len(started) < 50 and gc.isenabled()
        with pytest.raises(tpde.StepExistsError):
            ck.save(1, state)
        assert gc.isenabled()
        gc.disable()
        ck.save(2, state)
        assert not gc.isenabled()
        gc.enable()
        started.clear()
        tpde.state.tree.flatten(moved)
        assert len(started) > 50  # a part of the same save, outside one
    assert torch.equal(ck.load(1)["t7"], moved["t7"])
    ck.close()


def test_a_state_is_freed_as_soon_as_it_is_dropped_after_a_save_or_a_restore(tmp_path) -> None:
    """Nothing a save or a restore leaves behind holds the state's tensors: the walks over a
    state were closures that called themselves, a reference cycle that kept a restored 200 MB
    state (or a saved one its program had dropped) in memory until Python's collector ran."""
    import weakref

    def state() -> dict:
        return {"w": torch.randn(1000), "nested": [{"m": torch.ones(10)}, (torch.zeros(3),)],
                "ordered": OrderedDict(a=torch.arange(4)), "n": 3}

    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, state())
    enabled = gc.isenabled()
    gc.disable()  # only reference counting frees anything now
    try:
        saved = state()
        refs = [weakref.ref(saved["w"]), weakref.ref(saved["ordered"]["a"])]
        ck.save(1, saved)
        del saved
        assert [r() for r in refs] == [None, None]
        restored = ck.load(1)
        assert restored["n"] == 3
        refs = [weakref.ref(restored["w"]), weakref.ref(restored["nested"][0]["m"]),
                weakref.ref(restored["nested"][1][0]), weakref.ref(restored["ordered"]["a"])]
        del restored
        assert [r() for r in refs] == [None] * 4
    finally:
        if enabled:
            gc.enable()
    ck.close()


def test_parsing_a_manifest_sets_off_no_garbage_collection_and_leaves_the_collector_as_it_was(
        tmp_path) -> None:
    """A parse makes many short-lived containers; the collections they would set off walk
    every object of the process (torch's own included), so the collector waits until the parse
    is done. Whatever state it was in, it is in that state after, a refused manifest included."""
    run = str(tmp_path / "r")
    ck = tpde.Checkpointer(run)
    ck.save(0, {f"t{i}": torch.full((8,), float(i)) for i in range(200)})
    ck.close()
    data = ck.chain.store.read(tpde.chain.base.manifest_path(0))
    outer = json.loads(tpde.manifest.plain(data))
    outer["body"]["depth"] += 1
    damaged = json.dumps(outer).encode()
    # A parse of this manifest with the collector on sets off over a thousand; held off, it
    # sets off only the few that follow it being switched back on.
    with collections_counted() as started:
        assert tpde.manifest.parse(data, step=0).step == 0
        assert len(started) < 50 and gc.isenabled()
        started.clear()
        with pytest.raises(tpde.FormatError, match="digest"):
            tpde.manifest.parse(damaged, step=0)
        assert len(started) < 50 and gc.isenabled()
        gc.disable()
        tpde.manifest.parse(data, step=0)
        assert not gc.isenabled()
        gc.enable()
        started.clear()
        json.loads(tpde.manifest.plain(data))
        assert len(started) > 50  # the same containers, made outside a parse


def test_keys_that_print_alike_stay_distinct(tmp_path) -> None:
    state = {1: torch.ones(2), "1": torch.zeros(2), "a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, state)
    ck.save(1, state)
    assert_same(state, tpde.Checkpointer(str(tmp_path / "r")).load(1))


def test_tied_tensors_are_stored_once(tmp_path) -> None:
    w = torch.randn(1000, 100)
    info = tpde.Checkpointer(str(tmp_path / "r")).save(0, {"a": w, "b": w, "view": w[10:20]})
    assert info.raw_bytes == w.numel() * 4


class Unknown:
    def __init__(self, v: int) -> None:
        self.v = v


def test_loading_never_unpickles_unknown_objects_unless_trusted(tmp_path) -> None:
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, {"obj": Unknown(5), "w": torch.ones(2)})
    with pytest.raises(tpde.UnsafeContentError, match="trusted=True"):
        ck.load(0)
    assert ck.load(0, trusted=True)["obj"].v == 5


def test_quantized_and_sparse_tensors_are_kept_whole(tmp_path) -> None:
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    s = torch.randn(4, 4).to_sparse()
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, {"q": q, "s": s})
    out = ck.load(0)
    assert torch.equal(out["q"].int_repr(), q.int_repr()) and torch.equal(out["s"].to_dense(), s.to_dense())


def train_states(steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        yield step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def test_chain_restores_every_step_and_keyframes_bound_depth(store_url) -> None:
    url, opts = store_url
    ck = tpde.Checkpointer(url, keyframe_every=3, storage_options=opts)
    saved = {}
    for step, state in train_states(7):
        saved[step] = copy.deepcopy(state)
        info = ck.save(step, state)
        assert info.keyframe == (step == 0)
        depths = decode_depths(ck.chain, step)
        assert max(depths.values()) <= 2, depths  # per tensor: fewer than keyframe_every
    reader = tpde.Checkpointer(url, storage_options=opts)
    assert reader.steps() == list(range(7))
    for step, state in saved.items():
        assert_same(state, reader.load(step))
    assert reader.verify() == []


@pytest.mark.parametrize("reference", ["host", "store"])
def test_deltas_against_keyframes_restore_every_step_from_one_delta(store_url,
                                                                     reference: str) -> None:
    """Each delta is coded against its tensor's keyframe record, so no restore decodes more
    than one; a step saved again as it was is stored as pointers to the step before (a
    keyframe's words no longer tell it), and the run's marker records the choice."""
    url, opts = store_url
    ck = tpde.Checkpointer(url, keyframe_every=4, storage_options=opts, reference=reference,
                           deltas_against="keyframe")
    saved, step = {}, 0
    for _, state in train_states(7):
        for _ in range(2):  # every state saved twice, as Lightning's `last` beside top-k
            saved[step] = copy.deepcopy(state)
            ck.save(step, state)
            step += 1
    chain = ck.chain
    for s in range(1, step, 2):
        again = chain.manifest(s)
        assert again.blob_size == 0 and {r.codec for r in again.records} == {"same"}
        for r in again.records:  # the data of the same words, at the step before
            before = chain.manifest(s - 1).record(r.name)
            assert r.ref == (before.ref if before.codec == "same" else s - 1)
    for s in range(step):
        assert max(decode_depths(chain, s).values()) <= 1, decode_depths(chain, s)
        for r in chain.manifest(s).records:  # a delta reads a keyframe record
            if r.codec not in ("same", "key"):
                assert chain.manifest(r.ref).record(r.name).codec == "key"
    assert json.loads(chain.store.read(tpde.chain.MARKER))["deltas_against"] == "keyframe"
    ck.close()
    reader = tpde.Checkpointer(url, storage_options=opts)
    for s, state in saved.items():
        assert_same(state, reader.load(s))
    assert reader.verify() == []
    with pytest.raises(ValueError, match="deltas_against"):
        tpde.Checkpointer(url, deltas_against="parent")


def test_a_run_changes_what_its_deltas_are_coded_against_between_writers(tmp_path) -> None:
    """A writer coding against the step before resumes a run saved against keyframes, and
    back: the marker follows the writer, and every step restores as saved."""
    url = str(tmp_path / "run")
    saved, states = {}, train_states(9)
    for against, steps in (("keyframe", 3), ("previous", 3), ("keyframe", 3)):
        with tpde.Checkpointer(url, deltas_against=against) as ck:
            if ck.steps():
                ck.load()
            for _ in range(steps):
                step, state = next(states)
                saved[step] = copy.deepcopy(state)
                assert not ck.save(step, state).keyframe or step == 0
            assert ck.chain.deltas_against() == against
            assert tpde.chain.Chain(url).deltas_against() == against
    reader = tpde.Checkpointer(url)
    for s, state in saved.items():
        assert_same(state, reader.load(s))
    assert max(decode_depths(reader.chain, 8).values()) <= 1


def test_a_writer_codes_each_tensor_as_it_last_chose_until_that_is_due(tmp_path,
                                                                         monkeypatch) -> None:
    """The full choice between codings (made on samples for a large tensor) runs at the first
    delta, then again only every REVALIDATE deltas; a re-key does not reset it."""
    sampled: list[int] = []
    sample_starts = weigh.sample_starts
    monkeypatch.setattr(weigh, "sample_starts",
                        lambda *a: sampled.append(step) or sample_starts(*a))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300_000, generator=g)
    ck = tpde.Checkpointer(str(tmp_path / "run"), keyframe_every=4)
    saved, chose = [], []
    for step in range(2 * tpde.codec.encoder.REVALIDATE + 4):
        w = w * (1 + 1e-4 * torch.randn(w.shape, generator=g))
        saved.append(w.clone())
        ck.save(step, {"w": w})
        chose.append(step in sampled)
    keyed = [s for s in range(len(saved)) if ck.chain.manifest(s).keyframe]
    assert keyed[:2] == [0, 4]  # re-keyed on the way
    deltas = [s for s in range(len(saved)) if s not in keyed]
    # the first delta, and the one after REVALIDATE deltas coded with its choice
    assert [s for s, c in enumerate(chose) if c] == [deltas[0],
                                                     deltas[encoder.REVALIDATE + 1]]
    reader = tpde.Checkpointer(str(tmp_path / "run"))
    for step, want in enumerate(saved):
        assert torch.equal(reader.load(step)["w"], want)


def test_resumed_writer_continues_with_a_delta(store_url) -> None:
    url, opts = store_url
    states = dict(train_states(3))
    with tpde.Checkpointer(url, storage_options=opts) as first:
        first.save(0, states[0])
    resumed = tpde.Checkpointer(url, storage_options=opts)
    resumed.load()
    info = resumed.save(1, {"model": states[0]["model"], "optimizer": states[0]["optimizer"], "step": 0})
    assert not info.keyframe and info.codecs.get("same", 0) > 0
    assert resumed.chain.manifest(1).parent == 0
    resumed.close()
    fresh = tpde.Checkpointer(url, storage_options=opts)
    assert fresh.save(2, states[2]).keyframe  # no load(): nothing to code against


def test_a_loaded_state_trained_in_place_saves_as_a_delta_of_what_was_loaded(tmp_path) -> None:
    """load() hands back the restored tensors themselves, pieces included; the next save codes
    against the loaded step as the chain holds it, not against the changed tensors."""
    run = str(tmp_path / "r")
    w = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    with tpde.Checkpointer(run, max_inflight_bytes=1 << 20) as first:  # in pieces of 512 KiB
        first.save(0, {"w": w, "n": 0})
    resumed = tpde.Checkpointer(run, max_inflight_bytes=1 << 20)
    state = resumed.load()
    state["w"][::7] += 1.0  # training changes the restored tensor in place
    state["n"] = 1
    expected = copy.deepcopy(state)
    info = resumed.save(1, state)
    resumed.close()
    assert not info.keyframe and info.codecs.get("sparse", 0) > 0
    assert_same(expected, tpde.Checkpointer(run).load(1))
    assert_same({"w": w, "n": 0}, tpde.Checkpointer(run).load(0))


def test_committed_steps_are_immutable(tmp_path) -> None:
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(1, {"w": torch.ones(3)})
    with pytest.raises(tpde.StepExistsError):
        ck.save(1, {"w": torch.zeros(3)})
    with pytest.raises(tpde.StepNotFoundError):
        ck.load(2)
    with pytest.raises(tpde.NotARunError):
        tpde.Checkpointer(str(tmp_path / "nothing")).load(0)


@settings(max_examples=8)
@given(st.lists(st.tuples(st.sampled_from(["sparse", "dense", "frozen", "remove", "gc"]),
                          st.integers(0, 2**16)), min_size=20, max_size=20),
       st.integers(1, 6))
def test_twenty_step_chains_with_updates_removals_and_keyframes(tmp_path_factory, ops, every) -> None:
    url = f"memory://tpde-prop/{os.urandom(6).hex()}"
    ck = tpde.Checkpointer(url, keyframe_every=every)
    g = torch.Generator().manual_seed(len(ops))
    state = {"w": torch.randn(64, 64, generator=g).bfloat16(), "f": torch.randn(500, generator=g),
             "i": torch.arange(100), "n": 0}
    expected: dict[int, dict] = {}
    for step, (op, seed) in enumerate(ops):
        g.manual_seed(seed)
        if op == "sparse":
            idx = torch.randint(0, 4096, (40,), generator=g)
            state["w"].view(-1)[idx] += 1
        elif op == "dense":
            state["f"] += 1e-3 * torch.randn(500, generator=g)
        elif op == "remove" and expected:
            victim = sorted(expected)[seed % len(expected)]
            ck.remove(victim)
            del expected[victim]
        elif op == "gc" and expected:
            ck.gc(grace_seconds=0)
        state["n"] = step
        ck.save(step, state)
        expected[step] = copy.deepcopy(state)
    reader = tpde.Checkpointer(url)
    assert reader.steps() == sorted(expected)
    for step, st_ in expected.items():
        assert_same(st_, reader.load(step))
    ck.gc(grace_seconds=0)
    for step, st_ in expected.items():
        assert_same(st_, tpde.Checkpointer(url).load(step))


@settings(max_examples=10)
@given(st.lists(st.tuples(st.sampled_from(["again", "some", "all"]), st.integers(0, 2**16)),
                min_size=2, max_size=10),
       st.integers(2, 6), st.booleans())
def test_pieces_told_unchanged_on_the_writing_thread_get_the_records_the_encode_threads_give(
        ops, every, in_pieces) -> None:
    """A step saved again (Lightning's ``last``) has its small pieces compared on the writing
    thread, without a task: its manifests are those of the same run saved with every piece
    coded on the encode threads."""
    from tpde.chain import save as step_save

    runs = {}
    for told in (True, False):
        g = torch.Generator().manual_seed(len(ops))
        state = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(300_000, generator=g),
                 "e": torch.randn(20000, 64, generator=g).bfloat16(), "i": torch.arange(100),
                 "n": 0}
        url = f"memory://tpde-told/{os.urandom(6).hex()}"
        limit = step_save.UNCHANGED_BYTES
        step_save.UNCHANGED_BYTES = limit if told else -1
        try:
            ck = tpde.Checkpointer(url, keyframe_every=every,
                                   max_inflight_bytes=(2 << 20) if in_pieces else (256 << 20))
            saved = {}
            for step, (op, seed) in enumerate(ops):
                g.manual_seed(seed)
                if op in ("some", "all"):
                    state["w"] = state["w"] + 1e-3 * torch.randn(64, 64, generator=g)
                if op == "all":
                    state["b"] = state["b"] * 1.001
                    state["e"].view(-1)[torch.randint(0, 20000 * 64, (50,), generator=g)] += 1
                    state["n"] = step
                ck.save(step, state)
                saved[step] = copy.deepcopy(state)
            ck.close()
        finally:
            step_save.UNCHANGED_BYTES = limit
        reader = tpde.Checkpointer(url)
        for step, want in saved.items():
            assert_same(want, reader.load(step))
        runs[told] = [(m.keyframe, m.depth, m.parent,
                       [(r.name, r.codec, r.ref, r.hash, r.residual, r.count, r.start)
                        for r in m.records])
                      for m in (reader.chain.manifest(s) for s in reader.steps())]
    assert runs[True] == runs[False]


@pytest.mark.parametrize("against", ["previous", "keyframe"])
def test_pieces_coded_together_get_the_records_they_get_coded_alone(against: str,
                                                                   monkeypatch) -> None:
    """A save codes its small keyframes and dense deltas in batches (``encoder.encode_many``):
    its manifests and restored steps are those of the same run with every piece coded alone."""
    runs = {}
    for together in (True, False):
        monkeypatch.setattr(encoder, "MANY_BYTES", 1 << 20 if together else 0)
        g = torch.Generator().manual_seed(3)
        state = {f"w{k}": torch.randn(64, 32 * (k + 1), generator=g) for k in range(6)}
        state |= {"b": torch.randn(300_000, generator=g), "i": torch.arange(500),
                  "h": torch.randn(5000, generator=g).bfloat16(), "s": torch.zeros(40_000)}
        url = f"memory://tpde-together/{os.urandom(6).hex()}"
        ck = tpde.Checkpointer(url, deltas_against=against, keyframe_every=4)
        saved = {}
        for step in range(7):
            for k in range(6):
                state[f"w{k}"] = state[f"w{k}"] - 1e-3 * torch.randn(state[f"w{k}"].shape,
                                                                      generator=g)
            state["b"] = state["b"] * 1.0001
            state["h"] = state["h"] + 0.01
            state["s"][torch.randint(0, 40_000, (30,), generator=g)] += 1
            ck.save(step, state)
            saved[step] = copy.deepcopy(state)
        ck.close()
        reader = tpde.Checkpointer(url)
        for step, want in saved.items():
            assert_same(want, reader.load(step))
        runs[together] = [[(r.name, r.codec, r.ref, r.hash, r.residual, r.count,
                            r.stored_bytes) for r in m.records]
                          for m in (reader.chain.manifest(s) for s in reader.steps())]
    assert runs[True] == runs[False]
    assert {r[1] for m in runs[True] for r in m} >= {"key", "dense", "sparse"}


def sparse_states(steps: int):
    """bf16 weights with a few updates per step: every non-keyframe step is a real delta."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 128, generator=g).bfloat16()
    for step in range(steps):
        w.view(-1)[torch.randint(0, w.numel(), (50,), generator=g)] += 1
        yield step, {"w": w, "step": step}


def test_remove_rebases_what_reads_the_step_and_frees_it(tmp_path) -> None:
    url = str(tmp_path / "r")
    ck = tpde.Checkpointer(url, keyframe_every=2)
    states = {}
    for step, state in sparse_states(4):
        states[step] = copy.deepcopy(state)
        assert ck.save(step, state).keyframe == (step % 2 == 0)
    report = ck.remove(0)  # step 1 is a delta against 0: it is re-based first
    assert report.purged_steps == [0] and report.rebased_steps == [1] and report.freed_bytes > 0
    assert ck.chain.manifest(1).keyframe  # nothing older is kept to code it against
    assert_same(states[1], tpde.Checkpointer(url).load(1))
    report = ck.remove(1)
    assert report.purged_steps == [1] and report.rebased_steps == []  # step 2 is a keyframe
    assert ck.gc(grace_seconds=0).purged_steps == []
    assert ck.steps() == [2, 3]
    assert_same(states[3], tpde.Checkpointer(url).load(3))
    assert len(os.listdir(tmp_path / "r" / "data")) == 2


def test_a_step_removed_while_it_was_the_reference_goes_once_another_is_loaded(tmp_path) -> None:
    """``load(2); remove(2)`` keeps step 2 (the next delta would be coded against it); once
    ``load(4)`` makes step 4 the reference, nothing needs step 2, and its bytes go."""
    url = str(tmp_path / "r")
    with tpde.Checkpointer(url, keyframe_every=3) as ck:  # 0 key, 1, 2 deltas; 3 key, 4, 5
        for step, state in sparse_states(6):
            ck.save(step, state)
    held = tpde.Checkpointer(url).chain.at_rest().total
    ck = tpde.Checkpointer(url, keyframe_every=3)
    ck.load(2)
    assert ck.remove(2).purged_steps == []  # still the reference
    ck.load(4)
    assert 2 not in ck.chain.committed()  # purged: step 2 was needed by no step
    ck.close()
    rest = tpde.Checkpointer(url).chain.at_rest()
    assert rest.as_dict()["hidden_steps"] == [] and rest.total < held


def test_crash_leftovers_are_invisible_and_collected(tmp_path) -> None:
    url = str(tmp_path / "r")
    ck = tpde.Checkpointer(url)
    ck.save(0, {"w": torch.ones(10)})
    # What a save killed before its manifest leaves behind: a blob and a temporary manifest.
    (tmp_path / "r" / "data" / "00000000000000000001-deadbeef.tpd").write_bytes(b"partial")
    (tmp_path / "r" / "steps" / "00000000000000000001.json.x.tmp").write_bytes(b"{")
    assert ck.steps() == [0]
    assert ck.gc(grace_seconds=3600).deleted == []  # might belong to a save in progress
    report = ck.gc(grace_seconds=0)
    assert sorted(os.path.basename(p) for p in report.deleted) == [
        "00000000000000000001-deadbeef.tpd", "00000000000000000001.json.x.tmp"]
    ck.save(1, {"w": torch.zeros(10)})
    assert torch.equal(ck.load(1)["w"], torch.zeros(10))


def test_corruption_is_detected_and_named(tmp_path) -> None:
    url = str(tmp_path / "r")
    ck = tpde.Checkpointer(url, keyframe_every=10)
    for step, state in sparse_states(3):
        ck.save(step, state)
    blob = sorted(glob.glob(str(tmp_path / "r" / "data" / "*")))[1]
    raw = bytearray(open(blob, "rb").read())
    raw[len(raw) // 3] ^= 0x04
    open(blob, "wb").write(raw)
    problems = tpde.Checkpointer(url).verify()
    assert problems and all(p.step == 1 for p in problems)
    assert all("run" in p.message and "tensor" in p.message for p in problems)
    with pytest.raises(tpde.CorruptionError, match="step 1"):
        tpde.Checkpointer(url).load(2)
    tpde.Checkpointer(url).load(0)  # does not depend on the damaged blob

    manifest = tmp_path / "r" / "steps" / "00000000000000000000.json"
    text = zstandard.ZstdDecompressor().decompress(manifest.read_bytes())  # format 3: framed
    manifest.write_bytes(zstandard.ZstdCompressor().compress(text.replace(b'"step"', b'"stex"', 1)))
    with pytest.raises(tpde.FormatError, match="step 0"):
        tpde.Checkpointer(url).load(0)


def test_one_tensor_is_read_by_range_without_the_whole_blob(store_url) -> None:
    url, opts = store_url
    if opts is None and not url.startswith("memory://") and not os.path.exists("/proc/self/io"):
        pytest.skip("counts a local read's bytes in /proc/self/io")
    ck = tpde.Checkpointer(url, storage_options=opts)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(8)}
    ck.save(0, state)
    chain = tpde.Checkpointer(url, storage_options=opts).chain
    blob_size = chain.manifest(0).blob_size
    fetched: list[int] = []
    read_ranges = chain.store.read_ranges

    def counting(rel, ranges):
        out = read_ranges(rel, ranges)
        fetched.extend(len(b) for b in out)
        return out

    chain.store.read_ranges = counting  # count what the store layer fetches
    read_before = _bytes_read()
    words = chain.materialize(0, names=["layer3"])
    assert torch.equal(words["layer3"].view(torch.float32).reshape(256, 256), state["layer3"])
    if chain.store.local:  # read by the native rebuild a frame at a time, from a descriptor
        fetched.append(_bytes_read() - read_before)
    assert 0 < sum(fetched) < blob_size / 4


def _bytes_read() -> int:
    """The bytes this process has read through system calls (``rchar``): a local run's frames
    are read by C code, past any Python wrapper."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


@given(st.lists(st.integers(0, 3 << 20), max_size=40))
def test_a_decode_hands_records_to_its_pool_in_runs_and_gets_them_back_in_order(sizes) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tpde.chain import decode

    handed: list[int] = []

    def run(fn, runs):
        runs = list(runs)
        handed.extend(len(r) for r in runs)
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(fn, runs))

    jobs = [(i, n) for i, n in enumerate(sizes)]
    assert decode.in_runs(run, lambda i, n: (i, n * 2), jobs, sizes) == [(i, n * 2) for i, n in jobs]
    assert sum(handed) == len(jobs)
    # Small neighbours share a task; a task of several holds at most TASK_BYTES.
    assert len(handed) <= len(jobs)
    if sizes and max(sizes) <= decode.TASK_BYTES // 4 and sum(sizes) <= decode.TASK_BYTES:
        assert handed == [len(jobs)]


BLOB = bytes(range(256)) * 1200  # 300 KiB, every offset's byte known


@given(spans=st.lists(st.tuples(st.integers(0, len(BLOB)), st.integers(0, 90_000)),
                      min_size=1, max_size=30))
def test_read_ranges_gives_every_range_and_merges_neighbours(spans) -> None:
    """Ranges in any order, overlapping, touching, far apart or empty: each comes back exact,
    and ranges within the coalescing gap of each other cost one request."""
    s = store.Store("memory://tpde-ranges")
    s.put_atomic("blob", BLOB)
    ranges = [(a, min(len(BLOB), a + n)) for a, n in spans]
    asked: list[int] = []
    cat_ranges = s.fs.cat_ranges

    def counting(paths, starts, ends, **kw):
        asked.append(len(paths))
        return cat_ranges(paths, starts, ends, **kw)

    s.fs.cat_ranges = counting
    try:
        got = s.read_ranges("blob", ranges)
    finally:
        s.fs.cat_ranges = cat_ranges
    assert [bytes(g) for g in got] == [BLOB[a:b] for a, b in ranges]
    ordered = sorted((a, b) for a, b in ranges if b > a)  # an empty range is no request
    apart = sum(b_start > a_end + store.COALESCE_GAP for (_, a_end), (b_start, _)
                in zip(ordered, ordered[1:]))
    assert sum(asked) <= (1 + apart + sum(b - a for a, b in ranges) // store.COALESCE_SPAN
                          if ordered else 0)


def test_empty_ranges_read_alone_are_empty_on_every_store(store_url) -> None:
    """An empty tensor's section, read with nothing beside it (a restore whose other tensors
    were rebuilt natively): no bytes, where S3 answers a request for none with the whole
    object."""
    url, options = store_url
    s = store.Store(url, options)
    s.put_atomic("blob", BLOB[:1000])
    assert [bytes(g) for g in s.read_ranges("blob", [(169, 169)])] == [b""]
    assert [bytes(g) for g in s.read_ranges("blob", [(5, 5), (7, 9)])] == [b"", BLOB[7:9]]


def test_large_local_reads_are_mapped_and_stay_exact(tmp_path) -> None:
    """Local reads of ``MAP_BYTES`` and more are views of the mapped file: the same bytes as a
    copy, still readable once the file is deleted (a gc while a restore reads), and a range
    past a truncated file's end is an error, not short data."""
    s = store.Store(str(tmp_path / "run"))
    data = np.random.default_rng(0).integers(0, 256, 3 * store.MAP_BYTES, dtype=np.uint8).tobytes()
    s.put_atomic("blob", data)
    whole = s.read("blob", len(data))
    ranges = [(0, 10), (store.MAP_BYTES, 2 * store.MAP_BYTES + 7), (len(data) - 5, len(data))]
    parts = s.read_ranges("blob", ranges)
    assert isinstance(whole, memoryview) and all(isinstance(p, memoryview) for p in parts)
    s.delete("blob")
    assert bytes(whole) == data and [bytes(p) for p in parts] == [data[a:b] for a, b in ranges]
    s.put_atomic("short", data[: store.MAP_BYTES])
    with pytest.raises(tpde.StoreError, match="shorter than its manifest says"):
        s.read_ranges("short", [(0, store.MAP_BYTES + 1)])
    assert bytes(s.read_ranges("short", [(1, 3)])[0]) == data[1:3]  # small: copied


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_a_decode_keeps_the_files_it_reads_frame_by_frame_open(tmp_path) -> None:
    """Within ``kept_open`` a thread reads each local file through one descriptor, closed at
    the end of the block; a blob deleted meanwhile still reads as it was; other threads keep
    nothing; a range past the end is an error, not short data."""
    s = store.Store(str(tmp_path / "run"))
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    s.put_atomic("a", data)
    s.put_atomic("b", data[::-1])

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_files()
    with s.kept_open():
        assert bytes(s.read_range("a", 10, 20)) == data[10:20]
        assert bytes(s.read_ranges("a", [(0, 5), (300, 400)])[1]) == data[300:400]
        assert open_files() == before + 1
        s.delete("a")
        assert bytes(s.read_range("a", 100, 300)) == data[100:300]
        with s.kept_open():  # nested: the same descriptors
            assert bytes(s.read_range("b", 0, 8)) == data[::-1][:8]
        assert open_files() == before + 2
        elsewhere: list[bytes] = []
        other = threading.Thread(target=lambda: elsewhere.append(bytes(s.read_range("b", 1, 9))))
        other.start()
        other.join()
        assert elsewhere == [data[::-1][1:9]] and open_files() == before + 2
        with pytest.raises(tpde.StoreError, match="shorter than its manifest says"):
            s.read_range("b", 4000, 5000)
    assert open_files() == before
    with pytest.raises(FileNotFoundError):
        s.read_range("a", 0, 1)
    for k in range(store.KEPT_OPEN + 3):  # a step of many ranks' blobs: at most so many kept
        s.put_atomic(f"rank{k}", data)
    with s.kept_open():
        for k in range(store.KEPT_OPEN + 3):
            assert bytes(s.read_range(f"rank{k}", k, k + 3)) == data[k : k + 3]
        assert open_files() == before + store.KEPT_OPEN
    assert open_files() == before


def test_a_local_blob_is_handed_to_the_disk_as_it_is_written(tmp_path, monkeypatch) -> None:
    """Every WRITEBACK_BYTES a local blob's new bytes are handed to the disk (where the OS
    can be asked to): ranges that follow each other from the start, of flushed bytes, and a
    step that restores exactly."""
    if blob._WRITEBACK is None:
        pytest.skip("no sync_file_range here")
    handed: list[tuple[int, int]] = []
    real = blob._WRITEBACK

    def record(fd: int, offset: int, length: int) -> int:
        assert os.fstat(fd).st_size >= offset + length  # flushed before it is handed over
        handed.append((offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(blob, "_WRITEBACK", record)
    monkeypatch.setattr(blob, "WRITEBACK_BYTES", 1 << 16)
    monkeypatch.setattr(blob, "WRITE_BUFFER", 1 << 15)  # frames reach the file this often
    ck = tpde.Checkpointer(str(tmp_path / "r"), chunk_bytes=4096)
    state = {"w": torch.randn(200_000, generator=torch.Generator().manual_seed(0))}
    ck.save(0, state)
    assert len(handed) > 5
    assert [o for o, _ in handed] == [0] + list(itertools.accumulate(n for _, n in handed))[:-1]
    assert all(n >= 1 << 16 for _, n in handed)
    assert torch.equal(tpde.Checkpointer(str(tmp_path / "r")).load(0)["w"], state["w"])


def test_unstorable_value_is_refused_before_anything_is_written(tmp_path) -> None:
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    ck.save(0, {"w": torch.ones(1000)})
    with pytest.raises(tpde.UnsupportedError, match="cfg/fn"):
        ck.save(1, {"w": torch.ones(1000), "cfg": {"fn": lambda x: x}})
    assert ck.steps() == [0]
    assert not ck.save(1, {"w": torch.ones(1000)}).keyframe  # the writer kept its reference


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_refused_with_what_to_store_instead(tmp_path, layout) -> None:
    ck = tpde.Checkpointer(str(tmp_path / "r"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(tpde.UnsupportedError, match=r"nested tensor at 'opt/x'.*unbind\(\)"):
        ck.save(0, {"w": torch.ones(4), "opt": {"x": nested}})
    assert ck.steps() == []


def test_a_store_failure_mid_save_leaves_nothing_visible(store_url, monkeypatch) -> None:
    url, opts = store_url
    ck = tpde.Checkpointer(url, storage_options=opts, chunk_bytes=4096)
    ck.save(0, {"w": torch.ones(10_000)})
    original_init = store.BlobWriter.__init__

    class FillingDisk:
        """The blob's file object, refusing writes after the second as a full disk does."""

        def __init__(self, f) -> None:
            self.f, self.writes = f, 0

        def write(self, data) -> int:
            self.writes += 1
            if self.writes > 2:
                raise OSError(28, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def init(self, *args) -> None:
        original_init(self, *args)
        self._f = FillingDisk(self._f)

    def full(fd: int, parts: list) -> int:
        raise OSError(28, "No space left on device")

    if "://" in url:  # an object store's multipart writer
        monkeypatch.setattr(store.BlobWriter, "__init__", init)
    else:  # a local blob's frames go to its file in one writev, at the latest on close
        monkeypatch.setattr(store.os, "writev", full)
    with pytest.raises(tpde.StoreError, match="No space left"):
        ck.save(1, {"w": torch.randn(10_000), "v": torch.randn(10_000)})
    monkeypatch.undo()
    assert ck.steps() == [0]
    assert ck.save(1, {"w": torch.zeros(10_000)}).keyframe  # the reference went with the failure
    ck.gc(grace_seconds=0)
    reader = tpde.Checkpointer(url, storage_options=opts)
    assert reader.verify() == [] and torch.equal(reader.load(0)["w"], torch.ones(10_000))


def _load_in_child(run: str, step: int) -> list[float]:
    torch.set_num_threads(1)  # as DataLoader workers do: OpenMP's threads do not survive a fork
    return tpde.Checkpointer(run).load(step)["w"].reshape(-1)[:4].tolist()


def test_a_forked_child_restores_after_its_parent_did(tmp_path) -> None:
    """Decode threads are made once per process; a forked child (a DataLoader worker) cannot
    use its parent's, which do not exist there."""
    import multiprocessing

    run = str(tmp_path / "run")
    w = torch.arange(100_000, dtype=torch.float32)
    with tpde.Checkpointer(run) as ckpt:
        ckpt.save(0, {"w": w})
        ckpt.save(1, {"w": w + 1})
    assert tpde.Checkpointer(run).load(1)["w"][0] == 1  # the parent's threads now exist
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_load_in_child, (run, 1)).get(timeout=60) == [1.0, 2.0, 3.0, 4.0]


BAD_SETTINGS = [("threads", 0), ("threads", -1), ("threads", 1.5), ("chunk_bytes", 0),
                ("chunk_bytes", -5), ("chunk_bytes", 32 << 20), ("max_inflight_bytes", 0),
                ("max_inflight_bytes", -1), ("level", 99), ("level", 1.5),
                ("lease_seconds", 0), ("lease_seconds", -1), ("lease_seconds", float("nan")),
                ("keyframe_every", 0), ("keyframe_every", 2.5), ("reference", "disk"),
                ("deltas_against", "parent"), ("key_margin", 0), ("key_margin", -0.5),
                ("key_margin", 1.01), ("key_margin", float("nan"))]


@pytest.mark.parametrize("name,value", BAD_SETTINGS)
def test_settings_a_save_cannot_use_are_refused_before_anything_is_written(tmp_path, name,
                                                                            value) -> None:
    """At construction, naming the setting, by every front end alike: a chunk of 0 divided
    by zero at the first save, a negative thread count failed there, a ``max_inflight_bytes``
    of 0 stored every float of a tensor as a record of its own, and a key margin above 1
    could store a delta larger than its keyframe."""
    run = tmp_path / "r"
    for make in (lambda **o: tpde.Checkpointer(str(run), **o),
                 lambda **o: tpde.dcp.Writer(str(run), 0, **o),
                 lambda **o: tpde.TPDECheckpointIO(**o)):
        with pytest.raises(ValueError, match=name):
            make(**{name: value})
    assert not run.exists()


def test_every_front_end_takes_the_same_settings_with_the_same_defaults(tmp_path) -> None:
    from tpde.chain.options import SaveOptions

    run = str(tmp_path / "r")
    assert tpde.Checkpointer(run).options == SaveOptions() == tpde.TPDECheckpointIO().options
    writer = tpde.dcp.Writer(run, 0)
    assert writer.reference == SaveOptions().reference and \
        writer.keyframe_every == SaveOptions().keyframe_every
    given = {"keyframe_every": 4, "level": 5, "chunk_bytes": 1 << 16, "threads": 2,
             "key_margin": 0.5, "reference": "store", "max_inflight_bytes": 1 << 20,
             "lease_seconds": 30.0}
    assert tpde.Checkpointer(run, **given).options == SaveOptions(**given) == \
        tpde.TPDECheckpointIO(**given).options
    assert tpde.Checkpointer(run, **given).options.given() == given
    for make in (lambda **o: tpde.Checkpointer(run, **o), lambda **o: tpde.dcp.Writer(run, 0, **o),
                 lambda **o: tpde.TPDECheckpointIO(**o)):
        with pytest.raises(TypeError, match="unknown setting.*keyframes_every.*keyframe_every"):
            make(keyframes_every=4)
    # Sharded steps are lossless and coded against the step before: said at once.
    with pytest.raises(ValueError, match="error_bound and deltas_against"):
        tpde.dcp.Writer(run, 0, error_bound={"*": tpde.Rel(1e-3)})
    with pytest.raises(ValueError, match="error_bound and deltas_against"):
        tpde.dcp.Writer(run, 0, deltas_against="keyframe")
    assert not (tmp_path / "r").exists()


def test_a_saved_object_only_a_trusted_load_reads_is_named_at_save_time(tmp_path) -> None:
    run = str(tmp_path / "run")
    state = {"w": torch.ones(3), "arr": np.arange(3), "net": {"layer": torch.nn.Linear(2, 2)},
             "plain": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"}}
    with tpde.Checkpointer(run) as ck, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ck.save(0, state)
        ck.save(1, state)  # said once a run and object, not at every save
    told = [str(w.message) for w in said if w.category is tpde.UnsafeContentWarning]
    assert len(told) == 2, told
    assert "step 0: 'arr'" in told[0] and "numpy" in told[0] and "trusted=True" in told[0]
    assert "'net/layer'" in told[1] and "torch.nn.modules.linear.Linear" in told[1]
    with pytest.raises(tpde.UnsafeContentError):  # as the warning said
        tpde.Checkpointer(run).load(1)
    back = tpde.Checkpointer(run).load(1, trusted=True)
    assert np.array_equal(back["arr"], state["arr"])
    with tpde.Checkpointer(str(tmp_path / "clean")) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # plain data is stored without a word
        ck.save(0, {"w": torch.ones(3), "plain": state["plain"]})
