"""Retention: hiding steps, re-basing the kept steps that read from hidden ones, and deleting
what nothing needs any more, so that a run never holds more than its visible steps cost.

A re-base rewrites one kept step at a time, exactly like a save: the step's new blob is written
first, its new manifest replaces the old one atomically, and only then is the old blob deleted.
The step's words never change, so later steps that read from it are untouched, and a kill at
any moment leaves every visible step restorable (the hidden step it read from is deleted only
once nothing reads from it). A reader that meets a blob deleted under it starts again from the
new manifests (``Reader.materialize``).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Iterable, Iterator

import torch

from tpde.chain.base import (DATA, REMOVED, STEPS, GcReport, Problem, Progress, Reference, Run,
                             name, numbered)
from tpde.chain.decode import TASK_BYTES, decompress, in_runs, pools
from tpde.chain.plan import (DEFAULT_KEYFRAME_EVERY, PREVIOUS, AtRest, Rewrite, batches, depth,
                             holder, plan_rebase, readers_of, record_depth)
from tpde.chain.save import put_sections
from tpde.chain.read import Reader
from tpde.chain.write import Writer
from tpde.codec import decoder, dtypes, encoder, frames
from tpde.errors import StepNotFoundError, TPDEError
from tpde.manifest import Manifest, Record, collector_paused, format_for, hash_matches

#: Raw bytes of records re-coded at once by a re-base (and stored bytes copied at once).
REBASE_BATCH_BYTES = 64 << 20


class Retainer:
    """Removal, re-basing, garbage collection, accounting and verification of a run's steps:
    re-based steps are rebuilt through ``reader`` and committed through ``writer``."""

    def __init__(self, run: Run, reader: Reader, writer: Writer) -> None:
        self.run, self.reader, self.writer = run, reader, writer

    def remove(self, step: int) -> None:
        """Hide ``step``; its data stays until ``collect`` or ``gc`` re-bases what reads it."""
        if step not in self.run.steps():
            raise StepNotFoundError("no such visible step to remove", run=self.run.url, step=step)
        self.run.store.put_atomic(f"{REMOVED}/{name(step)}", b"")

    @collector_paused()
    def collect(self, *, keep: Iterable[int] = (), settings: encoder.Settings | None = None,
                keyframe_every: int = DEFAULT_KEYFRAME_EVERY, report: GcReport | None = None,
                later: Reference | None = None) -> GcReport:
        """Re-base the visible steps (and ``keep``) off hidden ones, then delete every hidden
        step nothing reads from any more. ``later``: a writer's words of its last step, from
        which a re-based step's words may be taken back (``_read_back``)."""
        report = report or GcReport()
        kept = {*self.run.steps(), *keep}
        self.rebase(kept, settings=settings, keyframe_every=keyframe_every, report=report,
                    later=later)
        needed = self.run.needed(keep)
        sizes = self.run.sizes()
        for step in self.run.committed():
            if step not in needed:
                self.run.purge(step, report, sizes)
        return report

    def rebase(self, kept: Iterable[int], *, settings: encoder.Settings | None = None,
               keyframe_every: int = DEFAULT_KEYFRAME_EVERY, report: GcReport | None = None,
               later: Reference | None = None) -> GcReport:
        """Rewrite the records of ``kept`` steps that read from steps outside ``kept``."""
        report = report or GcReport()
        started = time.perf_counter()
        settings = settings or encoder.Settings()
        for step, rewrites in plan_rebase(self.run.lazy(), kept, self.run.deltas_against()):
            self._rewrite(step, rewrites, settings, keyframe_every, later)
            report.rebased_steps.append(step)
            report.rewritten_records += len(rewrites)
        report.rebase_seconds += time.perf_counter() - started
        return report

    def _rewrite(self, step: int, rewrites: list[Rewrite], settings: encoder.Settings,
                 keyframe_every: int, later: Reference | None = None) -> None:
        """Carry out one step's part of a re-base plan: a new blob (only if some record gets
        data of its own), then the new manifest, then the old blob goes."""
        old = self.run.manifest(step)
        plan = {w.name: w for w in rewrites}
        new_records: dict[str, Record] = {}
        for w in rewrites:
            if w.how == "same":
                src = self.run.manifest(w.against).record(w.name)
                ref = src.ref if src.codec == "same" else w.against
                new_records[w.name] = dataclasses.replace(old.record(w.name), codec="same",
                                                          ref=ref, residual=None, count=0,
                                                          grid=None, scale=None, sections={})
            elif w.how == "repoint":
                new_records[w.name] = dataclasses.replace(old.record(w.name), ref=w.against)
        # The old records, those that change no data already rewritten: a blob, if one is
        # needed, copies the repointed ones' frames as they are.
        current = [new_records.get(r.name, r) for r in old.records]
        if all(w.how in ("same", "repoint") for w in rewrites):
            self._replace(old, self._summed(dataclasses.replace(old, records=current)))
            return
        blob_rel = self.writer.blob_for(step)
        writer = self.run.store.open_write(blob_rel)
        try:
            sizes = [r.raw_bytes if r.name in plan and plan[r.name].how == "recode"
                     else r.stored_bytes for r in current]
            for batch in batches(current, sizes, REBASE_BATCH_BYTES):
                for rec, sections in self._rewrite_batch(old, batch, plan, settings,
                                                         keyframe_every, later):
                    new_records[rec.name] = dataclasses.replace(
                        rec, sections=put_sections(writer, sections), shard=None)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        # Every record with data is now in the new blob (a sharded step's shards go with the
        # old blob); a sharded step keeps its DCP metadata and format.
        records = [r if r.shard is None else dataclasses.replace(r, shard=None)
                   for r in (new_records.get(r.name, r) for r in old.records)]
        self._replace(old, self._summed(dataclasses.replace(
            old, blob=blob_rel, blob_size=writer.size, origin=old.id, shards=[],
            format=format_for(records, sharded=old.dcp is not None), records=records)))

    def _summed(self, m: Manifest) -> Manifest:
        """``m`` with its step-level summary (keyframe, parent, depth) taken from its records."""
        refs = m.refs()
        deepest = max((record_depth(self.run.lazy(), r) for r in m.records), default=0)
        return dataclasses.replace(m, keyframe=not refs, parent=max(refs, default=None),
                                   depth=deepest)

    def _rewrite_batch(self, old: Manifest, batch: list[Record], plan: dict[str, Rewrite],
                       settings: encoder.Settings, keyframe_every: int,
                       later: Reference | None = None
                       ) -> Iterator[tuple[Record, dict[str, frames.Section]]]:
        """The records of one batch that hold data, with the sections to write for them:
        copied from the old blob (a repointed record comes pointed at its new ``ref`` already),
        copied from the keyframe record that holds them, or re-coded (their words taken back
        from ``later`` where it can give them). Re-coded records come as their runs are coded,
        written while the next are, not all after the coding is done."""
        keep = [r for r in batch
                if (r.name not in plan or plan[r.name].how == "repoint") and r.sections]
        copies = [r for r in batch if r.name in plan and plan[r.name].how == "copy"]
        recode = [r for r in batch if r.name in plan and plan[r.name].how == "recode"]
        for r, framed in zip(keep, self.reader.fetch(old, keep)):
            yield (r, _sections(r, framed))
        held: dict[int, list[tuple[Record, Record]]] = {}  # by the step holding the keyframe
        for r in copies:
            at, key = self.run.lineage(r.name, old.step)[0]
            held.setdefault(at, []).append((r, key))
        for at, pairs in held.items():
            for (r, key), framed in zip(pairs, self.reader.fetch(self.run.manifest(at),
                                                           [k for _, k in pairs])):
                yield (dataclasses.replace(r, codec=key.codec, ref=None,
                                           residual=key.residual, count=key.count,
                                           grid=key.grid, scale=key.scale, hash=key.hash),
                       _sections(key, framed))
        if recode:
            passing = {r.name: v for r in recode if (v := plan[r.name].against) is not None
                       and (depth(self.run.lazy(), v, r.name) or 0) + 1 < keyframe_every}
            # The words of the step each record is re-coded against are mostly on the way to
            # its own: rebuilt together, a retention run rebuilds each step once, not twice.
            # Words taken back cost no more than that last delta: its reference's words are
            # then rebuilt alone.
            passed: dict[str, torch.Tensor] = {}
            words = self._read_back(later, old.step, recode)
            rest = [r.name for r in recode if r.name not in words]
            if rest:
                words.update(self.reader.materialize(old.step, rest, passing=passing,
                                                     passed=passed))
            against: dict[int, list[str]] = {}
            for tensor, v in passing.items():
                if tensor not in passed:
                    against.setdefault(v, []).append(tensor)
            refs = {(passing[n], n): w for n, w in passed.items()}
            for v, names in against.items():
                refs.update({(v, n): w for n, w in self.reader.materialize(v, names).items()})
            jobs = []
            for r in recode:
                ref_words = refs.pop((plan[r.name].against, r.name), None)
                jobs.append((words.pop(r.name), ref_words, dtypes.by_name(r.dtype).kind,
                             None if ref_words is None else self._carried(r, old.step)))
            # Coded side by side, a run of small records per task, as a save codes them: one
            # at a time, re-bases spent much of their time coding on one core.
            coded = (enc for run in pools()[0].map(partial(_recode, settings=settings),
                                                    batches(jobs, [r.raw_bytes for r in recode],
                                                            TASK_BYTES))
                     for enc in run)
            for r, enc in zip(recode, coded):
                v = plan[r.name].against
                if enc.codec == "same":
                    src = self.run.manifest(v).record(r.name)
                    ref = src.ref if src.codec == "same" else v
                else:
                    ref = None if enc.keyed else v
                # Coded exactly: the step keeps the words it restored (and its bound and errors).
                yield (dataclasses.replace(r, codec=enc.codec, ref=ref,
                                           residual=enc.residual, count=enc.count,
                                           grid=None, scale=None),
                       enc.sections)

    def _read_back(self, later: Reference | None, step: int, recs: list[Record]
                   ) -> dict[str, torch.Tensor]:
        """The words of ``recs`` (records of ``step``) taken back from a writer's words of a
        later step, where that step's record of the tensor is unchanged from ``step``'s words
        or an exact delta against them: none decoded, or one delta undone
        (``decoder.decode(..., undo=True)``), instead of the lineage from a
        keyframe. A retention run re-bases the oldest kept step right after a save whose words
        the writer holds, about half the time of a keyframe and a delta decoded per re-coded
        tensor. Each is checked against its record's hash; one that does
        not match is rebuilt from the chain as any other."""
        if later is None or not later.held or later.at or self.run.deltas_against() != PREVIOUS:
            return {}  # (against keyframes the words held are the keyframes')
        manifests = self.run.lazy()
        m = manifests.get(later.step)
        if m is None:  # gone (another process's gc): the lineage rebuilds every one
            return {}
        jobs: list[tuple[Record, Record, torch.Tensor, dict | None]] = []
        undo: list[tuple[Record, Record, torch.Tensor]] = []  # a residual to undo first
        for r in recs:
            words, h = later.words.get(r.name), m.record(r.name)
            if words is None or words.is_cuda or h is None or h.numel != r.numel \
                    or h.dtype != r.dtype:
                continue
            if later.step == step or (h.codec == "same" and holder(later.step, h) == step):
                jobs.append((r, h, words, None))
            elif h.codec in ("dense", "sparse") and h.error is None and h.ref is not None:
                held_at = manifests.get(h.ref)
                below = held_at.record(r.name) if held_at is not None else None
                if below is not None and holder(h.ref, below) == step:
                    undo.append((r, h, words))
        fetched = self.reader.fetch(m, [h for _, h, _ in undo])
        jobs += [(*job, framed) for job, framed in zip(undo, fetched)]
        got = in_runs(pools()[0].map, _taken_back, jobs, [r.raw_bytes for r, *_ in jobs])
        return {r.name: words for (r, *_), words in zip(jobs, got) if words is not None}

    def _carried(self, r: Record, step: int) -> encoder.Choice | None:
        """The coding ``r`` was saved with, tried first against its new reference as a save
        tries the one its tensor was last coded with (``encoder.REVALIDATE``): a re-base coded
        each record every way otherwise."""
        key = self.run.lineage(r.name, step)[0][1]
        if r.codec not in ("dense", "sparse") or key.codec != "key":
            return None
        words = r.numel * dtypes.by_name(r.dtype).words_per_element
        return encoder.Choice((r.codec, r.residual), r.stored_bytes / words,
                              key.stored_bytes / words, r.density) if words else None

    def _replace(self, old: Manifest, new: Manifest) -> None:
        """Commit a rewritten manifest, then delete the blob it no longer uses."""
        self.writer.commit(new, new=False)
        for blob in set(old.blobs()) - set(new.blobs()):
            self.run.store.delete(blob)

    def gc(self, *, grace_seconds: float = 3600.0, keep: Iterable[int] = (),
           settings: encoder.Settings | None = None,
           keyframe_every: int = DEFAULT_KEYFRAME_EVERY, later: Reference | None = None
           ) -> GcReport:
        """``collect``, then delete leftovers of crashed saves and re-bases.

        Leftovers younger than ``grace_seconds`` are kept, since they may belong to a save in
        progress in another process.
        """
        self.run.require_run()
        report = self.collect(keep=keep, settings=settings, keyframe_every=keyframe_every,
                              later=later)
        live = {b for s in self.run.committed() for b in self.run.manifest(s).blobs()}
        now = time.time()
        for prefix in (DATA, STEPS):
            for e in self.run.store.list(prefix):
                leftover = (prefix == DATA and e.path not in live) or e.path.endswith(".tmp")
                young = e.mtime is not None and now - e.mtime < grace_seconds
                if leftover and not young:
                    self.run.store.delete(e.path)
                    report.freed_bytes += e.size
                    report.deleted.append(e.path)
        committed = set(self.run.committed())
        for step in self.run.hidden() - committed:
            self.run.store.delete(f"{REMOVED}/{name(step)}")
            report.deleted.append(f"{REMOVED}/{name(step)}")
        return report

    def at_rest(self) -> AtRest:
        """Every byte the run holds in its store, by why it is held."""
        self.run.require_run()
        files = {e.path: e.size for prefix in ("", DATA, STEPS, REMOVED)
                 for e in self.run.store.list(prefix)}
        # Committed and hidden steps from this one listing, not listed again.
        committed = numbered(((p, n) for p, n in files.items() if p.startswith(f"{STEPS}/")),
                             ".json")
        hidden = numbered((p, n) for p, n in files.items() if p.startswith(f"{REMOVED}/"))
        visible = set(committed) - set(hidden)
        lazy = self.run.lazy()  # a damaged manifest is counted apart, not raised
        manifests = {s: m for s in sorted(committed) if (m := lazy.get(s)) is not None}
        out = AtRest()
        owned: set[str] = set()
        for s, m in manifests.items():
            mine = [p for p in (f"{STEPS}/{name(s)}.json", *m.blobs()) if p in files]
            owned.update(mine)
            size = sum(files[p] for p in mine)
            if s in visible:
                out.visible += size
                out.plain += m.raw_bytes
                out.largest = max(out.largest, m.raw_bytes)
            else:
                out.hidden[s] = size
        for s in set(committed) - set(manifests):  # unreadable: neither visible nor leftover
            mine = [p for p in files if p == f"{STEPS}/{name(s)}.json"
                    or p.startswith(f"{DATA}/{name(s)}-")]
            owned.update(mine)
            out.damaged[s] = sum(files[p] for p in mine)
        if out.hidden:  # walking every visible step's references costs a save O(steps) more
            readers = readers_of(manifests, visible)
            out.needed_by = {s: readers.get(s, []) for s in out.hidden}
        for path, size in files.items():
            if path in owned:
                continue
            if path.startswith(f"{DATA}/") or path.endswith(".tmp"):
                out.leftovers += size
            else:
                out.other += size
        return out

    def verify(self, step: int | None = None, *, progress: Progress | None = None) -> list[Problem]:
        """Rebuild and hash-check ``step`` (or every visible step); returns what is damaged."""
        problems: list[Problem] = []
        for s in [step] if step is not None else self.run.steps():
            found: list[Problem] = []
            try:
                self.reader.materialize(s, problems=found, check_every=True, progress=progress)
            except TPDEError as exc:
                found.append(Problem.of(exc.located(run=self.run.url, step=s), s))
            problems += [dataclasses.replace(p, needed_by=s) for p in found]
        return problems


