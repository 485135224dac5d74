"""Retention-aware chains: removing steps re-bases what reads them, and a run never holds more
than its visible steps would cost stored as keyframes (docs/format.md, "Bytes at rest")."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpde
from helpers import assert_same, decode_depths
from tpde.chain import Chain
from tpde.chain.read import Reader
from tpde.chain.plan import Candidate, plan_keys, plan_rebase

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def on_disk(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def keyframe_cost(state: dict, folder: str) -> int:
    """The blob of ``state`` saved alone as a keyframe, with the same codec settings."""
    with tpde.Checkpointer(folder, keyframe_every=1, chunk_bytes=4096) as ck:
        ck.save(0, state)
        return ck.chain.manifest(0).blob_size


class Run:
    """A real run driven by random operations, with the states it should hold."""

    def __init__(self, root: str, kinds: list[tuple[str, torch.dtype]], keyframe_every: int,
                 seed: int, deltas_against: str = "previous") -> None:
        self.url, self.root = os.path.join(root, "run"), root
        self.g = torch.Generator().manual_seed(seed)
        self.keyframe_every = keyframe_every
        self.deltas_against = deltas_against
        self.ck = self._writer()
        self.tensors = {f"t{i}": self._fresh(dt, 64 + 700 * i) for i, (_, dt) in enumerate(kinds)}
        self.kinds = {f"t{i}": kind for i, (kind, _) in enumerate(kinds)}
        self.expected: dict[int, dict] = {}
        self.cost: dict[int, int] = {}
        self.deferred: set[int] = set()  # removed with defer=True since the last gc or reopen
        self.next = 0

    def _fresh(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(n, generator=self.g).to(dtype)
        return torch.randint(-1000, 1000, (n,), generator=self.g, dtype=dtype)

    def save(self, again: bool = False) -> None:
        """A new step; ``again``: every tensor as at the step before (Lightning's `last`)."""
        for name, t in [] if again else self.tensors.items():
            kind = self.kinds[name]
            if kind == "sparse":
                at = torch.randint(0, t.numel(), (3,), generator=self.g)
                t[at] = self._fresh(t.dtype, 3)
            elif kind == "dense" or (kind == "repeat" and self.next % 2):  # every other save
                t.copy_(t + self._fresh(t.dtype, t.numel()) * (1e-3 if t.is_floating_point() else 1))
        state = {name: t.clone() for name, t in self.tensors.items()} | {"step": self.next}
        info = self.ck.save(self.next, state)
        assert info.run_bytes == on_disk(self.url)
        self.expected[self.next] = state
        self.cost[self.next] = keyframe_cost(state, os.path.join(self.root, f"key{self.next}"))
        self.next += 1

    def remove(self, pick: int, defer: bool = False) -> None:
        visible = self.ck.steps()
        if visible:
            step = visible[pick % len(visible)]
            self.ck.remove(step, defer=defer)
            del self.expected[step]
            self.deferred.add(step) if defer else self.deferred.clear()

    def gc(self) -> None:
        self.ck.gc(grace_seconds=0)
        self.deferred.clear()

    def reopen(self) -> None:
        """A new writer on the run, resumed from its latest step (fresh caches)."""
        self.ck.close()
        self.deferred.clear()
        self.ck = self._writer()
        if self.ck.steps():
            self.ck.load()

    def _writer(self) -> tpde.Checkpointer:
        return tpde.Checkpointer(self.url, keyframe_every=self.keyframe_every, chunk_bytes=4096,
                                 deltas_against=self.deltas_against)

    def check(self) -> None:
        chain = Chain(self.url)  # a reader of its own: nothing cached from the writer
        assert chain.steps() == sorted(self.expected) if chain.is_run() else not self.expected
        for step, state in self.expected.items():
            assert_same(state, chain.load(step)[0], f"step {step}")
            deepest = max(decode_depths(chain, step).values())
            assert deepest < self.keyframe_every
            # Against keyframes every record stays one delta deep, through re-bases too.
            assert self.deltas_against == "previous" or deepest <= 1, decode_depths(chain, step)
        if not chain.is_run():
            return
        rest = chain.at_rest()
        assert rest.total == on_disk(self.url)
        assert rest.plain == sum(t.nbytes for state in self.expected.values()
                                 for t in state.values() if isinstance(t, torch.Tensor))
        ref = self.ck._reference.step if self.ck._reference else None
        # Hidden steps hold bytes as the writer's reference, or as deferred removals while the
        # run holds no more than the plain format's files of its visible steps.
        held = set(rest.hidden) - {ref}
        assert held <= self.deferred, rest.as_dict()
        assert not held or rest.total + rest.largest <= rest.plain, rest.as_dict()
        manifests = sum(os.path.getsize(os.path.join(self.url, "steps", f"{s:020d}.json"))
                        for s in self.expected)
        bound = sum(self.cost[s] for s in self.expected) + manifests + rest.other \
            + sum(rest.hidden.values())
        assert rest.total <= bound, (rest.as_dict(), bound)

    def drive(self, ops: list[tuple]) -> None:
        """A first save, then ``ops``, each checked; then the writer closed and checked."""
        for op in [("save",)] + ops:
            if op[0] in ("save", "again"):
                self.save(again=op[0] == "again")
            elif op[0] == "remove":
                self.remove(op[1], defer=op[2])
            elif op[0] == "gc":
                self.gc()
            else:
                self.reopen()
            self.check()
        self.ck.close()
        self.check()


OPS = st.one_of(st.just(("save",)), st.just(("again",)), st.just(("gc",)), st.just(("reopen",)),
                st.tuples(st.just("remove"), st.integers(0, 50), st.booleans()))


@given(kinds=st.lists(st.tuples(st.sampled_from(["frozen", "sparse", "dense", "repeat"]),
                                st.sampled_from(DTYPES)), min_size=1, max_size=3),
       ops=st.lists(OPS, min_size=1, max_size=14),
       keyframe_every=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_any_sequence_keeps_visible_steps_exact_and_bytes_bounded(kinds, ops, keyframe_every,
                                                                  seed) -> None:
    with tempfile.TemporaryDirectory() as root:
        Run(root, kinds, keyframe_every, seed).drive(ops)


@given(kinds=st.lists(st.tuples(st.sampled_from(["frozen", "sparse", "dense", "repeat"]),
                                st.sampled_from(DTYPES)), min_size=1, max_size=3),
       ops=st.lists(OPS, min_size=3, max_size=16),
       keyframe_every=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_deltas_against_keyframes_stay_one_deep_and_exact_through_any_sequence(
        kinds, ops, keyframe_every, seed) -> None:
    """As above, with each delta coded against its tensor's keyframe record: removals re-base
    kept steps, the writer goes on from keyframes re-based away, and no restore decodes more
    than one delta of a tensor."""
    with tempfile.TemporaryDirectory() as root:
        Run(root, kinds, keyframe_every, seed, deltas_against="keyframe").drive(ops)


@given(kinds=st.lists(st.tuples(st.sampled_from(["frozen", "sparse", "dense", "repeat"]),
                                st.sampled_from(DTYPES)), min_size=1, max_size=3),
       rounds=st.lists(st.tuples(st.integers(0, 50), st.booleans(), st.booleans()),
                       min_size=2, max_size=6),
       keyframe_every=st.integers(1, 6), seed=st.integers(0, 2**16),
       deltas_against=st.sampled_from(["previous", "keyframe"]))
def test_a_retention_policy_keeps_its_kept_steps_exact(kinds, rounds, keyframe_every, seed,
                                                       deltas_against) -> None:
    """As a Lightning run with ``save_top_k`` and ``save_last`` saves and removes: a new
    checkpoint, the same state again as `last`, and the removal of the `last` before it or of
    a checkpoint that fell out of the top k."""
    ops: list[tuple] = []
    for pick, defer, last in rounds:
        ops += [("save",), ("again",), ("remove", -3 if last else pick, defer)]
    with tempfile.TemporaryDirectory() as root:
        Run(root, kinds, keyframe_every, seed, deltas_against=deltas_against).drive(ops)


def test_each_save_reports_the_bytes_the_run_holds(tmp_path) -> None:
    """A writer counts the run's bytes once and adds what each save writes; after a renewal of
    its lease, a re-base, a purge or a deleted leftover, it counts them again."""
    url = str(tmp_path / "run")
    ck = tpde.Checkpointer(url, lease_seconds=1.0)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(5000, generator=g), "b": torch.zeros(10)}
    saved = {}

    def save(step: int) -> None:
        state["w"][step * 7 % 5000] += 1.0
        assert ck.save(step, state).run_bytes == on_disk(url), step
        saved[step] = {k: t.clone() for k, t in state.items()}

    def renewing(op: Callable[[], object]) -> None:
        """``op``, with the lease due for renewal (half its time gone), which ``op`` renews."""
        time.sleep(0.6)
        expires = ck.lease.current().expires
        op()
        assert ck.lease.current().expires > expires

    for step in range(4):
        save(step)
    renewing(lambda: save(4))
    save(5)
    ck.remove(2)  # 3 is re-based, 2 purged
    save(6)
    ck.chain.remove(6)  # the writer's reference, hidden by the chain itself: the next save
    save(7)  # re-bases off it and frees it
    ck.remove(7)
    save(7)  # the hidden step 7, which nothing needs, is purged to take its number again
    assert ck.chain.manifest(7).keyframe  # it was the reference: the new step 7 is a keyframe
    leftover = tmp_path / "run" / "data" / "left-over.tpd"
    leftover.write_bytes(b"x" * 1000)  # a killed save's, counted by the save that renews
    renewing(lambda: save(8))  # a fresh lease: the gc below does not renew it
    ck.gc(grace_seconds=0)
    assert not leftover.exists()
    save(9)
    renewing(ck.next_step)  # between two saves
    save(10)
    ck.close()
    assert_same(tpde.Checkpointer(url).load(7), saved[7])


def test_a_frozen_tensor_is_stored_once_for_the_life_of_the_run(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    base, adapter = torch.randn(50_000, generator=g), torch.zeros(500)
    with tpde.Checkpointer(str(tmp_path / "r"), keyframe_every=4) as ck:
        for step in range(48):
            adapter += torch.randn(500, generator=g) * 1e-2
            ck.save(step, {"base": base, "adapter": adapter})
        holders = [s for s in ck.steps() if ck.chain.manifest(s).record("base").codec != "same"]
        assert holders == [0]
        ck.remove(*range(0, 40))  # the base's keyframe moves to the oldest kept step, once
        holders = [s for s in ck.steps() if ck.chain.manifest(s).record("base").codec != "same"]
        assert holders == [40] and ck.chain.manifest(40).record("base").codec == "key"
        assert torch.equal(tpde.load_checkpoint(str(tmp_path / "r"), 47)["base"], base)


def test_a_reader_holding_old_manifests_reads_on_through_a_rebase(tmp_path) -> None:
    url = str(tmp_path / "r")
    states = {}
    with tpde.Checkpointer(url, keyframe_every=8) as ck:
        w = torch.randn(4000)
        for step in range(4):
            w[step * 10] += 1
            states[step] = {"w": w.clone()}
            ck.save(step, states[step])
        reader = Chain(url)
        reader.manifest(3), reader.manifest(2), reader.manifest(1)  # cached before the re-base
        report = ck.remove(1, 2)  # step 3 is rewritten, its old blob and steps 1, 2 deleted
        assert report.rebased_steps == [3] and report.purged_steps == [1, 2]
    assert_same(states[3], reader.load(3)[0])


def test_rebased_steps_stay_named_by_their_checkpoint_entries(tmp_path) -> None:
    """Entries name a step by the blob it was first written to; a re-base keeps that name."""
    url = str(tmp_path / "r")
    w = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    with tpde.Checkpointer(url) as ck:
        for step in range(3):
            w[step] += 1
            ck.save(step, {"w": w, "frozen": torch.ones(2000)})
        first = ck.chain.manifest(2).id
        ck.remove(1)  # step 2's delta read step 1: re-coded into a new blob
        m = ck.chain.manifest(2)
        assert m.id == first and m.blob != first and m.format == 6
    from tpde.entries import entry

    entry.check(Chain(url), 2, first, "the entry")  # does not raise: the same step


# ---------------------------------------------------------------- the plans, without a store
def test_keyframes_spread_over_steps_and_keep_their_period() -> None:
    k, names = 16, [f"layer{i}.weight" for i in range(64)]
    depth: dict[str, int | None] = {n: None for n in names}
    synced = dict.fromkeys(names, False)
    keyed_per_step = []
    for _ in range(160):
        keyed = plan_keys([Candidate(n, depth[n], synced[n]) for n in names], k)
        everything = len(keyed) == len(names)
        for n in names:  # every tensor changes every step
            if n in keyed:
                depth[n], synced[n] = 0, everything
            else:
                depth[n] = depth[n] + 1  # type: ignore[operator]
            assert depth[n] < k
        keyed_per_step.append(len(keyed))
    assert keyed_per_step[0] == 64
    assert max(keyed_per_step[k:]) <= 64 // 4  # spread: never a whole keyframe again
    assert sum(keyed_per_step[-8 * k:]) == 8 * 64  # and each tensor keyed once per period


def test_the_rebase_plan_reads_only_from_kept_steps(tmp_path) -> None:
    url = str(tmp_path / "r")
    with tpde.Checkpointer(url, keyframe_every=16) as ck:
        w = torch.randn(3000)
        for step in range(6):
            w[step] += 1
            ck.save(step, {"w": w.clone(), "frozen": torch.arange(100)})
    chain = Chain(url)
    plan = dict(plan_rebase(chain.manifests(), {0, 3, 5}))
    # 3 read 2: re-coded against 0; 5 read 4: re-coded against 3; the frozen tensor reads 0.
    assert {(w.name, w.how, w.against) for w in plan[3]} == {("w", "recode", 0)}
    assert {(w.name, w.how, w.against) for w in plan[5]} == {("w", "recode", 3)}
    plan = dict(plan_rebase(chain.manifests(), {3, 5}))
    assert {(w.name, w.how) for w in plan[3]} == {("w", "recode"), ("frozen", "copy")}
    assert {(w.name, w.how, w.against) for w in plan[5]} == {("w", "recode", 3),
                                                              ("frozen", "same", 3)}


def test_a_rebuild_hands_over_the_earlier_steps_it_goes_through(tmp_path) -> None:
    """What a re-base codes against: an earlier step's words, taken on the way to a later
    step's where its lineage passes them (a copy, not the words that later deltas change), and
    nothing where it does not (a re-keyed tensor, or one whose data lies elsewhere)."""
    url = str(tmp_path / "r")
    with tpde.Checkpointer(url, keyframe_every=3) as ck:
        w, frozen = torch.randn(5000), torch.arange(100)
        for step in range(5):
            w = w + 1e-3 * torch.randn(5000)
            ck.save(step, {"w": w.clone(), "frozen": frozen})
    chain = Chain(url)
    seen = {True: 0, False: 0}
    for step in range(5):
        for earlier in range(step + 1):
            passed: dict[str, torch.Tensor] = {}
            words = chain.materialize(step, ["w", "frozen"], passing={"w": earlier, "frozen": 0},
                                      passed=passed)
            assert torch.equal(words["w"], chain.materialize(step, ["w"])["w"])
            on_way = [at for at, _ in chain.lineage("w", earlier)]
            through = on_way == [at for at, _ in chain.lineage("w", step)][: len(on_way)]
            seen[through] += 1
            if through:
                assert torch.equal(passed["w"], chain.materialize(earlier, ["w"])["w"])
            else:  # re-keyed between the two steps
                assert "w" not in passed
            assert torch.equal(passed["frozen"], frozen)  # unchanged: its data is step 0's
    assert seen[True] and seen[False]


def words_back_states(steps: int) -> list[dict[str, torch.Tensor]]:
    """Steps whose deltas are coded each way a writer's words can be taken back through:
    dense differences (``w``), dense XOR (``i``), sparse XOR (``b``), and a frozen tensor."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(20000, generator=g),
             "i": torch.randint(-2**30, 2**30, (20000,), generator=g, dtype=torch.int32),
             "b": torch.randn(20000, generator=g).bfloat16(), "frozen": torch.arange(100)}
    out = []
    for _ in range(steps):
        out.append({k: v.clone() for k, v in state.items()})
        state["w"] = state["w"] * (1 + 1e-4 * torch.randn(20000, generator=g))
        state["i"] = state["i"] ^ torch.randint(0, 4, (20000,), generator=g, dtype=torch.int32)
        state["b"] = state["b"].index_put((torch.randint(0, 20000, (50,), generator=g),),
                                          torch.randn(50, generator=g).bfloat16())
    return out


def test_a_rebase_takes_a_steps_words_back_from_the_writers_words_of_the_step_after(
        tmp_path, monkeypatch) -> None:
    """Removing the step that the oldest kept step reads from, right after a save (as a
    retention policy does), re-keys the kept step with its words taken from the writer's
    words of the step after it, each delta undone, instead of rebuilding its lineage."""
    url = str(tmp_path / "r")
    states = words_back_states(3)
    rebuilt: list[tuple[int, list[str]]] = []
    materialize = Reader.materialize
    monkeypatch.setattr(Reader, "materialize", lambda self, step, names=None, **kw: (
        rebuilt.append((step, sorted(names or []))), materialize(self, step, names, **kw))[1])
    ck = tpde.Checkpointer(url)
    for step, state in enumerate(states):
        ck.save(step, state)
    codings = {r.name: (r.codec, r.residual) for r in ck.chain.manifest(2).records}
    assert codings == {"w": ("dense", "sub"), "i": ("dense", "xor"), "b": ("sparse", "xor"),
                       "frozen": ("same", None)}
    rebuilt.clear()
    report = ck.remove(0)
    # (step 2's frozen tensor points at its data anew: step 0 held it)
    assert report.rebased_steps == [1, 2] and ck.chain.manifest(1).keyframe
    assert rebuilt == []  # nothing rebuilt from the chain
    ck.close()
    reader = tpde.Checkpointer(url)
    assert reader.steps() == [1, 2]
    for step in (1, 2):
        assert_same(states[step], reader.load(step))


@pytest.mark.parametrize("moving", [False, True])
def test_a_delta_coded_against_an_unchanged_step_is_pointed_at_its_data_when_it_goes(
        tmp_path, monkeypatch, moving: bool) -> None:
    """Lightning's `last` beside a top-k checkpoint is a step saved again unchanged; the next
    delta is coded against it. Removing it leaves that delta as it is, pointed at the step
    holding the data: nothing rebuilt or coded again, the delta's bytes kept (copied into the
    step's new blob where another of its tensors had to be coded again: ``moving``)."""
    url = str(tmp_path / "r")
    g = torch.Generator().manual_seed(0)
    w, v = torch.randn(20000, generator=g), torch.randn(20000, generator=g)
    states = [{"w": w, "v": v}, {"w": w, "v": v + 1e-3 if moving else v},
              {"w": w * 1.001, "v": v * 1.001}]
    ck = tpde.Checkpointer(url)
    for step, state in enumerate(states):
        ck.save(step, {k: t.clone() for k, t in state.items()})
    before = ck.chain.manifest(2).record("w")
    assert (before.codec, before.ref, ck.chain.manifest(1).record("w").codec) == \
        ("dense", 1, "same")
    with open(os.path.join(url, ck.chain.manifest(2).blob), "rb") as f:
        f.seek(before.sections["values"].offset)
        stored = f.read(before.sections["values"].length)
    rebuilt: list[tuple[int, list[str]]] = []
    materialize = Reader.materialize
    monkeypatch.setattr(Reader, "materialize", lambda self, step, names=None, **kw: (
        rebuilt.append((step, sorted(names or []))), materialize(self, step, names, **kw))[1])
    report = ck.remove(1)
    assert report.rebased_steps == [2]
    m = ck.chain.manifest(2)
    after = m.record("w")
    assert (after.codec, after.residual, after.ref, after.hash) == \
        (before.codec, before.residual, 0, before.hash)
    with open(os.path.join(url, m.blob), "rb") as f:
        f.seek(after.sections["values"].offset)
        assert f.read(after.sections["values"].length) == stored
    # v of step 2 read step 1's own delta of it: coded again (its words taken back), or, with
    # step 1 unchanged throughout, pointed at step 0 as w is.
    assert m.record("v").ref == 0
    assert rebuilt == ([(0, ["v"])] if moving else [])
    ck.close()
    assert_same(states[2], tpde.Checkpointer(url).load(2))
    assert tpde.Checkpointer(url).verify() == []


def test_a_damaged_record_of_the_step_after_leaves_a_rebase_to_rebuild_the_lineage(
        tmp_path, monkeypatch) -> None:
    """Words taken back through a damaged record would not hash to the re-based step's
    record: that tensor is rebuilt from its lineage instead, and the step stays exact."""
    url = str(tmp_path / "r")
    states = words_back_states(3)
    ck = tpde.Checkpointer(url)
    for step, state in enumerate(states):
        ck.save(step, state)
    m = ck.chain.manifest(2)
    values = m.record("w").sections["values"]
    path = os.path.join(url, m.blob)
    with open(path, "r+b") as f:  # a byte of the last frame's compressed residual
        f.seek(values.offset + values.length - 8)
        byte = f.read(1)
        f.seek(values.offset + values.length - 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    rebuilt: list[tuple[int, list[str]]] = []
    materialize = Reader.materialize
    monkeypatch.setattr(Reader, "materialize", lambda self, step, names=None, **kw: (
        rebuilt.append((step, sorted(names or []))), materialize(self, step, names, **kw))[1])
    ck.remove(0)
    assert rebuilt == [(1, ["w"])]  # the others were taken back
    ck.close()
    assert_same(states[1], tpde.Checkpointer(url).load(1))
    assert [p.step for p in tpde.Checkpointer(url).verify()] == [2]  # the damage, named


@pytest.mark.parametrize("resident", ["host", "store"])
def test_a_mount_computes_on_through_a_rebase_of_what_it_reads(tmp_path, resident: str) -> None:
    url = str(tmp_path / "r")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with tpde.Checkpointer(url, keyframe_every=8) as ck:
        for step in range(4):
            with torch.no_grad():
                model[0].weight[step] += 1  # a sparse change per step: deltas all the way
            ck.save(step, model.state_dict())
        x = torch.randn(5, 64)
        want = model(x)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8))
        mounted = tpde.mount(url, 3, fresh, budget=0, resident=resident)
        assert torch.equal(mounted(x), want)
        report = ck.remove(1, 2)  # step 3 is re-coded into a new blob; its old blob goes
        assert report.rebased_steps == [3]
        assert torch.equal(mounted(x), want)  # decoded again (budget 0), bit-exact
        mounted.tpde_mount.close()


def test_a_rebase_keeps_a_records_coding_where_it_holds_and_chooses_again_where_not(
        tmp_path) -> None:
    """A re-based record is first coded as it was saved (the writer's carried choice); a
    coding that no longer fits its new reference is chosen again in full. ``m`` changed 3 of
    its words at step 2 (sparse against step 1), but every word against step 0."""
    url = str(tmp_path / "r")
    g = torch.Generator().manual_seed(3)
    w0, m0 = torch.randn(20_000, generator=g), torch.randn(20_000, generator=g)
    m1 = torch.randn(20_000, generator=g)
    m2 = m1.clone()
    m2[[5, 500, 5000]] = 0.0
    states = [{"w": w0, "m": m0}, {"w": w0 + 1e-3 * torch.randn(20_000, generator=g), "m": m1}]
    states.append({"w": states[1]["w"] + 1e-3 * torch.randn(20_000, generator=g), "m": m2})
    with tpde.Checkpointer(url, keyframe_every=8) as ck:
        for step, state in enumerate(states):
            ck.save(step, {k: v.clone() for k, v in state.items()})
        saved = ck.chain.manifest(2)
        assert saved.record("m").codec == "sparse" and saved.record("w").codec == "dense"
        ck.remove(1)
    chain = Chain(url)
    rebased = chain.manifest(2)
    assert rebased.record("w").ref == 0 and rebased.record("m").ref in (0, None)
    assert (rebased.record("w").codec, rebased.record("w").residual) == \
        (saved.record("w").codec, saved.record("w").residual)
    assert rebased.record("m").codec != "sparse"
    assert_same(states[2], chain.load(2)[0], "step 2")


def keep_last_four(url: str, defer: bool) -> tuple[list[tpde.GcReport], list[int], dict]:
    """A run that keeps its last four steps, removing the oldest after each save: the reports
    of its removals and its close, and how many hidden steps it held after each removal."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20_000, generator=g)
    reports, hidden, states = [], [], {}
    ck = tpde.Checkpointer(url, keyframe_every=16)
    for step in range(16):
        w = w.clone()
        at = torch.randint(0, w.numel(), (8_000,), generator=g)  # about a third of it
        w[at] += 1e-3 * torch.randn(8_000, generator=g)
        states[step] = {"w": w.clone()}
        ck.save(step, states[step])
        if step >= 4:
            reports.append(ck.remove(step - 4, defer=defer))
            del states[step - 4]
            rest = ck.chain.at_rest()
            assert rest.total == on_disk(url) and ck.steps() == sorted(states)
            # Held past their removal only while the plain files would hold more, with room
            # for a re-base to write a step's new blob before it deletes the old.
            assert not rest.hidden or rest.total + rest.largest <= rest.plain, rest.as_dict()
            hidden.append(len(rest.hidden))
            for step_, state in states.items():
                assert_same(state, Chain(url).load(step_)[0], f"step {step_}")
    reports.append(ck.close())
    return reports, hidden, states


def test_deferred_removals_hold_bytes_within_the_plain_files_and_rebase_less(tmp_path) -> None:
    """What the Lightning plugin's top-k removals do: a removed step is gone from the run at
    once, its bytes go before the run could hold more than the plain files of its visible
    steps, and removals that wait are re-based off together."""
    now, _, _ = keep_last_four(str(tmp_path / "now"), defer=False)
    deferred, hidden, states = keep_last_four(str(tmp_path / "deferred"), defer=True)
    assert max(hidden) >= 2  # removed steps were held ...
    assert any(r.purged_steps for r in deferred[:-1])  # ... freed as the run grew ...
    assert deferred[-1].purged_steps  # ... and by the writer's close
    # Removed at once, each step is freed by its removal and the close finds nothing left.
    assert all(r.purged_steps for r in now[:-1]) and not now[-1].purged_steps
    rebased = [sum(len(r.rebased_steps) for r in reports) for reports in (now, deferred)]
    assert rebased[1] < rebased[0], rebased
    chain = Chain(str(tmp_path / "deferred"))
    assert chain.steps() == sorted(states) and not chain.at_rest().hidden
    assert {s for r in deferred for s in r.purged_steps} == set(range(12))
    with pytest.raises(tpde.StepNotFoundError):
        chain.load(11)
    for step, state in states.items():
        assert_same(state, chain.load(step)[0], f"step {step}")


def test_saves_while_removals_wait_keep_the_count_up_without_listing_the_store(tmp_path) -> None:
    """After a deferred removal each save adds what it stored to the count of the run's bytes
    against the plain files' (as it does to ``run_bytes``) instead of listing the store: the
    counts stay equal to fresh ones, and no save lists anything."""
    ck = tpde.Checkpointer(str(tmp_path / "run"), keyframe_every=16)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50_000, generator=g)

    def save(step: int) -> int:
        nonlocal w
        w = w.clone()
        w[torch.randint(0, w.numel(), (500,), generator=g)] += 1
        return ck.save(step, {"w": w}).run_bytes

    for step in range(6):
        save(step)
    ck.remove(0, 1, defer=True)
    assert ck.chain.at_rest().hidden  # waiting
    listed: list[str] = []
    real = ck.chain.store.list
    ck.chain.store.list = lambda prefix, *a, **k: listed.append(prefix) or real(prefix, *a, **k)
    for step in range(6, 10):
        assert save(step) == on_disk(ck.run)
        rest = Chain(ck.run).at_rest()
        assert ck._plain == (rest.plain, rest.largest) and ck._run_bytes == rest.total
    assert listed == [] and Chain(ck.run).at_rest().hidden


def test_removing_a_keyframe_re_bases_every_step_against_the_new_keyframe(tmp_path) -> None:
    """Deltas against keyframes: the kept steps that all read one keyframe step are re-based,
    the oldest re-keyed and the rest coded against it, so each stays one delta deep; the
    writer then codes its next deltas against the new keyframe."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20_000, generator=g)
    url = str(tmp_path / "run")
    expected = {}
    ck = tpde.Checkpointer(url, deltas_against="keyframe")
    for step in range(6):
        w = w + 1e-3 * torch.randn(w.numel(), generator=g)
        expected[step] = {"w": w.clone()}
        ck.save(step, expected[step])
    assert {r.ref for s in range(1, 6) for r in ck.chain.manifest(s).records} == {0}
    ck.remove(0)
    del expected[0]
    chain = Chain(url)
    assert [r.ref for r in chain.manifest(1).records] == [None]  # re-keyed
    assert {r.ref for s in range(2, 6) for r in chain.manifest(s).records} == {1}
    for step in range(6, 9):  # the writer held step 0's words: it reads step 1's instead
        w = w + 1e-3 * torch.randn(w.numel(), generator=g)
        expected[step] = {"w": w.clone()}
        ck.save(step, expected[step])
        assert [r.ref for r in Chain(url).manifest(step).records] == [1]
    ck.close()
    chain = Chain(url)
    for step, state in expected.items():
        assert_same(state, chain.load(step)[0], f"step {step}")
        assert max(decode_depths(chain, step).values()) <= 1
