"""Carrying out a save's plan (``plan.SavePlan``): each piece coded against its reference on the
encode threads, its sections appended to the step's blob, its record and the next save's
reference words collected in order."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from tpde.chain.base import Reference
from tpde.chain.plan import Piece, SavePlan, batches, holder, record_depth
from tpde.chain.read import Reader
from tpde.codec import dtypes, encoder, frames, quant, transform
from tpde.manifest import Record, SectionRef, record_hash
from tpde.runtime import frame_threads
from tpde.store.blob import BlobWriter

#: Pieces smaller than this are encoded in batches of about this size, one task each: a task
#: per small tensor cost more in hand-offs between threads than in coding.
BATCH_BYTES = 1 << 20

#: Pieces up to this size that are bit-identical to the step before are told so on the
#: writing thread (``StepSave.unchanged``), without a task.
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


def record_of(name: str, dt: dtypes.DType, numel: int, device: str, enc: encoder.Encoding,
              digest: str, ref: int | None, blob: BlobWriter, start: int | None, *,
              bound: quant.Bound | None = None, parts: int | None = None) -> Record:
    """A coded piece's record, its sections appended to ``blob``: the one place a piece's
    coding becomes what a manifest says of it, for a step and for a rank's share of one."""
    return Record(name, dt.name, numel, device, enc.codec, digest, ref, enc.residual, enc.count,
                  put_sections(blob, enc.sections), start, enc.grid, enc.scale,
                  bound.as_dict() if bound else None,
                  dict(zip(("abs", "rel"), enc.error)) if enc.error else None, parts=parts)


