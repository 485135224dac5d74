"""Reading: rebuilding a step's words from its records' lineages, checked against hashes."""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Iterator

import torch

from tpde.chain import sharded
from tpde.chain.base import Problem, Progress, Run
from tpde.chain.decode import STREAMED
from tpde.chain.native import restore as native_restore
from tpde.chain.plan import plan_rebuild
from tpde.chain.rebuild import Rebuild
from tpde.chain.spans import span_places, span_words, warn_lossy
from tpde.codec import dtypes, unframe
from tpde.errors import CorruptionError, FormatError, TPDEError
from tpde.manifest import Manifest, Record, collector_paused
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
        return self._reader.run.store.kept_open()

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
            return self._reader.run.store.read_range(self._blob, a, b)
        except FileNotFoundError:
            raise CorruptionError(f"blob {self._blob} is missing", run=self._reader.run.url,
                                  step=self._m.step) from None


class Reader:
    """Rebuilding a run's steps (the decode path of every front end)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def fetch(self, m: Manifest, recs: list[Record], *, streamed: bool = False
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
                if blob == m.blob and self.run.store.whole_blob_reads \
                        and sum(b - a for a, b in ranges) * 2 >= m.blob_size:
                    data = self.run.store.read(blob, m.blob_size)
                    if len(data) != m.blob_size:
                        raise CorruptionError(f"blob {blob} holds {len(data)} bytes, the "
                                              f"manifest says {m.blob_size} (truncated?)",
                                              run=self.run.url, step=m.step)
                    view = memoryview(data)
                    got[blob] = iter([view[a:b] for a, b in ranges])
                else:
                    got[blob] = iter([memoryview(p)
                                      for p in self.run.store.read_ranges(blob, ranges)])
            except FileNotFoundError:
                raise CorruptionError(f"blob {blob} is missing", run=self.run.url,
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
                with self.run.store.kept_open():
                    words, rest = {}, names
                    if native and on is None and not check_every:
                        wanted = {r.name for r in self.run.manifest(step).records} \
                            if names is None else names
                        words = native_restore(self.run, step, wanted - (passing or {}).keys(),
                                               check=check, into=into or {}, progress=progress,
                                               batch_bytes=batch_bytes)
                        rest = wanted - words.keys()
                    if rest is None or rest:
                        words.update(self._materialize(
                            step, rest, found, check_every, check, progress, on, batch_bytes,
                            look_ahead, into or {}, passing or {},
                            {} if passed is None else passed))
            except CorruptionError:
                if self.run.stale():
                    continue
                raise
            if found and self.run.stale():
                continue
            if problems is not None and found:
                problems += found
            return words
        raise CorruptionError("the run was rewritten while being read, several times in a row; "
                              "try again", run=self.run.url, step=step)

    def _materialize(self, step: int, names: set[str] | None, problems: list[Problem] | None,
                     check_every: bool, check: bool, progress: Progress | None,
                     on: torch.device | None, batch_bytes: int, look_ahead: bool,
                     into: dict[str, torch.Tensor], passing: dict[str, int],
                     passed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``materialize``, once: planned, then carried out."""
        target = self.run.manifest(step)
        with collector_paused():  # builds the records its lineages go through
            wanted = list(target.records) if names is None else target.records_named(names)
            plan = plan_rebuild(target, wanted, self.run.lineage, batch_bytes=batch_bytes,
                                check=check, check_every=check_every, passing=passing)
        return Rebuild(self, plan, problems=problems, check=check, check_every=check_every,
                       progress=progress, on=on, look_ahead=look_ahead, into=into,
                       passed=passed).run()

    def stored_words(self, step: int, name: str) -> torch.Tensor | None:
        """One record's words at ``step``, read back from the store (None: it has none)."""
        if self.run.manifest(step).record(name) is None:
            return None
        return self.materialize(step, [name])[name]

    def trace(self, name: str, step: int, exc: TPDEError, at: int) -> tuple[TPDEError, int]:
        """Find the first damaged step of ``name``'s lineage by checking every delta's hash."""
        found: list[Problem] = []
        self.materialize(step, [name], problems=found, check_every=True)
        if found:
            return found[0].error or exc, found[0].step
        return exc, at

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
        m = self.run.manifest(step)
        skeleton = m.skeleton
        if within is not None:
            skeleton = tree.part(skeleton, within)
            if skeleton is None:
                raise TPDEError(f"the checkpoint has no top-level key {within!r} "
                                f"(it has: {', '.join(map(str, tree.keys(m.skeleton)))})",
                                run=self.run.url, step=step)
        if m.dcp is not None:  # a sharded step: its tensors whole, from their chunks
            items = tree.sharded_items(skeleton)
            names = [n for fqn in items for n in sharded.item_records(m, fqn)]
            words = self.materialize(step, names, progress=progress)
            try:
                rebuilt = sharded.values(m, items, words, map_location, trusted)
                return tree.unflatten(skeleton, [], trusted=trusted, sharded=rebuilt), {}
            except TPDEError as exc:
                raise exc.located(run=self.run.url, step=step) from None
        used = tree.span_indices(skeleton)
        groups = m.spans()
        wanted = [r for i in sorted(used) if i < len(groups) for r in groups[i]]
        warn_lossy(self.run.url, step, wanted)
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
            raise exc.located(run=self.run.url, step=step) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"skeleton is malformed ({exc})", run=self.run.url,
                              step=step) from None
        return state, words
