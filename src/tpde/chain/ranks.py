"""A sharded step, written by many ranks: each rank's pieces coded into a blob of its own, as
deltas against the piece of the same name at the reference step (whichever rank wrote it), and
the step committed once, from every rank's records, in one manifest.

The DCP storage layer (``tpde.dcp``) hands its chunks here; what to store and how is decided
and done here, with the same piece cuts, re-keying and record coding as a whole step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from tpde.chain.plan import batches, candidates, cut, piece_starts, plan_keys, record_depth
from tpde.chain.save import record_of
from tpde.chain.write import PIECE_BYTES, Writer
from tpde.codec import dtypes, encoder, transform
from tpde.manifest import Manifest, Record, format_for, record_hash
from tpde.store.blob import BlobWriter


@dataclass(frozen=True)
class RankPiece:
    """One record a rank writes: elements ``lo:hi`` of its item ``item`` (a chunk whole, or one
    of its pieces, named ``<chunk>/<start>``)."""

    item: int
    name: str
    start: int | None
    lo: int
    hi: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.itemsize


@dataclass(frozen=True)
class Held:
    """A rank's words of the last save it made, kept for the next: the step, the blob that
    holds them (a step of the same number written again is another blob), and the words."""

    step: int
    blob: str
    words: dict[str, torch.Tensor]


@dataclass
class Share:
    """What a rank wrote of one item: its records, in the rank's blob."""

    blob: str
    size: int
    records: list[Record]


class RankSave:
    """One rank's share of step ``step``, coded against the committed step ``reference``.

    Args:
        writer: the run's writer.
        step: the step being saved.
        rank: this rank, which names its blob.
        reference: the step every rank codes against (None: keyframe records only).
        settings: the codec's settings.
        keyframe_every: as for a whole step.
        max_inflight_bytes: pieces are at most half of it (or ``PIECE_BYTES``).
        held: this rank's words of its last save (None: every reference is read back).
        choices: each piece's delta coding as last chosen, updated as pieces are coded.
        keep: keep this save's words (``kept``) for the next save.
    """

    def __init__(self, writer: Writer, step: int, rank: int, reference: int | None, *,
                 settings: encoder.Settings, keyframe_every: int, max_inflight_bytes: int,
                 held: Held | None, choices: dict[str, encoder.Choice], keep: bool) -> None:
        self.writer, self.step, self.settings = writer, step, settings
        self.keyframe_every, self.choices = keyframe_every, choices
        self.blob_name = writer.blob_for(step, f"r{rank}")
        self.prev = writer.run.manifest(reference) if reference is not None else None
        self.most = max(1, max_inflight_bytes // 2)
        self.per = min(PIECE_BYTES, self.most)
        self.follow = piece_starts(self.prev)
        self.held = held if held is not None and self.prev is not None \
            and held.step == self.prev.step \
            and any(s["blob"] == held.blob for s in self.prev.shards) else None
        self.kept: dict[str, torch.Tensor] | None = {} if keep else None

    def pieces(self, item: int, base: str, numel: int, itemsize: int) -> list[RankPiece]:
        """The records of an item of ``numel`` elements named ``base``, cut as ``plan.cut``
        says (as the reference step cut them, where it did)."""
        parts, whole = cut(numel, max(1, self.per // itemsize), self.follow.get(base),
                           self.most // itemsize)
        if whole:
            return [RankPiece(item, base, None, 0, numel, itemsize)]
        return [RankPiece(item, f"{base}/{lo}", lo, lo, hi, itemsize) for lo, hi in parts]

    def batches(self, todo: Sequence[RankPiece]) -> list[list[RankPiece]]:
        """``todo`` in runs coded at once: at most a piece's bytes of them."""
        return batches(todo, [p.nbytes for p in todo], self.per)

    def references(self, pieces: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The reference step's words of the pieces coded as deltas here: this rank's held
        words where it saved them, the rest read back (chunks another rank wrote)."""
        prev = self.prev
        if prev is None:
            return {}
        usable = [piece for piece, t in pieces
                  if (rec := prev.record(piece)) is not None and rec.numel == t.numel()
                  and rec.dtype == dtypes.of_tensor(t, name=piece).name]
        keyed = plan_keys(candidates(self.writer.run.lazy(), prev.step, usable),
                          self.keyframe_every)
        wanted = [p for p in usable if p not in keyed]
        out = {p: self.held.words[p] for p in wanted if p in self.held.words} \
            if self.held is not None else {}
        rest = [p for p in wanted if p not in out]
        if rest:
            out.update(self.writer.reader.materialize(prev.step, rest))
        return out

    def record(self, blob: BlobWriter, piece: str, start: int | None, t: torch.Tensor,
               device: str, ref_words: torch.Tensor | None) -> Record:
        """Code one piece (``t``, on the host or a GPU) against ``ref_words`` into ``blob``."""
        dt = dtypes.of_tensor(t, name=piece)
        words = transform.to_words(t, dt.word_dtype)
        if words.is_cuda:
            import tpde.kernels.nvcomp  # noqa: F401  (registers the GPU's compressor)
        enc = encoder.encode(words, ref_words, dt.kind, self.settings, dtype=dt.name,
                             choice=self.choices.pop(piece, None))
        if enc.choice is not None:
            self.choices[piece] = enc.choice
        prev, ref = self.prev, None
        if not enc.keyed and prev is not None:
            before = prev.record(piece)
            ref = before.ref if enc.codec == "same" and before.codec == "same" else prev.step
        digest = (prev.record(piece).hash if enc.codec == "same" and prev is not None
                  else record_hash(words.view(torch.uint8).numpy()))
        if self.kept is not None:  # the next save's reference: a copy training cannot change
            self.kept[piece] = words.clone()
        return record_of(piece, dt, t.numel(), device, enc, digest, ref, blob, start)


def commit_shards(writer: Writer, step: int, shares: Sequence[Share], *, skeleton: Any,
                  layout: dict[str, Any], started: float) -> Manifest:
    """Commit ``step`` from every rank's shares (their blobs durable), each record naming the
    blob it is in; ``layout`` is the engine's metadata as JSON, ``started`` when the save
    began (``time.perf_counter``)."""
    blobs: dict[str, int] = {}  # each rank's blob, by its index in the manifest's shards
    sizes: list[int] = []
    records: list[Record] = []
    for share in shares:
        if share.blob not in blobs:
            blobs[share.blob] = len(sizes)
            sizes.append(share.size)
        records += [replace(r, shard=blobs[share.blob]) for r in share.records]
    refs = {r.ref for r in records if r.ref is not None}
    deepest = max((record_depth(writer.run.lazy(), r) for r in records), default=0)
    m = Manifest(step=step, keyframe=not refs, depth=deepest,
                 parent=max(refs) if refs else None, blob=None, blob_size=0,
                 created=time.time(), seconds=time.perf_counter() - started,
                 skeleton=skeleton, records=records, format=format_for(records, sharded=True),
                 shards=[{"blob": b, "size": sizes[i]} for b, i in blobs.items()], dcp=layout)
    writer.mark_run()
    return writer.commit(m, new=True)