def copy_words(words: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
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


def piece_words(piece: Piece) -> tuple[dtypes.DType, torch.Tensor]:
    """A piece's dtype and its words (a view of its span's)."""
    dt = dtypes.of_tensor(piece.span.tensor, name=piece.span.name)
    w = dt.words_per_element
    words = transform.to_words(piece.span.tensor.detach(), dt.word_dtype)
    return dt, words[piece.lo * w : piece.hi * w]


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


@dataclass
class Saved:
    """What a save wrote: its records in order, the deepest lineage among them, and the next
    save's reference (``Reference``'s fields)."""

    records: list[Record] = field(default_factory=list)
    deepest: int = 0
    words: dict[str, torch.Tensor] = field(default_factory=dict)
    choices: dict[str, encoder.Choice] = field(default_factory=dict)
    held_at: dict[str, int] = field(default_factory=dict)
    since: dict[str, int] = field(default_factory=dict)


class StepSave:
    """One save's pieces, coded and appended to ``blob`` as ``plan`` says.

    Args:
        reader: the run's reader, for the reference step's manifests and stored words.
        plan: what to store and against what.
        reference: the reference's held words, consumed as pieces are coded (None: a
            keyframe step).
        blob: the step's blob, open for writing.
        settings: the codec's settings.
        keep_reference: keep each piece's words as the next save's reference.
        owned: the spans are private host copies, kept as they are instead of copied.
        bounds: the error bound of a span by any of its names (None: exact).
    """

    def __init__(self, reader: Reader, plan: SavePlan, reference: Reference | None,
                 blob: BlobWriter, settings: encoder.Settings, *, keep_reference: bool,
                 owned: bool, bounds: Callable[..., quant.Bound | None] | None) -> None:
        self.reader, self.plan, self.reference, self.blob = reader, plan, reference, blob
        self.settings, self.keep, self.owned = settings, keep_reference, owned
        self.bounds = bounds
        self.prev = reader.run.manifest(plan.reference) if plan.reference is not None else None
        self.saved = Saved()
        #: While every piece so far was bit-identical to the held words of the step before.
        self.repeat = not plan.star and self.prev is not None and reference.held

    def run(self, max_inflight_bytes: int) -> Saved:
        """Code every piece, at most ``max_inflight_bytes`` of them (and at least one batch)
        at once, and append them in order."""
        workers = self.settings.threads or frame_threads.default_threads()
        with ThreadPoolExecutor(workers, thread_name_prefix="tpde-encode") as pool:
            pending: deque[tuple[list[Piece], int, Future]] = deque()
            inflight = 0
            # Bounded by bytes alone: a cap of a few batches in flight left every thread but
            # one idle while the oldest, a large tensor, was still being coded.
            todo = self.plan.pieces
            for batch in batches(todo, [p.nbytes for p in todo], BATCH_BYTES):
                known = [self.unchanged(p) for p in batch]
                if all(known):
                    done: Future = Future()
                    done.set_result(known)
                    pending.append((batch, 0, done))
                    continue
                size = sum(p.nbytes for p in batch)
                while pending and inflight + size > max_inflight_bytes:
                    inflight -= self._append_oldest(pending)
                pending.append((batch, size, pool.submit(self.code, batch, known)))
                inflight += size
            while pending:
                self._append_oldest(pending)
        return self.saved

    def _append_oldest(self, pending: deque[tuple[list[Piece], int, Future]]) -> int:
        """Append the oldest batch in flight (waiting for it); its size."""
        batch, size, fut = pending.popleft()
        for piece, done in zip(batch, fut.result()):
            self.append(piece, done)
        return size

    def bound_of(self, piece: Piece) -> quant.Bound | None:
        """A pack holds no bounded span, whatever its name matches (``tree.pack``)."""
        return self.bounds(*piece.span.names) if self.bounds is not None \
            and not piece.span.parts else None

    def same(self, piece: Piece, dt: dtypes.DType, host: torch.Tensor | None,
             enc: encoder.Encoding, bound: quant.Bound | None, src: int) -> Encoded:
        """Bit-identical to ``src``'s words, whose hash is known: a repeated save hashes
        nothing, and the record points where that step's data is."""
        held = self.reader.run.manifest(src).record(piece.name)
        return Encoded(dt, host if self.keep else None, enc, held.hash, bound, holder(src, held),
                       self.plan.depth_after(piece.name, src, unchanged=True), src)

    def begin(self, piece: Piece) -> Started | Encoded:
        """What a piece is coded from (its words, its reference's, the buffer its words
        may be kept in), or its record already, where it is as saved at the reference
        step (against keyframes: its hash tells)."""
        plan, reference, prev = self.plan, self.reference, self.prev
        dt, words = piece_words(piece)
        ref_words = spare = reference.words.pop(piece.name, None) if reference else None
        src = plan.source(piece.name)
        digest = None
        was = prev.record(piece.name) if plan.star and prev is not None else None
        if was is not None and was.dtype == dt.name and was.numel == piece.hi - piece.lo:
            digest = record_hash(words.contiguous().view(torch.uint8).cpu().numpy())
            if digest == was.hash:
                # As saved at the reference step, which a keyframe's words no longer tell
                # (nor the plan, which may have this tensor re-keyed now).
                at = plan.sources[piece.name]
                if reference.at.get(piece.name) != at:
                    ref_words = None  # read back at the next save
                return Encoded(dt, ref_words if self.keep else None, encoder.Encoding("same"),
                               digest, None, holder(prev.step, was),
                               record_depth(self.reader.run.lazy(), was), at)
        if src is None:
            ref_words = None
        elif not reference.held or (plan.star and (ref_words is None
                                                   or reference.at.get(piece.name) != src)):
            # None held, or (against keyframes) held for a keyframe re-based away since.
            ref_words = self.reader.stored_words(src, piece.name)
        if plan.star and src is not None:
            spare = None  # the keyframe's words stay the reference
        choice = reference.choices.get(piece.name) if reference else None
        return Started(dt, words, ref_words, spare, src, digest, self.bound_of(piece), choice)

    def finish(self, piece: Piece, at: Started, enc: encoder.Encoding | None) -> Encoded:
        """The piece's record from its coding (None: coded here, every option weighed),
        and the words the next save codes against."""
        dt, words, ref_words, spare, src, digest, bound, choice = at
        if enc is None:
            enc = encoder.encode(words, ref_words, dt.kind, self.settings, bound=bound,
                                 dtype=dt.name, choice=choice)
        if enc.keyed:
            src = None
        if self.plan.star and src is not None:
            host = ref_words  # the next delta is coded against the same keyframe
        elif enc.words is not None:  # error-bounded: what a reader rebuilds
            host = enc.words.to("cpu")
        elif enc.codec == "same" and ref_words is not None and not ref_words.is_cuda:
            host = ref_words  # the reference's own words: an unchanged tensor is not copied
        elif words.is_cuda or (self.keep and not self.owned):
            host = copy_words(words, spare)  # the last reference's buffer is done with now
        else:
            host = words
        if enc.codec == "same":
            return self.same(piece, dt, host, enc, bound, src)
        if enc.words is not None:
            digest = record_hash(enc.words.to("cpu").view(torch.uint8).numpy())
        elif digest is None:  # (taken already of the same words where it was compared)
            digest = record_hash(host.view(torch.uint8).numpy())
        return Encoded(dt, host if self.keep else None, enc, digest, bound, src,
                       self.plan.depth_after(piece.name, src, unchanged=False), src)

    def code(self, batch: list[Piece], known: list[Encoded | None]) -> list[Encoded]:
        """A batch's exact pieces coded together where ``encoder.encode_many`` can (their
        coding settled before anything is compressed), the others one by one."""
        started = [k or self.begin(p) for p, k in zip(batch, known)]
        todo = [i for i, a in enumerate(started) if isinstance(a, Started) and a.bound is None]
        coded: list[encoder.Encoding | None] = [None] * len(batch)
        if todo:
            jobs = [started[i] for i in todo]
            for i, enc in zip(todo, encoder.encode_many(
                    [(a.words, a.ref_words, a.dtype.kind, a.choice) for a in jobs],
                    self.settings)):
                coded[i] = enc
        return [a if isinstance(a, Encoded) else self.finish(p, a, coded[i])
                for i, (p, a) in enumerate(zip(batch, started))]

    def unchanged(self, piece: Piece) -> Encoded | None:
        """While every piece so far was bit-identical to the held words of the step before
        (a step saved again, as Lightning's ``last`` is), a small host piece that is too,
        told on this thread as its task would code it: no task for it, and no hand-off
        of the GIL between threads at every torch call on it, which made the encode
        threads slower at it than this one. The first piece that changed ends the
        checks: on this thread beside the encode threads they slowed a delta save."""
        if not self.repeat or piece.name in self.plan.keyed or piece.nbytes > UNCHANGED_BYTES:
            return None
        ref_words = self.reference.words.get(piece.name)
        if ref_words is None or piece.span.tensor.is_cuda or ref_words.is_cuda:
            return None
        dt, words = piece_words(piece)
        # numpy's comparison: several times faster here than torch.equal.
        if ref_words.dtype != words.dtype or ref_words.shape != words.shape \
                or not np.array_equal(words.numpy(), ref_words.numpy()):
            self.repeat = False
            return None
        del self.reference.words[piece.name]
        return self.same(piece, dt, ref_words, encoder.Encoding(
            "same", choice=self.reference.choices.get(piece.name)), self.bound_of(piece),
            self.prev.step)

    def append(self, piece: Piece, done: Encoded) -> None:
        """Append a coded piece to the blob, and keep its record and reference words."""
        dt, host, enc, digest, bound, ref, d, src = done
        saved = self.saved
        if self.plan.star:  # a keyframe record's words are its own step's
            saved.held_at[piece.name] = self.plan.step if src is None else src
            saved.since[piece.name] = 0 if src is None else \
                self.plan.depths[piece.name] + (enc.codec != "same")
        saved.deepest = max(saved.deepest, d)
        saved.records.append(record_of(piece.name, dt, piece.hi - piece.lo, piece.span.device,
                                       enc, digest, ref, self.blob, piece.start, bound=bound,
                                       parts=piece.span.parts or None))
        if host is not None:
            saved.words[piece.name] = host
        if enc.choice is not None:
            saved.choices[piece.name] = enc.choice
