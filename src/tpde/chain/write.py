"""Writing: committing a step, blob first and manifest last, each tensor coded against the
reference or re-keyed as ``plan.plan_keys`` says."""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

import numpy as np
import torch

from tpde.chain.base import DATA, MARKER, GcReport, Reference, manifest_path, name
from tpde.chain.plan import (KEYFRAME, PREVIOUS, Candidate, Piece, batches, candidates, holder,
                             piece_starts, pieces, plan_keys, record_depth)
from tpde.chain.read import Reader
from tpde.codec import dtypes, encoder, frames, quant, transform
from tpde.errors import StepExistsError, TPDEError
from tpde.manifest import Manifest, Record, SectionRef, collector_paused, format_for, record_hash
from tpde.runtime import frame_threads
from tpde.state import tree
from tpde.store import exclusive
from tpde.store.store import BlobWriter

#: Spans larger than this (or than half of ``max_inflight_bytes``, if smaller) are stored as
#: pieces, each a record of its own, so that encoding a tensor, or reading its reference back
#: from the store, never holds more than a piece of it at once. Half, so that two pieces are
#: encoded at once: about twice as fast as one at a time, in the same memory. Smaller pieces
#: save faster (a blob is written while more pieces are coded) but restore deltas more
#: slowly; this size is the balance measured (``benchmarks/README.md``).
PIECE_BYTES = 32 << 20


#: Pieces smaller than this are encoded in batches of about this size, one task each: a task
#: per small tensor cost more in hand-offs between threads than in coding.
BATCH_BYTES = 1 << 20

#: Spans smaller than this are saved in packs (``tree.pack``) of up to ``PACK_MOST`` bytes,
#: one record each: a Lightning model's many tiny tensors cost its saves and removals a
#: large share of their time as records of their own. A pack fits one frame of the default chunk,
#: so that a mount decoding one module's biases decodes no more than that frame.
PACK_BELOW = 4 << 10
PACK_MOST = 256 << 10

#: Pieces up to this size that are bit-identical to the step before are told so on the
#: writing thread (``Writer.write``'s ``unchanged``), without a task.
UNCHANGED_BYTES = 1 << 20


def put_sections(writer: BlobWriter, sections: dict[str, frames.Section]
                 ) -> dict[str, SectionRef]:
    """Append sections to a blob; their references in it."""
    out = {}
    for sname, sec in sections.items():
        offset = writer.size
        for frame in sec.frames:
            writer.write(frame)
        out[sname] = SectionRef(offset, sec.raw, sec.chunk, sec.table())
    return out


