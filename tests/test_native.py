"""The native rebuild (``tpde.chain.native``, ``tpde.codec._rebuild``) of a mount and of the restore
path, against the states saved and tpde's Python path (``Chain.materialize(native=False)``):
the same words, bit for bit, from local files read a frame at a time and from bytes in
memory, alone and shared over an OpenMP team; damage is a failed tensor, never wrong words."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpde
from helpers import flip_bit
from tpde.chain import Chain, native
from tpde.codec import _rebuild
from tpde.mounting.slots import in_heap
from tpde.runtime.frame_threads import usable_cpus

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="tpde.codec._rebuild not built, or no libzstd found")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
#: Sizes in elements: tiny, frames that straddle planes (300001 = 2 x 150000.5 per plane), and
#: tensors whose records together pass ``_rebuild``'s PLANES_BYTES (read a range at a time).
SIZES = [1, 7, 4096, 65537, 300_001, 1_100_000]


def _changed(t: torch.Tensor, how: str, g: torch.Generator) -> torch.Tensor:
    """``t`` after a training-like update: every element (dense), a few (sparse), none."""
    if how == "same" or t.numel() == 0:
        return t
    out = t.clone()
    flat = out.view(-1)
    where = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 50)] if how == "sparse" \
        else torch.arange(t.numel())
    if t.is_floating_point():
        flat[where] += (torch.randn(where.numel(), generator=g) * 1e-3).to(t.dtype)
    else:
        flat[where] += 1
    return out


@st.composite
def histories(draw) -> tuple[dict[str, torch.Tensor], list[list[str]], int]:
    """Tensors, the change each of them sees at each step after the first, a keyframe period."""
    names = [f"t{i}" for i in range(draw(st.integers(1, 3)))]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    first: dict[str, torch.Tensor] = {}
    for name in names:
        dtype, n = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SIZES))
        base = torch.randn(n, generator=g) * 3
        first[name] = base.to(dtype) if dtype.is_floating_point else \
            (base * 40).to(torch.int64).clamp(0, 200).to(dtype)
    steps = draw(st.lists(st.lists(st.sampled_from(["dense", "sparse", "same"]),
                                   min_size=len(names), max_size=len(names)),
                          min_size=1, max_size=3))
    return first, steps, draw(st.sampled_from([2, 8]))


def _write(run: str, first: dict[str, torch.Tensor], steps: list[list[str]],
           keyframe_every: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The states saved, step by step (each tensor is one record of its name)."""
    g = torch.Generator().manual_seed(seed)
    states = [dict(first)]
    with tpde.Checkpointer(run, keyframe_every=keyframe_every) as ckpt:
        ckpt.save(0, states[0])
        for step, changes in enumerate(steps, start=1):
            states.append({k: _changed(v, how, g)
                           for (k, v), how in zip(states[-1].items(), changes)})
            ckpt.save(step, states[-1])
    return states


