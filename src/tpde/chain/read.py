"""Reading: rebuilding a step's words from its records' lineages, checked against hashes."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from tpde.chain import sharded
from tpde.chain.base import ChainBase, Problem, Progress
from tpde.chain.decode import (STREAMED, attempt, decompress, in_runs, pools, rebuild,
                               rebuild_checked, runs_of, verified)
from tpde.chain.native import restore as native_restore
from tpde.chain.plan import batches
from tpde.chain.spans import span_places, span_words, warn_lossy
from tpde.codec import dtypes, elias, unframe
from tpde.errors import CorruptionError, FormatError, TPDEError
from tpde.manifest import Manifest, Record, collector_paused
from tpde.runtime import heap
from tpde.state import tree

#: Words a rebuild reads and decompresses at once (``Chain.materialize``): as fast as larger
#: batches, for less memory held.
DECODE_BATCH_BYTES = 32 << 20
#: Times a read starts again when the run's writer rewrote what it was reading (a re-base).
REREADS = 3


class _FramesOnDemand:
    """A section's frames read from the store one at a time, as a streamed decode reaches
    them: nothing of the section is held before it is needed."""

    def __init__(self, reader: "Reader", m: Manifest, blob: str, s: Any) -> None:
        self._reader, self._m, self._blob = reader, m, blob
        self._starts = [s.offset]
        for n in s.frames:
            self._starts.append(self._starts[-1] + n)

    def __len__(self) -> int:
        return len(self._starts) - 1

    def reading(self) -> ContextManager[None]:
        """The store's files kept open while this thread reads frames (``unframe.by_slices``
        runs on the frame threads)."""
        return self._reader.store.kept_open()

    def __getitem__(self, i: int | slice) -> Any:
        """Frame ``i``; a slice of frames in one read."""
        if isinstance(i, slice):
            first, end, _ = i.indices(len(self))
            data = memoryview(self._read(self._starts[first], self._starts[end]))
            at = self._starts[first]
            return [data[self._starts[k] - at : self._starts[k + 1] - at]
                    for k in range(first, end)]
        return self._read(self._starts[i], self._starts[i + 1])

    def _read(self, a: int, b: int) -> Any:
        try:
            return self._reader.store.read_range(self._blob, a, b)
        except FileNotFoundError:
            raise CorruptionError(f"blob {self._blob} is missing", run=self._reader.url,
                                  step=self._m.step) from None


class Reader(ChainBase):
    """Rebuilding steps (the decode path of every front end)."""

    def _fetch(self, m: Manifest, recs: list[Record], *, streamed: bool = False
               ) -> list[dict[str, Any]]:
        """The frames of ``recs``' sections: one GET of a blob, or range reads for a few.
        With ``streamed`` the values of keyframe and dense records are read frame by frame
        as the decode asks for them (``_FramesOnDemand``)."""
        later = [streamed and name == "values" and r.codec in STREAMED
                 for r in recs for name in r.sections]
        wanted = [(m.blob_of(r), s.offset, s.offset + s.length)
                  for r in recs for s in r.sections.values()]
        now = [w for w, lazy in zip(wanted, later) if not lazy]
        by_blob: dict[str, list[tuple[int, int]]] = {}
        for blob, a, b in now:
            by_blob.setdefault(blob, []).append((a, b))
        got: dict[str, Iterator[memoryview]] = {}
        for blob, ranges in by_blob.items():
            try:
                if blob == m.blob and self.store.whole_blob_reads \
                        and sum(b - a for a, b in ranges) * 2 >= m.blob_size:
                    data = self.store.read(blob, m.blob_size)
                    if len(data) != m.blob_size:
                        raise CorruptionError(f"blob {blob} holds {len(data)} bytes, the "
                                              f"manifest says {m.blob_size} (truncated?)",
                                              run=self.url, step=m.step)
                    view = memoryview(data)
                    got[blob] = iter([view[a:b] for a, b in ranges])
                else:
                    got[blob] = iter([memoryview(p) for p in self.store.read_ranges(blob, ranges)])
            except FileNotFoundError:
                raise CorruptionError(f"blob {blob} is missing", run=self.url,
                                      step=m.step) from None
        out, lazy = [], iter(later)
        it = (next(got[blob]) for blob, _, _ in now)
        for r in recs:
            secs: dict[str, Any] = {}
            for sname, s in r.sections.items():
                if next(lazy):
                    secs[sname] = _FramesOnDemand(self, m, m.blob_of(r), s)
                    continue
                secs[sname] = unframe.cut(next(it), s.frames)
            out.append(secs)
        return out

    def materialize(self, step: int, names: Iterable[str] | None = None, *,
                    problems: list[Problem] | None = None, check_every: bool = False,
                    check: bool = True, progress: Progress | None = None,
                    on: torch.device | None = None, batch_bytes: int = DECODE_BATCH_BYTES,
                    look_ahead: bool = True, into: dict[str, torch.Tensor] | None = None,
                    passing: dict[str, int] | None = None,
                    passed: dict[str, torch.Tensor] | None = None,
                    native: bool = True) -> dict[str, torch.Tensor]:
        """Host words of ``step``'s records, rebuilt step by step and checked against hashes.

        The words a caller gets are hash-checked (``check=False`` only for bytes already checked
        once and held unchanged since, as a mount does); with ``check_every`` so is every delta
        on the way, which is what ``verify`` does. ``on`` rebuilds the words on that device
        with ``tpde.kernels.backend`` (nvCOMP and Triton; the hash check copies them to the
        host). A mismatch is traced back to the first damaged step either way. With
        ``problems`` given, damaged tensors are reported there and skipped instead of raised.
        Each step is read and decompressed in batches of about ``batch_bytes`` of words, so
        that beside the words themselves a rebuild holds two batches, not two steps
        (``look_ahead=False``: one, prepared only when the one before is rebuilt).

        ``into`` gives host words (views of a larger buffer, say) that records are rebuilt in
        instead of new tensors, by name; the words returned for them are those.

        ``passing`` names, by tensor, an earlier step whose words the caller wants too (a
        re-base codes a step against an earlier one it is rebuilt from): where the rebuild
        goes through them, a hash-checked copy is put in ``passed``, by name.

        On the host, each tensor's whole lineage is first rebuilt in one C call outside the
        GIL, a batch of tensors at a time (``native.restore``; not with ``native=False``, nor
        for ``check_every``, ``on`` or ``passing``): what it cannot rebuild or check is then
        rebuilt step by step here, which says where a chain is damaged.

        A read that finds data gone because the run's writer re-based the steps it reads
        (``gc``) starts again from the rewritten manifests: the words are the same.
        """
        names = None if names is None else set(names)
        for _ in range(REREADS):
            found: list[Problem] | None = None if problems is None else []
            try:
                with self.store.kept_open():
                    words, rest = {}, names
                    if native and on is None and not check_every:
                        wanted = {r.name for r in self.manifest(step).records} \
                            if names is None else names
                        words = native_restore(self, step, wanted - (passing or {}).keys(),
                                               check=check, into=into or {}, progress=progress,
                                               batch_bytes=batch_bytes)
                        rest = wanted - words.keys()
                    if rest is None or rest:
                        words.update(self._materialize(
                            step, rest, found, check_every, check, progress, on, batch_bytes,
                            look_ahead, into or {}, passing or {},
                            {} if passed is None else passed))
            except CorruptionError:
                if self._stale():
                    continue
                raise
            if found and self._stale():
                continue
            if problems is not None and found:
                problems += found
            return words
        raise CorruptionError("the run was rewritten while being read, several times in a row; "
                              "try again", run=self.url, step=step)

    def _materialize(self, step: int, names: set[str] | None, problems: list[Problem] | None,
                     check_every: bool, check: bool, progress: Progress | None,
                     on: torch.device | None, batch_bytes: int, look_ahead: bool,
                     into: dict[str, torch.Tensor], passing: dict[str, int],
                     passed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``materialize``, once."""
        target = self.manifest(step)
        plan: dict[int, list[tuple[Record, bool]]] = defaultdict(list)
        final: dict[str, int] = {}  # the step whose record gives each name its final words
        taken: dict[str, int] = {}  # the step after whose record ``passing``'s words are taken
        passed.clear()  # of an attempt that found the run rewritten
        failed: set[str] = set()

        def fail(exc: TPDEError, at: int, name: str) -> None:
            exc = exc.located(run=self.url, step=at, tensor=name)
            if problems is None:
                raise exc
            problems.append(Problem.of(exc, at, name))
            failed.add(name)

        # Builds the step's records and those its lineages go through (``Records``).
        with collector_paused():
            wanted = list(target.records) if names is None else target.records_named(names)
            for rec in wanted:
                try:
                    lineage = self.lineage(rec.name, step)
                except TPDEError as exc:
                    fail(exc, step, rec.name)
                    continue
                if rec.name in passing:
                    on_way = self.lineage(rec.name, passing[rec.name])
                    if lineage[: len(on_way)] == on_way:  # rebuilt on the way to ``step``
                        taken[rec.name] = on_way[-1][0]
                for i, (at, r) in enumerate(lineage):
                    plan[at].append((r, check_every or (check and i == len(lineage) - 1)
                                     or taken.get(rec.name) == at))
                final[rec.name] = lineage[-1][0]
        current: dict[str, torch.Tensor] = {}
        # (step, batch) in step order; each is prepared while the one before is rebuilt.
        units = [(at, batch) for at in sorted(plan)
                 for batch in batches(plan[at], [r.raw_bytes for r, _ in plan[at]], batch_bytes)]
        backend = None
        if on is not None:
            from tpde.kernels.backend import Kernels

            backend = Kernels(on)

        def prepare(unit: tuple[int, list[tuple[Record, bool]]]
                    ) -> tuple[list[tuple[Record, bool]], list[Any], list[Any]] | TPDEError:
            """Fetch, decompress and decode positions of one batch of a step: nothing here
            needs the previous step's words, so it runs one batch ahead of the rebuild."""
            at, batch = unit
            todo = [(r, checked) for r, checked in batch if r.name not in failed]
            try:
                fetched = self._fetch(self.manifest(at), [r for r, _ in todo], streamed=stream)
            except TPDEError as exc:
                return exc
            recs = [r for r, _ in todo]
            on_gpu = backend is not None and backend.nvcomp
            mode = "gpu" if on_gpu else "host" if backend is not None else \
                "stream" if stream else "fused"
            sections = in_runs(spread, attempt(decompress),
                                [(r, f, mode) for r, f in zip(recs, fetched)],
                                [r.raw_bytes for r in recs])
            if on_gpu:
                backend.add_values(sections, [
                    (f["values"], r.sections["values"].raw, r.sections["values"].chunk)
                    if "values" in r.sections else None for r, f in zip(recs, fetched)])
            if backend is not None:  # positions are decoded on the device
                return todo, sections, [None] * len(todo)
            return todo, sections, self._positions(recs, sections)

        pool, ahead = pools()
        # Without look-ahead memory comes first: values streamed frame by frame, and records
        # rebuilt on this thread (each decode thread's malloc arena would keep what it freed,
        # several times a small module's size); only a large record's slices are shared out
        # over the frame threads (``unframe.by_slices``).
        stream = not look_ahead and backend is None
        spread = pool.map if look_ahead else map
        # With look-ahead, words that nothing rebuilds further are hashed on the prefetch
        # threads while the next records are rebuilt, a task per batch: otherwise a piece's
        # hash is time the other core has nothing to do beside.
        checks: list[tuple[int, list[Record], Future]] = []

        def later(r: Record, at: int) -> bool:
            return look_ahead and final[r.name] == at and taken.get(r.name) != at

        def refused(r: Record, checked: bool, exc: TPDEError, at: int) -> None:
            if checked and not check_every and isinstance(exc, CorruptionError) \
                    and not isinstance(exc, FormatError):
                exc, at = self._trace(r.name, step, exc, at)
            fail(exc, at, r.name)

        def finish(at: int, batch: list[tuple[Record, bool]], jobs: list[tuple],
                   rebuilt: Iterable[Any]) -> None:
            """Take one batch's rebuilt words (waiting for them), and queue their checks."""
            finals: list[tuple[Record, torch.Tensor]] = []
            for (r, checked, *_), done in zip(jobs, rebuilt):
                if isinstance(done, TPDEError):
                    refused(r, checked, done, at)
                    continue
                current[r.name] = done
                if backend is None and checked and later(r, at):
                    finals.append((r, done))
                if taken.get(r.name) == at and r.name not in passed:  # rebuilt on a device
                    passed[r.name] = done.clone()
                if progress:
                    progress(r.raw_bytes)
            if finals:
                checks.append((at, [r for r, _ in finals], ahead.submit(
                    lambda fs: [attempt(verified)(r, True, w) for r, w in fs], finals)))
            if not look_ahead:
                heap.freed(sum(r.raw_bytes for r, _ in batch))

        # With look-ahead on the host, a batch's records are handed to the decode threads
        # before the batch before is done, unless it rebuilds one of the same tensors: the
        # threads that finish one batch start on the next instead of waiting for the other's
        # last frames. Its sections are prepared once that batch is done, so that two batches
        # are held, as before.
        overlap = look_ahead and backend is None
        running: tuple[Callable[[], None], set[str]] | None = None  # its finish, its tensors
        upcoming = ahead.submit(prepare, units[0]) if len(units) > 1 and look_ahead else None
        for k, (at, batch) in enumerate(units):
            prepared = upcoming.result() if upcoming is not None else prepare(units[k])
            upcoming = None
            names = {r.name for r, _ in batch}
            if running is not None and running[1] & names:
                running[0]()
                running = None
            if isinstance(prepared, TPDEError):
                for r, _ in batch:
                    if r.name not in failed:
                        fail(prepared, at, r.name)
                jobs: list[tuple] = []
                rebuilt: Iterable[Any] = []
            else:
                jobs = [(r, checked, secs, current.get(r.name), pos, backend)
                        for (r, checked), secs, pos in zip(*prepared) if r.name not in failed]
                if backend is None:  # on the decode threads at once (a pool's map)
                    rebuilt = runs_of(spread, attempt(partial(
                        rebuild_checked, at=at, final=final, into=into, taken=taken,
                        passed=passed, later=later)), [(job,) for job in jobs],
                        [j[0].raw_bytes for j in jobs])
                else:
                    # Kernels are launched from this thread, one record after another (the
                    # device runs them in order either way); the hashes are computed in the pool.
                    words = [attempt(rebuild)(job) for job in jobs]
                    backend.done([w for w in words if isinstance(w, torch.Tensor)])
                    rebuilt = pool.map(attempt(verified), [j[0] for j in jobs],
                                       [j[1] for j in jobs], words)
            del prepared
            if running is not None:
                running[0]()
            running = (partial(finish, at, batch, jobs, rebuilt), names)
            del jobs, rebuilt  # held by ``running`` alone, and let go once it is finished
            if not overlap:
                running[0]()
                running = None
            if look_ahead and k + 1 < len(units):
                upcoming = ahead.submit(prepare, units[k + 1])
        if running is not None:
            running[0]()
        for at, recs, done in checks:
            for r, found in zip(recs, done.result()):
                if isinstance(found, TPDEError):
                    refused(r, True, found, at)
        result = {}
        for rec in wanted:
            if rec.name in failed:
                continue
            if check and rec.hash != self._data_hash(rec, step):
                fail(CorruptionError("record's hash differs from the data it points to"),
                     step, rec.name)
                continue
            result[rec.name] = current[rec.name]
        return result

    def _trace(self, name: str, step: int, exc: TPDEError, at: int) -> tuple[TPDEError, int]:
        """Find the first damaged step of ``name``'s lineage by checking every delta's hash."""
        found: list[Problem] = []
        self.materialize(step, [name], problems=found, check_every=True)
        if found:
            return found[0].error or exc, found[0].step
        return exc, at

    @staticmethod
    def _positions(recs: list[Record], sections: list[Any]) -> list[Any]:
        """Decode the step's sparse position streams in one batch (None where not sparse).

        If the batch fails, every record decodes its own stream so the error names its tensor.
        """
        sparse = [i for i, (r, secs) in enumerate(zip(recs, sections))
                  if r.codec == "sparse" and isinstance(secs, dict) and "positions" in secs]
        out: list[Any] = [None] * len(recs)
        try:
            decoded = elias.decode_many(
                [sections[i]["positions"] for i in sparse],
                [recs[i].numel * dtypes.by_name(recs[i].dtype).words_per_element for i in sparse])
        except FormatError:
            return out
        for i, pos in zip(sparse, decoded):
            out[i] = pos
        return out

    @collector_paused()
    def load(self, step: int, *, map_location: tree.MapLocation = None, trusted: bool = False,
             progress: Progress | None = None, keep_words: bool = True,
             within: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
        """The checkpoint at ``step`` and the host words it was built from.

        Without ``keep_words`` no words are returned and the checkpoint's tensors are the
        rebuilt words themselves wherever they need not move: a restore then holds one copy of
        the state, not two. (A writer keeps the words to code the next delta against, so the
        tensors it hands out must be copies that training can change.) ``within`` names a
        top-level key: only that part of the checkpoint is returned, and only its tensors are
        decoded (a model's weights without the optimizer state, say).
        """
        m = self.manifest(step)
        skeleton = m.skeleton
        if within is not None:
            skeleton = tree.part(skeleton, within)
            if skeleton is None:
                raise TPDEError(f"the checkpoint has no top-level key {within!r} "
                                f"(it has: {', '.join(map(str, tree.keys(m.skeleton)))})",
                                run=self.url, step=step)
        if m.dcp is not None:  # a sharded step: its tensors whole, from their chunks
            items = tree.sharded_items(skeleton)
            names = [n for fqn in items for n in sharded.item_records(m, fqn)]
            words = self.materialize(step, names, progress=progress)
            try:
                rebuilt = sharded.values(m, items, words, map_location, trusted)
                return tree.unflatten(skeleton, [], trusted=trusted, sharded=rebuilt), {}
            except TPDEError as exc:
                raise exc.located(run=self.url, step=step) from None
        used = tree.span_indices(skeleton)
        groups = m.spans()
        wanted = [r for i in sorted(used) if i < len(groups) for r in groups[i]]
        warn_lossy(self.url, step, wanted)
        # A span in pieces that stays on the host is rebuilt in place: each piece is decoded
        # into its part of the span's buffer, not into a tensor of its own and then copied.
        whole: dict[int, torch.Tensor] = {}
        into: dict[str, torch.Tensor] = {}
        for i in sorted(used):
            recs = groups[i] if i < len(groups) else []
            if keep_words or len(recs) < 2 \
                    or tree.resolve_device(recs[0].device, map_location).type != "cpu":
                continue
            whole[i], places = span_places(recs, lambda n, dt: torch.empty(n, dtype=dt))
            into.update(places)
        words = self.materialize(step, [r.name for r in wanted], progress=progress, into=into)
        spans = []
        for i, recs in enumerate(groups):
            if i not in used:
                spans.append(torch.empty(0))  # not referenced by the part being loaded
                continue
            dt = dtypes.by_name(recs[0].dtype)
            names = [r.name for r in recs]
            if i in whole:
                data = whole[i]
                for n in names:
                    del words[n]  # views of the span: nothing else to free
            else:
                device = tree.resolve_device(recs[0].device, map_location)
                if not keep_words and words[names[0]].device == device:
                    device = None
                # Moved as words, then viewed: some dtypes (int1..int7) have no copy kernel.
                data = span_words(names, words, device, consume=not keep_words)
            spans.append(data.view(torch.uint8).view(dt.torch_dtype))
        try:
            state = tree.unflatten(skeleton, spans, trusted=trusted)
        except TPDEError as exc:
            raise exc.located(run=self.url, step=step) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"skeleton is malformed ({exc})", run=self.url, step=step) from None
        return state, words
