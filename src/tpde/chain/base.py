"""The run object every part of the chain works on: the run's layout, its listings and its
(cached) manifests. Reading, writing and retention are parts composed over it (``chain.Chain``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from tpde.chain.plan import KEYFRAME, PREVIOUS
from tpde.codec import encoder
from tpde.errors import CorruptionError, NotARunError, StepNotFoundError, TPDEError
from tpde.manifest import Manifest, Record, parse
from tpde.store.protocol import ByteStore
from tpde.store.store import Store

MARKER, STEPS, REMOVED, DATA = "tpde.json", "steps", "removed", "data"
Progress = Callable[[int], None]


def name(step: int) -> str:
    return f"{step:020d}"


def numbered(files: Iterable[tuple[str, int]], suffix: str = "") -> dict[int, int]:
    """Step number -> size of the listed files named ``<step><suffix>``."""
    out = {}
    for path, size in files:
        stem = path.rsplit("/", 1)[-1]
        if suffix:
            if not stem.endswith(suffix):
                continue
            stem = stem[: -len(suffix)]
        if stem.isdigit():
            out[int(stem)] = size
    return out


def manifest_path(step: int) -> str:
    return f"{STEPS}/{name(step)}.json"


@dataclass
class Reference:
    """What the next delta is coded against: the step last saved or loaded, and (when the writer
    keeps it in memory: ``held``) the host words of its records. A reference not held is read
    back from the chain, tensor by tensor, as the next save codes against it."""

    step: int
    words: dict[str, torch.Tensor]
    held: bool = True
    #: Each tensor's delta coding as last chosen, tried first at the next save.
    choices: dict[str, encoder.Choice] = field(default_factory=dict)
    #: Deltas against keyframes only: the step whose words ``words`` holds, by tensor (its
    #: keyframe record's, not ``step``), and how many deltas it has stored since.
    at: dict[str, int] = field(default_factory=dict)
    since: dict[str, int] = field(default_factory=dict)


@dataclass
class GcReport:
    freed_bytes: int = 0
    deleted: list[str] = field(default_factory=list)
    purged_steps: list[int] = field(default_factory=list)
    #: Kept steps rewritten so that they stop reading from steps that went.
    rebased_steps: list[int] = field(default_factory=list)
    rewritten_records: int = 0
    rebase_seconds: float = 0.0


@dataclass(frozen=True)
class Reads:
    """What restoring a step decodes: every record on the way to each of its tensors' words,
    keyframe records first. A restore's time follows these stored bytes, not the step's own: a
    delta of dense fp32 state stores over half what its keyframe does, so a step deep in a
    chain decodes several times what its keyframe stores (``benchmarks/deep_bench.py``)."""

    #: (step, record) pairs, in step order.
    records: list[tuple[int, Record]]
    #: The most delta records decoded on the way to one tensor's words (0: all keyframes).
    deepest: int

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for _, r in self.records)

    @property
    def steps(self) -> list[int]:
        return sorted({at for at, _ in self.records})

    def as_dict(self) -> dict[str, Any]:
        return {"records": len(self.records), "steps": self.steps,
                "stored_bytes": self.stored_bytes, "deepest": self.deepest}


@dataclass
class Problem:
    """Damage found by ``verify``: where it is, and which visible step it breaks."""

    step: int
    tensor: str | None
    message: str
    needed_by: int | None = None
    error: TPDEError | None = None  # what was raised, to raise it again as it was

    @classmethod
    def of(cls, exc: TPDEError, step: int, tensor: str | None = None) -> "Problem":
        """The problem ``exc`` describes; ``step`` and ``tensor`` where it does not say."""
        return cls(exc.step if exc.step is not None else step, exc.tensor or tensor, str(exc),
                   error=exc)


class Run:
    """One run in one store: its listings and its (cached) manifests, shared by the run's
    reader, writer and retainer."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.store: ByteStore = Store(url, storage_options)
        self._manifests: dict[int, Manifest] = {}
        self._known_run = False
        self._against: str | None = None

    def read_through(self, store: ByteStore) -> None:
        """Read (and write) this run through ``store`` from now on: a view of the run's own
        store, such as a mount's read-only ``ResidentStore``."""
        if store.url != self.store.url:
            raise ValueError(f"{store.url!r} is not this run's store ({self.store.url!r})")
        self.store = store

    def deltas_against(self) -> str:
        """What the run's writer codes deltas against (the marker's ``deltas_against``): a
        re-base keeps to it, whoever runs it. Either way of coding restores the same words, so
        a marker that cannot be read means the default."""
        if self._against is None:
            try:
                marker = json.loads(self.store.read(MARKER))
            except (FileNotFoundError, ValueError):
                marker = {}
            found = marker.get("deltas_against") if isinstance(marker, dict) else None
            self._against = KEYFRAME if found == KEYFRAME else PREVIOUS
        return self._against

    def _listed(self, prefix: str, suffix: str = "") -> dict[int, int]:
        return numbered(((e.path, e.size) for e in self.store.list(prefix)), suffix)

    def committed(self) -> list[int]:
        """Every step with a manifest, hidden ones included."""
        return sorted(self._listed(STEPS, ".json"))

    def hidden(self) -> set[int]:
        return set(self._listed(REMOVED))

    def is_hidden(self, step: int) -> bool:
        """One lookup, where ``hidden`` lists every hidden step."""
        return self.store.exists(f"{REMOVED}/{name(step)}")

    def steps(self) -> list[int]:
        """Visible steps, oldest first."""
        hidden = self.hidden()
        return [s for s in self.committed() if s not in hidden]

    def latest(self) -> int:
        """The newest visible step; a run without one is a ``StepNotFoundError``."""
        self.require_run()
        steps = self.steps()
        if not steps:
            raise StepNotFoundError("the run has no steps yet; `tpde ls` lists what is there",
                                    run=self.url)
        return steps[-1]

    def is_run(self) -> bool:
        # A run never stops being one: once seen, the marker is not asked for again.
        if not self._known_run:
            self._known_run = self.store.exists(MARKER)
        return self._known_run

    def require_run(self) -> None:
        if not self.is_run():
            raise NotARunError(f"no tpde chain here (no {MARKER}); check the path", run=self.url)

    def manifest(self, step: int) -> Manifest:
        if step in self._manifests:
            return self._manifests[step]
        try:
            data = self.store.read(manifest_path(step))
        except FileNotFoundError:
            self.require_run()
            raise StepNotFoundError("no such committed step; `tpde ls` lists the steps",
                                    run=self.url, step=step) from None
        try:
            m = parse(data, step=step, lazy=True, run=self.url)
        except TPDEError as exc:
            raise exc.located(run=self.url, step=step) from None
        self._manifests[step] = m
        return m

    def manifests(self, steps: list[int] | None = None) -> dict[int, Manifest]:
        """The manifests of ``steps`` (default: every committed step), by step."""
        return {s: self.manifest(s) for s in (self.committed() if steps is None else steps)}

    def lazy(self) -> "Manifests":
        """The run's manifests as a mapping read on demand (what ``plan`` functions take)."""
        return Manifests(self)

    def needed(self, keep: Iterable[int] = ()) -> set[int]:
        """Visible steps, ``keep``, and every step their records build on."""
        committed = set(self.committed())
        todo = [s for s in {*self.steps(), *keep} if s in committed]
        seen = set(todo)
        while todo:
            for ref in self.manifest(todo.pop()).refs():
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
        return seen

    def sizes(self) -> dict[str, int]:
        """The bytes of every blob and manifest, by path."""
        return {e.path: e.size for prefix in (DATA, STEPS) for e in self.store.list(prefix)}

    def purge(self, step: int, report: GcReport, sizes: dict[str, int]) -> None:
        """Delete a step nothing needs: manifest first (it stops being a step), then its blob
        and tombstone."""
        try:
            blobs = list(self.manifest(step).blobs())
        except TPDEError:
            blobs = []  # a damaged manifest of an unneeded step: its blobs go as orphans
        for rel in (manifest_path(step), *blobs, f"{REMOVED}/{name(step)}"):
            if rel:
                report.freed_bytes += sizes.get(rel, 0)
                self.store.delete(rel)
                report.deleted.append(rel)
        report.purged_steps.append(step)
        self._manifests.pop(step, None)

    def cached(self, step: int) -> Manifest | None:
        """The manifest of ``step`` as this object last read or committed it, if it did."""
        return self._manifests.get(step)

    def remember(self, m: Manifest) -> None:
        """Cache ``m``, just committed, as the manifest of its step."""
        self._manifests[m.step] = m

    def marked(self, against: str) -> None:
        """The marker was just written, saying deltas are coded against ``against``."""
        self._known_run, self._against = True, against

    def stale(self) -> bool:
        """Whether a manifest this object cached was rewritten or deleted since (a re-base or
        a gc by the run's writer); the cache is dropped if so."""
        for step, m in list(self._manifests.items()):
            try:
                now = parse(self.store.read(manifest_path(step)), step=step, lazy=True,
                            run=self.url)
            except (FileNotFoundError, TPDEError):
                now = None
            if now is None or (now.blobs(), now.records) != (m.blobs(), m.records):
                self._manifests.clear()
                return True
        return False

    def _record(self, step: int, name: str, wanted_by: int) -> Record:
        try:
            m = self.manifest(step)
        except StepNotFoundError:
            raise CorruptionError(f"step {step}, which this step builds on, is missing; "
                                  "restore an earlier keyframe or re-save", run=self.url,
                                  step=wanted_by, tensor=name) from None
        rec = m.record(name)
        if rec is None:
            raise CorruptionError(f"reference step {step} has no record of this tensor",
                                  run=self.url, step=wanted_by, tensor=name)
        return rec

    def lineage(self, name: str, step: int) -> list[tuple[int, Record]]:
        """The records to decode, keyframe first, to rebuild ``name`` at ``step``."""
        out: list[tuple[int, Record]] = []
        at, rec = step, self._record(step, name, step)
        while True:
            if rec.codec != "same":
                out.append((at, rec))
                if rec.ref is None:  # a keyframe record (exact, or error-bounded)
                    return out[::-1]
            at, rec = rec.ref, self._record(rec.ref, name, step)

    def reads(self, step: int) -> Reads:
        """What restoring ``step`` decodes (``tpde info`` prints it); raises as a restore would
        where a step on the way is missing or its manifest unreadable."""
        lineages = [self.lineage(rec.name, step) for rec in self.manifest(step).records]
        return Reads(sorted((found for lineage in lineages for found in lineage),
                            key=lambda found: found[0]),
                     max((len(lineage) - 1 for lineage in lineages), default=0))

    def data_hash(self, rec: Record, step: int) -> str:
        while rec.codec == "same":
            rec = self._record(rec.ref, rec.name, step)
        return rec.hash


class Manifests(Mapping[int, Manifest]):
    """A chain's committed manifests, read when asked for (``get`` is None for a missing or
    unreadable one)."""

    def __init__(self, chain: Run) -> None:
        self.chain = chain

    def __getitem__(self, step: int) -> Manifest:
        try:
            return self.chain.manifest(step)
        except TPDEError:
            raise KeyError(step) from None

    def __iter__(self) -> Iterator[int]:
        return iter(self.chain.committed())

    def __len__(self) -> int:
        return len(self.chain.committed())