def _sections(r: Record, framed: dict[str, list[memoryview]]) -> dict[str, frames.Section]:
    """A record's stored sections as they are, to copy into another blob: views of what was
    read (a local blob's mapping), written out from there rather than copied first."""
    return {k: frames.Section(s.raw, s.chunk, tuple(framed[k])) for k, s in r.sections.items()}


def _taken_back(r: Record, h: Record, words: torch.Tensor, framed: dict | None
                ) -> torch.Tensor | None:
    """``r``'s words from ``words``, a later step's record ``h`` of the same tensor: as they
    are (``framed`` None: ``h`` is unchanged from them) or with ``h``'s residual undone; None
    where that fails or the result does not hash to ``r``'s hash."""
    if framed is not None:
        dt = dtypes.by_name(h.dtype)
        try:  # a dense residual is joined from its frames and undone in one pass
            words = decoder.decode(h.codec, h.residual, decompress(h, framed, "fused"),
                                   words.clone(), h.numel * dt.words_per_element,
                                   dt.word_dtype, dt.kind, inplace=True, undo=True)
        except TPDEError:  # that record is damaged: the lineage rebuilds it, and says so
            return None
    return words if hash_matches(words.view(torch.uint8).numpy(), r.hash) else None


def _recode(jobs: list[tuple[torch.Tensor, torch.Tensor | None, str, encoder.Choice | None]], *,
            settings: encoder.Settings) -> list[encoder.Encoding]:
    """A run of records coded again against their new references (None: as keyframes): those
    whose coding is known together (``encoder.encode_many``: a Lightning chain's re-bases
    re-key many small tensors each), the others one by one."""
    known = encoder.encode_many(jobs, settings)
    return [enc or encoder.encode(words, ref, kind, settings, choice=choice)
            for (words, ref, kind, choice), enc in zip(jobs, known)]
