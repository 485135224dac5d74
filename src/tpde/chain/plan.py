"""Planning, apart from doing: which records a step stores, which of its tensors are re-keyed,
which records a re-base rewrites and against what, in which batches a rebuild runs.

Everything here is a pure function of manifests and sizes: no store, no tensors' values. The
executors (``write``, ``read``, ``retain``) carry the plans out.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from tpde.errors import TPDEError
from tpde.manifest import Manifest, Record
from tpde.state import tree

#: Chosen on real training chains (benchmarks/README.md): for bf16 weights 8 -> 16 -> 32 gives
#: 4.15x -> 4.69x -> 5.38x while restoring the deepest step gets several times slower; dense
#: fp32 state gains nothing past 4. 16 keeps most of the ratio and at most 15 deltas per restore.
DEFAULT_KEYFRAME_EVERY = 16

#: What a delta is coded against: the step saved before (the default), or its tensor's last
#: keyframe record, so that restoring any step decodes at most one delta of each tensor.
PREVIOUS, KEYFRAME = "previous", "keyframe"
DELTAS_AGAINST = (PREVIOUS, KEYFRAME)


@dataclass(frozen=True)
class Piece:
    """Elements ``lo:hi`` of a span, stored as one record: the whole span, or one of its
    pieces, named ``<span>/<lo>`` (no tensor's path continues another tensor's path)."""

    span: tree.Span
    lo: int
    hi: int
    whole: bool

    @property
    def name(self) -> str:
        return self.span.name if self.whole else f"{self.span.name}/{self.lo}"

    @property
    def start(self) -> int | None:
        return None if self.whole else self.lo

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.span.tensor.element_size()


def pieces(flat: tree.Flat, piece_bytes: int, follow: Mapping[str, list[int]],
           most_bytes: int) -> Iterator[Piece]:
    """What a step stores, in order: each span whole, or in pieces of at most ``piece_bytes``;
    a span the reference step stored in pieces (``follow``: their starts by span, from
    ``piece_starts``), of at most ``most_bytes`` each, in the same pieces."""
    for span in flat.spans:
        size = span.tensor.element_size()
        parts, whole = cut(span.tensor.numel(), max(1, piece_bytes // size),
                           follow.get(span.name), most_bytes // size)
        for lo, hi in parts:
            yield Piece(span, lo, hi, whole)


def cut(n: int, per: int, starts: list[int] | None, most: int
        ) -> tuple[list[tuple[int, int]], bool]:
    """Elements ``[lo, hi)`` of each piece of a span of ``n`` elements, and whether the span is
    stored whole: where the reference step cut it at ``starts`` into pieces of at most ``most``
    elements, there (a piece is coded against the same piece at the reference, so a writer
    with another piece size keeps its deltas); otherwise pieces of ``per`` elements, or the
    whole span if it fits one."""
    if starts and starts[0] == 0 and starts[-1] < n:
        ends = [*starts[1:], n]
        if all(0 < b - a <= most for a, b in zip(starts, ends)):
            return list(zip(starts, ends)), False
    if n <= per:
        return [(0, n)], True
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)], False


def piece_starts(m: Manifest | None) -> dict[str, list[int]]:
    """Where step ``m`` cut each span it stored in pieces, by span name."""
    return {recs[0].span: [r.start for r in recs] for recs in (m.spans() if m else [])
            if recs[0].start is not None}


T = TypeVar("T")


def batches(items: Sequence[T], size: Mapping[int, int] | Sequence[int], limit: int
            ) -> list[list[T]]:
    """``items`` in order, in runs of at most ``limit`` bytes (``size[i]`` is item i's; at least
    one item a run)."""
    out: list[list[T]] = []
    total = 0
    for i, item in enumerate(items):
        if out and total + size[i] <= limit:
            out[-1].append(item)
            total += size[i]
        else:
            out.append([item])
            total = size[i]
    return out


# ---------------------------------------------------------------- per-tensor keyframes
@dataclass(frozen=True)
class Candidate:
    """A tensor about to be saved: how many deltas deep its reference is (None: it has no
    reference record, so it is a keyframe record whatever the plan says), and whether that
    lineage starts at a whole-keyframe step (every tensor keyed at once)."""

    name: str
    depth: int | None
    synced: bool = False
    #: The step of the keyframe record its lineage starts from (None: it has no record).
    source: int | None = None


def phase(name: str, keyframe_every: int) -> int:
    """A tensor's own offset in ``[0, keyframe_every // 2)``, the same in every process."""
    return zlib.crc32(name.encode()) % max(1, keyframe_every // 2)


def candidates(manifests: Mapping[int, Manifest], step: int, names: Iterable[str], *,
               since: Mapping[str, tuple[int, int]] | None = None) -> list[Candidate]:
    """The tensors ``names`` as candidates for ``plan_keys``, against their records at
    ``step``. With ``since`` (deltas coded against keyframes, which are all one delta deep) a
    candidate's depth is instead the deltas stored since its keyframe record: ``since``'s
    count, by tensor, where it holds one for that record's step (a writer keeps them up), or
    else counted over the committed steps."""
    out = []
    steps: list[int] | None = None
    for name in names:
        found = keyed_at(manifests, step, name)
        if found is None:
            out.append(Candidate(name, None))
            continue
        deep, at = found
        if since is not None:
            kept = since.get(name)
            if kept is not None and kept[0] == at:
                deep = kept[1]
            else:
                steps = sorted(manifests) if steps is None else steps  # one listing a save
                deep = deltas_since(manifests, steps, at, step, name)
        out.append(Candidate(name, deep, manifests[at].keyframe, at))
    return out


def deltas_since(manifests: Mapping[int, Manifest], steps: Sequence[int], key: int, step: int,
                 name: str) -> int:
    """Records of ``name`` that store a delta, in ``steps`` after ``key`` up to ``step``."""
    count = 0
    for s in steps[bisect.bisect_right(steps, key) : bisect.bisect_right(steps, step)]:
        m = manifests.get(s)
        rec = m.record(name) if m is not None else None
        count += rec is not None and rec.codec != "same" and rec.ref is not None
    return count


def plan_keys(candidates: Sequence[Candidate], keyframe_every: int) -> set[str]:
    """The tensors re-keyed at this step.

    A tensor is re-keyed when one more delta would reach ``keyframe_every`` decodes, so
    restoring any tensor never decodes more than ``keyframe_every - 1`` deltas. Unchanged
    tensors add no depth (their records point at the data), so a frozen tensor is stored once
    for the life of the run. Tensors keyed all at once (the first step of a run) are re-keyed
    early once, each at its own ``phase``: from then on their keyframes, and the cost of
    writing them, fall on different steps instead of all arriving every ``keyframe_every``.
    """
    return {c.name for c in candidates if c.depth is None
            or c.depth + 1 >= keyframe_every - (phase(c.name, keyframe_every) if c.synced else 0)}


# ---------------------------------------------------------------- a save
@dataclass(frozen=True)
class SavePlan:
    """What a step stores and against what, decided before any tensor's words are read.

    ``pieces`` are the records in the order they are written. ``reference`` is the step the
    deltas are coded against (None: every record is a keyframe record). ``keyed`` names the
    pieces re-keyed at this step (``plan_keys``); ``depths`` and ``sources`` give each piece's
    deltas since its keyframe record and that record's step, as ``candidates`` found them.
    """

    step: int
    pieces: tuple[Piece, ...]
    reference: int | None
    keyed: frozenset[str]
    depths: Mapping[str, int | None]
    sources: Mapping[str, int | None]
    against: str = PREVIOUS

    @property
    def star(self) -> bool:
        """Deltas are coded against each tensor's keyframe record (at most one deep)."""
        return self.against == KEYFRAME

    def source(self, name: str) -> int | None:
        """The step whose words piece ``name`` is coded against (None: a keyframe record)."""
        if name in self.keyed or self.reference is None:
            return None
        return self.sources[name] if self.star else self.reference

    def depth_after(self, name: str, source: int | None, unchanged: bool) -> int:
        """Deltas a restore decodes for piece ``name`` as saved here, coded against
        ``source`` (None: a keyframe record); an unchanged record adds none."""
        if source is None:
            return 0
        if self.star:
            return 0 if unchanged else 1
        return self.depths[name] + (not unchanged)

    def stale(self, held_at: Mapping[str, int]) -> dict[int, list[str]]:
        """Against keyframes: the pieces whose held keyframe words (``held_at``: their step,
        by name) are of a keyframe record re-based away since, by the step of their keyframe
        record now. Their words are read back from there before the save."""
        out: dict[int, list[str]] = {}
        if not self.star:
            return out
        for p in self.pieces:
            at = self.sources.get(p.name)
            if p.name not in self.keyed and at is not None and held_at.get(p.name) != at:
                out.setdefault(at, []).append(p.name)
        return out


def plan_save(manifests: Mapping[int, Manifest], step: int, flat: tree.Flat,
              reference: int | None, *, keyframe_every: int, piece_bytes: int, most_bytes: int,
              against: str = PREVIOUS, since: Mapping[str, tuple[int, int]] | None = None
              ) -> SavePlan:
    """The plan of saving ``flat`` as ``step`` against the committed step ``reference``.

    Spans are cut into pieces of at most ``piece_bytes``, or as the reference step cut them
    (pieces of at most ``most_bytes``). Against keyframes, ``since`` gives each tensor's
    deltas since its keyframe record where the writer kept count (``candidates``).
    """
    prev = manifests[reference] if reference is not None else None
    todo = tuple(pieces(flat, piece_bytes, piece_starts(prev), most_bytes))
    names = [p.name for p in todo]
    found = candidates(manifests, reference, names, since=since if against == KEYFRAME
                       else None) if reference is not None else [Candidate(n, None)
                                                                 for n in names]
    return SavePlan(step, todo, reference, frozenset(plan_keys(found, keyframe_every)),
                    {c.name: c.depth for c in found}, {c.name: c.source for c in found},
                    against)


# ---------------------------------------------------------------- a rebuild
Lineage = list[tuple[int, Record]]


@dataclass(frozen=True)
class RebuildPlan:
    """What rebuilding a step's records decodes, step by step, before anything is read.

    ``units`` are (step, batch) in step order, each batch's records with whether their
    rebuilt words are hash-checked there. ``final`` gives, by tensor, the step whose record
    gives its final words; ``taken`` the step after whose record a caller's earlier words
    (``passing``) are taken; ``broken`` the tensors whose lineage cannot be followed, with why.
    """

    step: int
    wanted: tuple[Record, ...]
    units: tuple[tuple[int, tuple[tuple[Record, bool], ...]], ...]
    final: Mapping[str, int]
    taken: Mapping[str, int]
    broken: tuple[tuple[str, TPDEError], ...] = ()


def plan_rebuild(target: Manifest, wanted: Sequence[Record],
                 lineage: Callable[[str, int], Lineage], *, batch_bytes: int,
                 check: bool = True, check_every: bool = False,
                 passing: Mapping[str, int] | None = None) -> RebuildPlan:
    """The plan of rebuilding ``wanted`` (records of ``target``) from their lineages
    (``lineage(name, step)``: the records to decode, keyframe first), in batches of about
    ``batch_bytes`` of words per step. Words are checked where they are final (``check``),
    or at every record on the way (``check_every``), and where ``passing`` (by tensor, an
    earlier step a caller wants the words of too) is passed on the way."""
    by_step: dict[int, list[tuple[Record, bool]]] = {}
    final: dict[str, int] = {}
    taken: dict[str, int] = {}
    broken: list[tuple[str, TPDEError]] = []
    passing = passing or {}
    for rec in wanted:
        try:
            found = lineage(rec.name, target.step)
        except TPDEError as exc:
            broken.append((rec.name, exc))
            continue
        if rec.name in passing:
            on_way = lineage(rec.name, passing[rec.name])
            if found[: len(on_way)] == on_way:  # rebuilt on the way to ``step``
                taken[rec.name] = on_way[-1][0]
        for i, (at, r) in enumerate(found):
            by_step.setdefault(at, []).append(
                (r, check_every or (check and i == len(found) - 1) or taken.get(rec.name) == at))
        final[rec.name] = found[-1][0]
    units = tuple((at, tuple(batch)) for at in sorted(by_step) for batch in batches(
        by_step[at], [r.raw_bytes for r, _ in by_step[at]], batch_bytes))
    return RebuildPlan(target.step, tuple(wanted), units, final, taken, tuple(broken))


# ---------------------------------------------------------------- lineages
def holder(step: int, rec: Record) -> int:
    """The step whose record holds ``rec``'s data (an unchanged record points there)."""
    return rec.ref if rec.codec == "same" and rec.ref is not None else step


def depth(manifests: Mapping[int, Manifest], step: int, name: str) -> int | None:
    """Deltas decoded to rebuild ``name`` at ``step`` (None: no record, or a broken lineage)."""
    found = keyed_at(manifests, step, name)
    return None if found is None else found[0]


def record_depth(manifests: Mapping[int, Manifest], rec: Record) -> int:
    """Deltas decoded to rebuild ``rec`` (0 where its lineage is broken: nothing to bound)."""
    if rec.ref is None:
        return 0
    below = depth(manifests, rec.ref, rec.name) or 0
    return below + (rec.codec != "same")


def keyed_at(manifests: Mapping[int, Manifest], step: int, name: str
             ) -> tuple[int, int] | None:
    """(deltas decoded, step of the keyframe record) to rebuild ``name`` at ``step``."""
    n, at = 0, step
    while True:
        m = manifests.get(at)
        rec = m.record(name) if m is not None else None
        if rec is None:
            return None
        if rec.ref is None:  # a keyframe record (exact, or error-bounded)
            return n, at
        if rec.codec != "same":
            n += 1
        if rec.ref is None:
            return None
        at = rec.ref


# ---------------------------------------------------------------- re-basing
@dataclass(frozen=True)
class Rewrite:
    """One record of a kept step that must stop depending on a step that is going.

    ``how``: ``"same"`` (its words equal ``against``'s: point at that record's data, nothing is
    decoded), ``"repoint"`` (a delta whose reference is an unchanged record of the step
    ``against``'s data: the delta is kept as it is and points there), ``"copy"`` (its data is a
    keyframe record held elsewhere: its frames are copied as they are), or ``"recode"``
    (decoded and coded again, against ``against``'s words, or as a keyframe when ``against``
    is None).
    """

    name: str
    how: str
    against: int | None


def plan_rebase(manifests: Mapping[int, Manifest], kept: Iterable[int],
                against: str = PREVIOUS) -> list[tuple[int, list[Rewrite]]]:
    """For each kept step, oldest first, the records to rewrite so that no kept step builds
    on a step outside ``kept``.

    A record is rewritten when the step it reads from (its reference, or for an unchanged
    record the step holding its data) is not kept. Earlier kept steps are rewritten first, so
    a record that reads from a kept step is already safe: that step's words never change. A
    record re-coded as a delta is coded against the newest kept step before it with a record
    of its tensor, or where the run codes deltas against keyframes (``against``), the newest
    with a keyframe record of it, so that it stays one delta deep.
    """
    order = sorted(s for s in set(kept) if manifests.get(s) is not None)
    keep = set(order)
    last_seen: dict[str, int] = {}  # the newest kept step so far with a record of each tensor
    last_key: dict[str, int] = {}  # and with a keyframe record of it
    plan: list[tuple[int, list[Rewrite]]] = []
    for step in order:
        m = manifests[step]
        todo = []
        for rec in m.records:
            prev = last_seen.get(rec.name)
            last_seen[rec.name] = step
            if rec.ref is None or rec.ref in keep:  # a keyframe record, or reading a kept step
                if rec.ref is None:
                    last_key[rec.name] = step
                continue
            if prev is not None and manifests[prev].record(rec.name).hash == rec.hash:
                todo.append(Rewrite(rec.name, "same", prev))
            elif (at := _unchanged_from(manifests, rec)) in keep:
                # The words it was coded against are that kept step's: Lightning's `last`
                # beside each top-k checkpoint, removed under a delta coded against it.
                todo.append(Rewrite(rec.name, "repoint", at))
            elif prev is None and _held_as_key(manifests, step, rec):
                todo.append(Rewrite(rec.name, "copy", None))
                last_key[rec.name] = step
            else:
                v = last_key.get(rec.name) if against == KEYFRAME else prev
                todo.append(Rewrite(rec.name, "recode", v))
                if v is None:
                    last_key[rec.name] = step
        if todo:
            plan.append((step, todo))
    return plan


def _unchanged_from(manifests: Mapping[int, Manifest], rec: Record) -> int | None:
    """Where a delta's reference record is an unchanged one, the step holding that data (the
    delta's reference words, at the same depth); None otherwise."""
    m = manifests.get(rec.ref) if rec.codec != "same" and rec.ref is not None else None
    below = m.record(rec.name) if m is not None else None
    return below.ref if below is not None and below.codec == "same" else None


def _held_as_key(manifests: Mapping[int, Manifest], step: int, rec: Record) -> bool:
    at = holder(step, rec)
    m = manifests.get(at)
    data = m.record(rec.name) if m is not None else None
    return data is not None and data.ref is None


# ---------------------------------------------------------------- bytes at rest
@dataclass
class AtRest:
    """What a run holds in its store, and why.

    ``visible``: blobs and manifests of visible steps. ``hidden``: those of hidden steps still
    kept, by step, with the visible steps that read from them (none: kept as a writer's
    reference, or waiting for ``gc``). ``damaged``: by step, the manifest that cannot be read
    and the blobs named after its step (``gc`` refuses to run while one is there).
    ``leftovers``: blobs no manifest names and temporary files (a save in progress, or crashed
    ones that ``gc`` deletes after its grace period). ``plain``: the raw tensor bytes of the
    visible steps, the least the plain format's files would hold for them, which bounds what a
    writer lets removed steps keep (``Checkpointer.remove(..., defer=True)``); ``largest``: the
    raw tensor bytes of the largest visible step, which bounds what a re-base writes before it
    deletes what it replaces.
    """

    visible: int = 0
    plain: int = 0
    largest: int = 0
    hidden: dict[int, int] = field(default_factory=dict)
    needed_by: dict[int, list[int]] = field(default_factory=dict)
    damaged: dict[int, int] = field(default_factory=dict)
    leftovers: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return (self.visible + sum(self.hidden.values()) + sum(self.damaged.values())
                + self.leftovers + self.other)

    def as_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "visible_bytes": self.visible,
                "plain_bytes": self.plain,
                "hidden_bytes": sum(self.hidden.values()),
                "hidden_steps": [{"step": s, "bytes": b, "needed_by": self.needed_by.get(s, [])}
                                 for s, b in sorted(self.hidden.items())],
                "damaged_steps": [{"step": s, "bytes": b} for s, b in sorted(self.damaged.items())],
                "leftover_bytes": self.leftovers, "other_bytes": self.other}


def readers_of(manifests: Mapping[int, Manifest], visible: Iterable[int]) -> dict[int, list[int]]:
    """For every step some visible step's rebuild reads, the visible steps that read it."""
    out: dict[int, set[int]] = {}
    for v in visible:
        todo, seen = [v], {v}
        while todo:
            m = manifests.get(todo.pop())
            for ref in m.refs() if m is not None else ():
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
                    out.setdefault(ref, set()).add(v)
    return {s: sorted(v) for s, v in out.items()}
