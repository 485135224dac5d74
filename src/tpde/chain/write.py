"""Writing: committing a step, blob first and manifest last, as ``plan.plan_save`` plans it and
``save.StepSave`` codes it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from tpde.chain.base import DATA, MARKER, GcReport, Reference, Run, manifest_path, name
from tpde.chain.plan import KEYFRAME, PREVIOUS, SavePlan, plan_save
from tpde.chain.read import Reader
from tpde.chain.save import StepSave
from tpde.codec import encoder, quant
from tpde.errors import StepExistsError, TPDEError
from tpde.manifest import Manifest, collector_paused, format_for
from tpde.state import tree
from tpde.store import exclusive

#: Spans larger than this (or than half of ``max_inflight_bytes``, if smaller) are stored as
#: pieces, each a record of its own, so that encoding a tensor, or reading its reference back
#: from the store, never holds more than a piece of it at once. Half, so that two pieces are
#: encoded at once: about twice as fast as one at a time, in the same memory. Smaller pieces
#: save faster (a blob is written while more pieces are coded) but restore deltas more
#: slowly; this size is the balance measured (``benchmarks/README.md``).
PIECE_BYTES = 32 << 20


#: Spans smaller than this are saved in packs (``tree.pack``) of up to ``PACK_MOST`` bytes,
#: one record each: a Lightning model's many tiny tensors cost its saves and removals a
#: large share of their time as records of their own. A pack fits one frame of the default chunk,
#: so that a mount decoding one module's biases decodes no more than that frame.
PACK_BELOW = 4 << 10
PACK_MOST = 256 << 10

class Writer:
    """Committing a run's steps; a new step's reference words are read back through
    ``reader``."""

    def __init__(self, run: Run, reader: Reader) -> None:
        self.run, self.reader = run, reader

    def blob_for(self, step: int, writer: str = "") -> str:
        """A new blob's name for ``step``; ``writer`` (a rank: ``r3``) tells writers of one
        step apart."""
        return f"{DATA}/{name(step)}-{writer + '-' if writer else ''}{uuid.uuid4().hex[:12]}.tpd"

    def mark_run(self, against: str | None = None) -> None:
        """Make the folder a run (``tpde.json``), if it is not one yet, and have the marker say
        what this writer codes deltas against, if given (a re-base keeps to what it says)."""
        if self.run.is_run() and (against is None or self.run.deltas_against() == against):
            return
        against = against or PREVIOUS
        marker: dict[str, object] = {"format": "tpde", "version": 1}
        if against != PREVIOUS:
            marker["deltas_against"] = against
        self.run.store.put_atomic(MARKER, json.dumps(marker).encode())
        self.run.marked(against)

    def commit(self, m: Manifest, *, new: bool) -> Manifest:
        """Write ``m`` (its blob is durable): the step is visible (``new``), or rewritten (a
        re-base), from here on. A new step's manifest is created only where none is: of two
        writers committing one step at the same moment, one gets ``StepExistsError`` and its
        blob is deleted. A failed local write deletes the blob (a failed rename is final; a
        remote PUT may still land)."""
        data = m.to_bytes()
        try:
            if new:
                exclusive.create(self.run.store, manifest_path(m.step), data)
            else:
                self.run.store.put_atomic(manifest_path(m.step), data)
        except FileExistsError:
            for blob in [m.blob, *(s["blob"] for s in m.shards or ())]:
                if blob:
                    self.run.store.delete(blob)
            raise StepExistsError("was committed by another writer while this one saved it; "
                                  "this save wrote nothing (two jobs save into this run: give "
                                  "each its own run)", run=self.run.url, step=m.step) from None
        except TPDEError as exc:
            before = self.run.cached(m.step)  # a re-base keeps its old blob until it commits
            if self.run.store.local and m.blob and (before is None or before.blob != m.blob):
                self.run.store.delete(m.blob)
            raise exc.located(run=self.run.url, step=m.step) from exc
        # Kept as built, not parsed back from the bytes just written (a tenth of a save of
        # many small tensors): the JSON round trip gives the same manifest.
        m.__dict__["_size"] = len(data)
        self.run.remember(m)
        return m

    @collector_paused()
    def write(self, step: int, flat: tree.Flat, reference: Reference | None, *,
              settings: encoder.Settings, keyframe_every: int, keep_reference: bool = True,
              max_inflight_bytes: int = 256 << 20, owned: bool = False,
              bounds: Callable[[str], quant.Bound | None] | None = None,
              against: str = PREVIOUS) -> tuple[Manifest, Reference]:
        """Commit ``flat`` as ``step``; returns the manifest and the reference for the next step.

        With ``keep_reference`` the returned reference holds a host copy of every tensor, and
        ``reference.words`` is consumed as tensors are encoded, so peak host memory stays near
        one copy of the state. Without it nothing is kept: each tensor's reference is re-read
        from the committed chain when it is encoded. Either way at most ``max_inflight_bytes``
        of tensors (and at least one piece) are being encoded at once; spans larger than half
        of it, or than ``PIECE_BYTES``, are stored in pieces. Callers drop the reference if
        this raises. ``owned`` says the spans are private host copies (a snapshot), so they
        become the next reference as they are instead of being copied again. ``bounds`` gives
        the error bound of a span by name (None: exact); an error-bounded record's restored
        words, not the saved ones, become the next step's reference (error feedback).

        ``against=KEYFRAME`` codes each delta against its tensor's keyframe record instead of
        the reference step's record, so that every record is at most one delta deep; the
        reference then holds the keyframe records' words. A tensor bit-identical to its record
        at the reference step (its hash tells: a keyframe's words no longer do) points at that
        record's data instead.
        """
        if type(step) is not int or step < 0:
            raise TPDEError(f"step must be a non-negative int, got {step!r}", run=self.run.url)
        if any(span.tensor.is_cuda for span in flat.spans):
            import tpde.kernels.nvcomp  # noqa: F401  (registers the GPU's compressor)
        self.make_room(step)
        bound = max(1, max_inflight_bytes // 2)
        # No larger than a piece: a pack is never cut.
        flat = tree.pack(flat, PACK_BELOW, min(PACK_MOST, PIECE_BYTES, bound),
                         None if bounds is None else lambda s: bounds(*s.names) is not None)
        if reference is not None and reference.step == step:
            reference = None  # a hidden step purged to take its number again: a keyframe
        self.mark_run(against)
        started = time.perf_counter()
        star = against == KEYFRAME
        since = {n: (reference.at[n], c) for n, c in reference.since.items()
                 if n in reference.at} if star and reference else None
        plan = plan_save(self.run.lazy(), step, flat, reference.step if reference else None,
                         keyframe_every=keyframe_every, piece_bytes=min(PIECE_BYTES, bound),
                         most_bytes=bound, against=against, since=since)
        if reference is not None and reference.held:
            self._reread_stale(plan, reference)
        blob_rel = self.blob_for(step)
        blob = self.run.store.open_write(blob_rel)
        try:
            save = StepSave(self.reader, plan, reference, blob, settings,
                            keep_reference=keep_reference, owned=owned, bounds=bounds)
            saved = save.run(max_inflight_bytes)
            blob.close()
        except TPDEError as exc:
            blob.abort()
            raise exc.located(run=self.run.url, step=step) from exc
        except BaseException:
            blob.abort()
            raise
        m_refs = [r.ref for r in saved.records if r.ref is not None]
        self_contained = not m_refs
        m = Manifest(
            step=step, keyframe=self_contained, depth=saved.deepest,
            parent=None if self_contained else max(m_refs) if star else plan.reference,
            blob=blob_rel, blob_size=blob.size, created=time.time(), seconds=0.0,
            skeleton=flat.skeleton, records=saved.records, format=format_for(saved.records),
        )
        m.seconds = time.perf_counter() - started
        m = self.commit(m, new=True)
        return m, Reference(step, saved.words, held=keep_reference, choices=saved.choices,
                            at=saved.held_at, since=saved.since)

    def _reread_stale(self, plan: SavePlan, reference: Reference) -> None:
        """Keyframe words held for a step that is gone (re-based away: its tensors' records
        were re-keyed elsewhere) are read back from their new keyframes, a step at a time:
        one read per piece made saves markedly slower."""
        for at, names in plan.stale(reference.at).items():
            for n in names:  # dropped first: one copy of the state held, not two
                reference.words.pop(n, None)
            reference.words.update(self.reader.materialize(at, names))
            reference.at.update(dict.fromkeys(names, at))

    def make_room(self, step: int) -> None:
        """Refuse to overwrite a committed step; a hidden one that nothing needs is purged first."""
        if not self.run.store.exists(manifest_path(step)):
            return
        if not self.run.is_hidden(step):
            raise StepExistsError("already committed and immutable; save under a new step, or "
                                  "remove that step first (Checkpointer.remove)",
                                  run=self.run.url, step=step)
        if step in self.run.needed():
            raise StepExistsError("was removed, but later steps still need its data, so the "
                                  "number cannot be reused yet; save under a new step",
                                  run=self.run.url, step=step)
        self.run.purge(step, GcReport(), self.run.sizes())