def _copy(words: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
    """Host words the caller may change after the save, copied into ``spare`` (the last
    reference's buffer: fresh pages cost about as much as the copy itself) where it fits.
    numpy on the host, as on every encode thread, where torch's copy costs several times
    more."""
    fits = spare is not None and not spare.is_cuda and spare.dtype == words.dtype \
        and spare.shape == words.shape
    if words.is_cuda:
        return spare.copy_(words) if fits else words.to("cpu", copy=True)
    out = spare if fits else torch.empty_like(words)
    np.copyto(out.numpy(), words.numpy())
    return out


class Started(NamedTuple):
    """A piece about to be coded: its words, its reference's (None: a keyframe), the buffer its
    words may be kept in, the step it is coded against, its hash where taken already, its error
    bound and the coding it carries from its last save."""

    dtype: dtypes.DType
    words: torch.Tensor
    ref_words: torch.Tensor | None
    spare: torch.Tensor | None
    source: int | None
    digest: str | None
    bound: quant.Bound | None
    choice: encoder.Choice | None


class Encoded(NamedTuple):
    """One piece coded, as its record will say: ``ref`` is the step it reads from (None: a
    keyframe record), ``depth`` the deltas a restore decodes, ``source`` the step whose words
    it was coded against."""

    dtype: dtypes.DType
    host: torch.Tensor | None  # the next save's reference words (None: none kept)
    enc: encoder.Encoding
    digest: str
    bound: quant.Bound | None
    ref: int | None
    depth: int
    source: int | None


class Writer(Reader):
    """Committing steps."""

    def blob_for(self, step: int) -> str:
        return f"{DATA}/{name(step)}-{uuid.uuid4().hex[:12]}.tpd"

    def mark_run(self, against: str | None = None) -> None:
        """Make the folder a run (``tpde.json``), if it is not one yet, and have the marker say
        what this writer codes deltas against, if given (a re-base keeps to what it says)."""
        if self.is_run() and (against is None or self.deltas_against() == against):
            return
        against = against or PREVIOUS
        marker: dict[str, object] = {"format": "tpde", "version": 1}
        if against != PREVIOUS:
            marker["deltas_against"] = against
        self.store.put_atomic(MARKER, json.dumps(marker).encode())
        self._known_run, self._against = True, against

    def commit(self, m: Manifest, *, new: bool) -> Manifest:
        """Write ``m`` (its blob is durable): the step is visible (``new``), or rewritten (a
        re-base), from here on. A new step's manifest is created only where none is: of two
        writers committing one step at the same moment, one gets ``StepExistsError`` and its
        blob is deleted. A failed local write deletes the blob (a failed rename is final; a
        remote PUT may still land)."""
        data = m.to_bytes()
        try:
            if new:
                exclusive.create(self.store, manifest_path(m.step), data)
            else:
                self.store.put_atomic(manifest_path(m.step), data)
        except FileExistsError:
            for blob in [m.blob, *(s["blob"] for s in m.shards or ())]:
                if blob:
                    self.store.delete(blob)
            raise StepExistsError("was committed by another writer while this one saved it; "
                                  "this save wrote nothing (two jobs save into this run: give "
                                  "each its own run)", run=self.url, step=m.step) from None
        except TPDEError as exc:
            before = self._manifests.get(m.step)  # a re-base keeps its old blob until it commits
            if self.store.local and m.blob and (before is None or before.blob != m.blob):
                self.store.delete(m.blob)
            raise exc.located(run=self.url, step=m.step) from exc
        # Kept as built, not parsed back from the bytes just written (a tenth of a save of
        # many small tensors): the JSON round trip gives the same manifest.
        m.__dict__["_size"] = len(data)
        self._manifests[m.step] = m
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
            raise TPDEError(f"step must be a non-negative int, got {step!r}", run=self.url)
        if any(span.tensor.is_cuda for span in flat.spans):
            import tpde.kernels.nvcomp  # noqa: F401  (registers the GPU's compressor)
        self._make_room(step)
        bound = max(1, max_inflight_bytes // 2)
        # No larger than a piece: a pack is never cut.
        flat = tree.pack(flat, PACK_BELOW, min(PACK_MOST, PIECE_BYTES, bound),
                         None if bounds is None else lambda s: bounds(*s.names) is not None)
        if reference is not None and reference.step == step:
            reference = None  # a hidden step purged to take its number again: a keyframe
        self.mark_run(against)
        star = against == KEYFRAME
        started = time.perf_counter()
        prev_m = self.manifest(reference.step) if reference is not None else None
        todo = list(pieces(flat, min(PIECE_BYTES, bound), piece_starts(prev_m), bound))
        since = {n: (reference.at[n], c) for n, c in reference.since.items()
                 if n in reference.at} if star and reference else None
        found = candidates(self.lazy(), prev_m.step, [p.name for p in todo], since=since) \
            if prev_m else [Candidate(p.name, None) for p in todo]
        depths = {c.name: c.depth for c in found}
        sources = {c.name: c.source for c in found}
        keyed = plan_keys(found, keyframe_every)
        if star and reference is not None and reference.held:
            # Keyframe words held for a step that is gone (re-based away: its tensors' records
            # were re-keyed elsewhere) are read back from their new keyframes, a step at a time:
            # one read per piece made saves markedly slower.
            stale: dict[int, list[str]] = {}
            for c in found:
                if c.name not in keyed and reference.at.get(c.name) != c.source:
                    stale.setdefault(c.source, []).append(c.name)
            for at, names in stale.items():
                for n in names:  # dropped first: one copy of the state held, not two
                    reference.words.pop(n, None)
                reference.words.update(self.materialize(at, names))
                reference.at.update(dict.fromkeys(names, at))
        blob_rel = self.blob_for(step)
        writer = self.store.open_write(blob_rel)
        records: list[Record] = []
        new_words: dict[str, torch.Tensor] = {}
        choices: dict[str, encoder.Choice] = {}
        held_at: dict[str, int] = {}  # against keyframes: the step of each reference's words
        since_key: dict[str, int] = {}
        deepest = 0

        def words_of(piece: Piece) -> tuple[dtypes.DType, torch.Tensor]:
            dt = dtypes.of_tensor(piece.span.tensor, name=piece.span.name)
            w = dt.words_per_element
            words = transform.to_words(piece.span.tensor.detach(), dt.word_dtype)
            return dt, words[piece.lo * w : piece.hi * w]

        def bound_of(piece: Piece) -> quant.Bound | None:
            """A pack holds no bounded span, whatever its name matches (``tree.pack``)."""
            return bounds(*piece.span.names) if bounds is not None and not piece.span.parts \
                else None

        def same(piece: Piece, dt: dtypes.DType, host: torch.Tensor | None,
                 enc: encoder.Encoding, bound: quant.Bound | None, src: int) -> Encoded:
            """Bit-identical to ``src``'s words, whose hash is known: a repeated save hashes
            nothing, and the record points where that step's data is."""
            held = self.manifest(src).record(piece.name)
            return Encoded(dt, host if keep_reference else None, enc, held.hash, bound,
                           holder(src, held), 0 if star else depths[piece.name], src)

        def begin(piece: Piece) -> Started | Encoded:
            """What a piece is coded from (its words, its reference's, the buffer its words
            may be kept in), or its record already, where it is as saved at the reference
            step (against keyframes: its hash tells)."""
            dt, words = words_of(piece)
            ref_words = spare = reference.words.pop(piece.name, None) if reference else None
            src = None if piece.name in keyed or prev_m is None else \
                sources[piece.name] if star else prev_m.step
            digest = None
            prev = prev_m.record(piece.name) if star and prev_m is not None else None
            if prev is not None and prev.dtype == dt.name and prev.numel == piece.hi - piece.lo:
                digest = record_hash(words.contiguous().view(torch.uint8).cpu().numpy())
                if digest == prev.hash:
                    # As saved at the reference step, which a keyframe's words no longer tell
                    # (nor the plan, which may have this tensor re-keyed now).
                    at = sources[piece.name]
                    if reference.at.get(piece.name) != at:
                        ref_words = None  # read back at the next save
                    return Encoded(dt, ref_words if keep_reference else None,
                                   encoder.Encoding("same"), digest, None,
                                   holder(prev_m.step, prev), record_depth(self.lazy(), prev), at)
            if src is None:
                ref_words = None
            elif not reference.held or (star and (ref_words is None
                                                  or reference.at.get(piece.name) != src)):
                # None held, or (against keyframes) held for a keyframe re-based away since.
                ref_words = self._stored_words(src, piece.name)
            if star and src is not None:
                spare = None  # the keyframe's words stay the reference
            bound = bound_of(piece)
            choice = reference.choices.get(piece.name) if reference else None
            return Started(dt, words, ref_words, spare, src, digest, bound, choice)

        def finish(piece: Piece, at: Started, enc: encoder.Encoding | None) -> Encoded:
            """The piece's record from its coding (None: coded here, every option weighed),
            and the words the next save codes against."""
            dt, words, ref_words, spare, src, digest, bound, choice = at
            if enc is None:
                enc = encoder.encode(words, ref_words, dt.kind, settings, bound=bound,
                                     dtype=dt.name, choice=choice)
            if enc.keyed:
                src = None
            if star and src is not None:
                host = ref_words  # the next delta is coded against the same keyframe
            elif enc.words is not None:  # error-bounded: what a reader rebuilds
                host = enc.words.to("cpu")
            elif enc.codec == "same" and ref_words is not None and not ref_words.is_cuda:
                host = ref_words  # the reference's own words: an unchanged tensor is not copied
            elif words.is_cuda or (keep_reference and not owned):
                host = _copy(words, spare)  # the last reference's buffer is done with now
            else:
                host = words
            if enc.codec == "same":
                return same(piece, dt, host, enc, bound, src)
            if enc.words is not None:
                digest = record_hash(enc.words.to("cpu").view(torch.uint8).numpy())
            elif digest is None:  # (taken already of the same words where it was compared)
                digest = record_hash(host.view(torch.uint8).numpy())
            deep = 0 if src is None else 1 if star else depths[piece.name] + 1
            return Encoded(dt, host if keep_reference else None, enc, digest, bound, src, deep,
                           src)

        def code(batch: list[Piece], known: list[Encoded | None]) -> list[Encoded]:
            """A batch's exact pieces coded together where ``encoder.encode_many`` can (their
            coding settled before anything is compressed), the others one by one."""
            started = [k or begin(p) for p, k in zip(batch, known)]
            todo = [i for i, a in enumerate(started)
                    if isinstance(a, Started) and a.bound is None]
            coded: list[encoder.Encoding | None] = [None] * len(batch)
            if todo:
                jobs = [started[i] for i in todo]
                for i, enc in zip(todo, encoder.encode_many(
                        [(a.words, a.ref_words, a.dtype.kind, a.choice) for a in jobs],
                        settings)):
                    coded[i] = enc
            return [a if isinstance(a, Encoded) else finish(p, a, coded[i])
                    for i, (p, a) in enumerate(zip(batch, started))]

        repeat = not star and prev_m is not None and reference.held

        def unchanged(piece: Piece) -> Encoded | None:
            """While every piece so far was bit-identical to the held words of the step before
            (a step saved again, as Lightning's ``last`` is), a small host piece that is too,
            told on this thread as its task would code it: no task for it, and no hand-off
            of the GIL between threads at every torch call on it, which made the encode
            threads slower at it than this one. The first piece that changed ends the
            checks: on this thread beside the encode threads they slowed a delta save."""
            nonlocal repeat
            if not repeat or piece.name in keyed or piece.nbytes > UNCHANGED_BYTES:
                return None
            ref_words = reference.words.get(piece.name)
            if ref_words is None or piece.span.tensor.is_cuda or ref_words.is_cuda:
                return None
            dt, words = words_of(piece)
            # numpy's comparison: several times faster here than torch.equal.
            if ref_words.dtype != words.dtype or ref_words.shape != words.shape \
                    or not np.array_equal(words.numpy(), ref_words.numpy()):
                repeat = False
                return None
            del reference.words[piece.name]
            return same(piece, dt, ref_words,
                        encoder.Encoding("same", choice=reference.choices.get(piece.name)),
                        bound_of(piece), prev_m.step)

        def commit(piece: Piece, done: Encoded) -> None:
            nonlocal deepest
            dt, host, enc, digest, bound, ref, d, src = done
            if star:  # a keyframe record's words are its own step's
                held_at[piece.name] = step if src is None else src
                since_key[piece.name] = 0 if src is None else \
                    depths[piece.name] + (enc.codec != "same")
            deepest = max(deepest, d)
            records.append(Record(piece.name, dt.name, piece.hi - piece.lo, piece.span.device,
                                  enc.codec, digest, ref, enc.residual, enc.count,
                                  put_sections(writer, enc.sections), piece.start,
                                  enc.grid, enc.scale, bound.as_dict() if bound else None,
                                  dict(zip(("abs", "rel"), enc.error)) if enc.error else None,
                                  parts=piece.span.parts or None))
            if host is not None:
                new_words[piece.name] = host
            if enc.choice is not None:
                choices[piece.name] = enc.choice

        try:
            workers = settings.threads or frame_threads.default_threads()
            with ThreadPoolExecutor(workers, thread_name_prefix="tpde-encode") as pool:
                pending: deque[tuple[list[Piece], int, Future]] = deque()
                inflight = 0

                def finish_oldest() -> None:
                    nonlocal inflight
                    batch, size, fut = pending.popleft()
                    for piece, done in zip(batch, fut.result()):
                        commit(piece, done)
                    inflight -= size

                # Bounded by bytes alone: a cap of a few batches in flight left every thread
                # but one idle while the oldest, a large tensor, was still being coded.
                for batch in batches(todo, [p.nbytes for p in todo], BATCH_BYTES):
                    known = [unchanged(p) for p in batch]
                    if all(known):
                        done: Future = Future()
                        done.set_result(known)
                        pending.append((batch, 0, done))
                        continue
                    size = sum(p.nbytes for p in batch)
                    while pending and inflight + size > max_inflight_bytes:
                        finish_oldest()
                    pending.append((batch, size, pool.submit(code, batch, known)))
                    inflight += size
                while pending:
                    finish_oldest()
            writer.close()
        except TPDEError as exc:
            writer.abort()
            raise exc.located(run=self.url, step=step) from exc
        except BaseException:
            writer.abort()
            raise
        m_refs = [r.ref for r in records if r.ref is not None]
        self_contained = not m_refs
        m = Manifest(
            step=step, keyframe=self_contained, depth=deepest,
            parent=None if self_contained else max(m_refs) if star else prev_m.step, blob=blob_rel,
            blob_size=writer.size, created=time.time(), seconds=0.0, skeleton=flat.skeleton,
            records=records, format=format_for(records),
        )
        m.seconds = time.perf_counter() - started
        m = self.commit(m, new=True)
        return m, Reference(step, new_words, held=keep_reference, choices=choices, at=held_at,
                            since=since_key)

    def _stored_words(self, step: int, piece: str) -> torch.Tensor | None:
        """One tensor's words at ``step``, read back from the store."""
        if self.manifest(step).record(piece) is None:
            return None
        return self.materialize(step, [piece])[piece]

    def _make_room(self, step: int) -> None:
        """Refuse to overwrite a committed step; a hidden one that nothing needs is purged first."""
        if not self.store.exists(manifest_path(step)):
            return
        if not self.is_hidden(step):
            raise StepExistsError("already committed and immutable; save under a new step, or "
                                  "remove that step first (Checkpointer.remove)",
                                  run=self.url, step=step)
        if step in self.needed():
            raise StepExistsError("was removed, but later steps still need its data, so the "
                                  "number cannot be reused yet; save under a new step",
                                  run=self.url, step=step)
        self._purge(step, GcReport(), self._sizes())