def _native_kind(chain: Chain, step: int, name: str) -> bool:
    """Whether a record's lineage is one the native rebuild takes, read off the manifests:
    exact keyframes, dense and sparse deltas, the sparse ones' positions (int64) and values
    within ``SPARSE_BYTES``."""
    lineage = [rec for _, rec in chain.lineage(name, step)]
    width = torch.empty(0, dtype=getattr(torch, lineage[-1].dtype)).element_size()
    sparse = sum(r.sections["values"].raw * (1 + 8 // width) for r in lineage
                 if r.codec == "sparse")
    return sparse <= native.SPARSE_BYTES and all(
        r.codec in ("key", "dense", "sparse") and r.grid is None for r in lineage)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("where", ["file", "memory"])
@settings(max_examples=10)
@given(history=histories())
def test_native_rebuild_is_the_python_path_bit_for_bit(tmp_path_factory, where: str,
                                                         history) -> None:
    first, steps, every = history
    run = str(tmp_path_factory.mktemp("run")) if where == "file" else \
        f"memory://native-{os.urandom(6).hex()}"
    states = _write(run, first, steps, every)
    chain = Chain(run)
    for step, state in enumerate(states):
        names = [r.name for r in chain.manifest(step).records]
        lineages = native.lineages(chain, step, names)
        assert set(lineages) == {n for n in names if _native_kind(chain, step, n)}
        expected = chain.materialize(step, names, native=False)
        for threads in (2, 1):
            got = native.rebuild(chain, lineages, check=True, threads=threads, into={},
                                 alloc=in_heap)
            assert set(got) == set(lineages)
            for name, words in got.items():
                assert _bits(words) == _bits(expected[name]), (step, name, threads)
        # The restore path rebuilds natively first: the same words, and the states saved.
        restored = chain.materialize(step, names)
        assert {n: _bits(w) for n, w in restored.items()} == \
            {n: _bits(w) for n, w in expected.items()}
        loaded, _ = chain.load(step, keep_words=False)
        assert {k: _bits(t) for k, t in loaded.items()} == \
            {k: _bits(t) for k, t in state.items()}, step


def _two_tensor_run(run: str) -> tuple[Chain, dict[str, native.Lineage]]:
    g = torch.Generator().manual_seed(3)
    first = {"a": torch.randn(300_001, generator=g), "b": torch.randn(5000, generator=g)}
    _write(run, first, [["dense", "sparse"], ["dense", "dense"]], keyframe_every=8)
    chain = Chain(run)
    return chain, native.lineages(chain, 2, ["a", "b"])


@pytest.mark.parametrize("resident", [False, True], ids=["read", "held"])
def test_a_damaged_record_fails_its_tensor_and_no_other(tmp_path, resident: bool) -> None:
    """One flipped bit in a delta's frames: that tensor is left out (for the Python path to
    report), the other is rebuilt; read from the files a frame at a time, or from memory."""
    run = str(tmp_path / "run")
    chain, lineages = _two_tensor_run(run)
    expected = chain.materialize(2, ["a", "b"], native=False)
    m = chain.manifest(2)
    flip_bit(run, m, m.record("a"))
    fresh = Chain(run)
    if resident:  # every range read once into memory, as resident="host" holds them
        from tpde.store.resident import ResidentStore
        held: dict[str, dict[tuple[int, int], bytes]] = {}
        for lin in lineages.values():
            for s in lin.records:
                for a, b in s.ranges():
                    held.setdefault(s.blob, {})[a, b] = fresh.store.read_ranges(s.blob,
                                                                                [(a, b)])[0]
        fresh.store = ResidentStore(fresh.store, held)
    for threads in (2, 1):
        got = native.rebuild(fresh, lineages, check=True, threads=threads, into={},
                             alloc=in_heap)
        assert set(got) == {"b"}
        assert _bits(got["b"]) == _bits(expected["b"])
    with pytest.raises(tpde.CorruptionError, match="'a'|a\\b"):
        fresh.materialize(2, ["a"])


def test_a_blob_cut_short_fails_its_tensors(tmp_path) -> None:
    """A blob shorter than its manifest says: the tensors whose frames lie past its end are
    left out, not rebuilt from what the read did not fill."""
    run = str(tmp_path / "run")
    chain, lineages = _two_tensor_run(run)
    m = chain.manifest(2)
    path = os.path.join(run, m.blob_of(m.record("a")))
    os.truncate(path, os.path.getsize(path) // 2)
    got = native.rebuild(Chain(run), lineages, check=True, threads=2, into={}, alloc=in_heap)
    assert "a" not in got


def test_words_unchecked_are_still_rebuilt_and_a_wrong_hash_fails(tmp_path) -> None:
    """``check=False`` (bytes a mount checked once and holds) skips the hash; with it, a
    lineage whose stored hash is not the words' fails."""
    run = str(tmp_path / "run")
    chain, lineages = _two_tensor_run(run)
    wrong = {n: dataclasses.replace(lin, hash=lin.hash ^ 1) for n, lin in lineages.items()}
    assert native.rebuild(chain, wrong, check=True, threads=1, into={}, alloc=in_heap) == {}
    got = native.rebuild(chain, wrong, check=False, threads=1, into={}, alloc=in_heap)
    expected = chain.materialize(2, ["a", "b"], native=False)
    assert all(_bits(got[n]) == _bits(expected[n]) for n in ("a", "b"))


def test_rebuild_refuses_tasks_that_do_not_add_up() -> None:
    """Inconsistent sizes, modes and positions are refused before any work."""
    out = np.zeros(16, dtype=np.uint32)
    frame = b"\x00" * 8
    bad = [
        [(frame, [8], 64, 64, 1)],                    # a residual first, no keyframe
        [(frame, [8], 64, 32, 0)],                    # a stream of another size than the words
        [(frame, [8, 8], 64, 64, 0)],                 # two frames where one chunk is the stream
        [(frame, [16], 64, 64, 0)],                   # frames past the record's bytes
        # a sparse delta's two words with one position, then with one past the words
        [(frame, [8], 64, 64, 0), (frame, [8], 8, 8, 9, np.array([3], dtype=np.int64))],
        [(frame, [8], 64, 64, 0), (frame, [8], 8, 8, 9, np.array([1, 16], dtype=np.int64))],
        [(frame, [8], 64, 64, 7)],                    # no such mode
    ]
    for records in bad:
        with pytest.raises(ValueError):
            _rebuild.rebuild([(out, 4, True, 0, 0, records)], 1, False)
    with pytest.raises(ValueError):  # words not aligned to their width
        _rebuild.rebuild([(out.view(np.uint8)[1:61], 4, True, 0, 0,
                           [(frame, [8], 64, 60, 0)])], 1, False)


def _child(run: str, queue) -> None:
    from tpde.chain import native as child_native
    chain = Chain(run)
    lineages = child_native.lineages(chain, 2, ["a", "b"])
    got = child_native.rebuild(chain, lineages, check=True, threads=2, into={}, alloc=in_heap)
    queue.put({n: _bits(w) for n, w in got.items()})
    # A restore there leaves its tensors to the Python path's own decode threads.
    with chain.store.kept_open():
        natively = child_native.restore(chain, 2, ["a", "b"], check=True, into={},
                                        progress=None, batch_bytes=32 << 20)
    restored = chain.materialize(2, ["a", "b"])
    queue.put((sorted(natively), {n: _bits(w) for n, w in restored.items()}))


@pytest.mark.skipif(os.name != "posix", reason="fork")
def test_a_forked_child_rebuilds_on_its_own_thread(tmp_path) -> None:
    """libgomp's threads are the parent's: a child forked after the parent computed with torch
    on every thread rebuilds without a team (and without waiting forever for one)."""
    run = str(tmp_path / "run")
    chain, lineages = _two_tensor_run(run)
    a = torch.randn(256, 256)
    _ = a @ a  # torch's OpenMP threads started here
    native.rebuild(chain, lineages, check=True, threads=2, into={}, alloc=in_heap)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(run, queue))
    child.start()
    got = queue.get(timeout=120)
    natively, restored = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    expected = chain.materialize(2, ["a", "b"], native=False)
    assert got == restored == {n: _bits(expected[n]) for n in ("a", "b")}
    assert natively == ([] if usable_cpus() > 1 else ["a", "b"])


def test_threads_that_start_at_once_open_the_native_call_once(tmp_path, monkeypatch) -> None:
    """Threads whose first restores start together open the call once: each opened it again,
    resetting the OpenMP entry points while another's call used them, and a Lightning save
    with ``reference="store"`` (whose threads read their references back at once) crashed."""
    run = str(tmp_path / "run")
    chain, _ = _two_tensor_run(run)
    real, opened = _rebuild, []

    class Opening:
        """The extension, with ``open`` slowed down so that every thread gets to it."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def open(self, *args: object) -> bool:
            opened.append(threading.get_ident())
            time.sleep(0.05)  # the GIL is let go: the other threads run on meanwhile
            return real.open(*args)

    monkeypatch.setattr(native, "_rebuild", Opening())
    monkeypatch.setattr(native, "_opened", {})
    start = threading.Barrier(8)
    expected = {n: _bits(t) for n, t in chain.materialize(2, ["a", "b"], native=False).items()}
    got: list[dict[str, bytes]] = []

    def restore() -> None:
        start.wait()
        words = native.restore(chain, 2, ["a", "b"], check=True, into={}, progress=None,
                               batch_bytes=1 << 25)
        got.append({n: _bits(t) for n, t in words.items()})

    workers = [threading.Thread(target=restore) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert len(opened) == 1
    assert len(got) == 8
    assert all(g in ({}, expected) for g in got)  # {}: no team on several CPUs


def test_a_lineage_of_large_sparse_deltas_is_left_to_the_python_path(tmp_path,
                                                                     monkeypatch) -> None:
    """Sparse deltas whose positions and values pass ``SPARSE_BYTES`` together (here made
    small) are not planned, as all of them would be held at once; a mount rebuilds them through
    ``materialize``, one batch at a time, and computes as the dense model. Under the bound the
    same lineage is planned."""
    run = str(tmp_path / "run")
    g = torch.Generator().manual_seed(5)
    emb = torch.nn.Embedding(20_000, 64)
    with tpde.Checkpointer(run) as ckpt:
        for step in range(3):
            with torch.no_grad():  # 1% of the rows, as a batch of rare tokens touches them
                rows = torch.randperm(20_000, generator=g)[:200]
                emb.weight[rows] += torch.randn(200, 64, generator=g) * 1e-3
            ckpt.save(step, emb.state_dict())
    chain = Chain(run)
    assert [r.codec for _, r in chain.lineage("weight", 2)] == ["key", "sparse", "sparse"]
    assert set(native.lineages(chain, 2, ["weight"])) == {"weight"}
    monkeypatch.setattr(native, "SPARSE_BYTES", 1 << 10)
    assert native.lineages(chain, 2, ["weight"]) == {}
    mounted = tpde.mount(run, 2, torch.nn.Embedding(20_000, 64), device="cpu", budget=0)
    ids = torch.randint(0, 20_000, (4, 16), generator=g)
    with torch.no_grad():
        assert torch.equal(mounted(ids), emb(ids))
    assert mounted.tpde_mount.decoder.native == {"": {}}  # planned, and nothing rebuilt natively


def test_the_restore_path_counts_progress_and_reports_damage_as_the_python_path(
        tmp_path) -> None:
    """A restore's progress adds up to the same bytes natively as through the Python path; a
    damaged tensor the native call leaves out is reported by the Python path, and the other
    tensor is restored."""
    run = str(tmp_path / "run")
    chain, _ = _two_tensor_run(run)
    counts = []
    for native_first in (True, False):
        seen: list[int] = []
        chain.materialize(2, progress=seen.append, native=native_first)
        counts.append(sum(seen))
    assert counts[0] == counts[1] == sum(r.raw_bytes for name in ("a", "b")
                                         for _, r in chain.lineage(name, 2))
    expected = chain.materialize(2, ["a", "b"], native=False)
    m = chain.manifest(2)
    flip_bit(run, m, m.record("a"))
    found: list = []
    got = Chain(run).materialize(2, problems=found)
    assert [(p.step, p.tensor) for p in found] == [(2, "a")]
    assert set(got) == {"b"} and _bits(got["b"]) == _bits(expected["b"])


def test_a_store_without_descriptors_reads_no_lineage_larger_than_a_batch() -> None:
    """From a store that hands no descriptors, a lineage's stored bytes are read before its
    call: one that holds more than a batch is left to the Python path, which reads a step at a
    time, and the words are the same."""
    run = f"memory://native-{os.urandom(6).hex()}"
    chain, lineages = _two_tensor_run(run)
    held = {n: lin.beside(read_first=True) for n, lin in lineages.items()}
    assert held["b"] < held["a"]
    limit = (held["a"] + held["b"]) // 2
    with chain.store.kept_open():
        got = native.restore(chain, 2, ["a", "b"], check=True, into={}, progress=None,
                             batch_bytes=limit)
    assert set(got) == {"b"}
    expected = chain.materialize(2, ["a", "b"], native=False)
    assert _bits(got["b"]) == _bits(expected["b"])
    restored = chain.materialize(2, ["a", "b"], batch_bytes=limit)
    assert all(_bits(restored[n]) == _bits(expected[n]) for n in ("a", "b"))
