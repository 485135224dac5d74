"""The chain: which steps exist, what a new step stores against which reference, how a step is
rebuilt, and what garbage collection may delete.

Layout of a run folder::

    tpde.json                      marks the folder as a tpde run
    data/<step>-<uuid>.tpd         one blob per step: the compressed sections of its records
    steps/<step>.json              the manifest; its appearance commits the step
    removed/<step>                 a tombstone: the step is hidden, its data kept while needed

A step is written blob first, manifest last, so a crash leaves at most an unreferenced blob
(deleted by ``gc``) and never a visible half step.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from . import codec, dtypes, elias, frames, tree
from .errors import (CorruptionError, FormatError, NotARunError, StepExistsError,
                     StepNotFoundError, TPDEError)
from .manifest import PIECES_FORMAT, Manifest, Record, SectionRef, content_hash, parse
from .store import Store

MARKER, STEPS, REMOVED, DATA = "tpde.json", "steps", "removed", "data"
Progress = Callable[[int], None]
#: Spans larger than this (or than half of ``max_inflight_bytes``, if smaller) are stored as
#: pieces, each a record of its own, so that encoding a tensor, or reading its reference back
#: from the store, never holds more than a piece of it at once. Half, so that two pieces are
#: encoded at once: measured twice as fast as one at a time, in the same memory.
PIECE_BYTES = 64 << 20
#: Words a rebuild reads and decompresses at once (``Chain.materialize``).
DECODE_BATCH_BYTES = 128 << 20


def _name(step: int) -> str:
    return f"{step:020d}"


_pool_lock = threading.Lock()
_pools_of: dict[int, tuple[ThreadPoolExecutor, ThreadPoolExecutor]] = {}


def _pools() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The process's decode threads and the threads that fetch one step ahead.

    Made once per process (a forked child, such as a DataLoader worker, makes its own: the
    parent's threads do not exist there): a mount decodes one module at a time, many times a
    second, and starting threads for every decode cost more than decoding a small module.
    """
    with _pool_lock:
        pid = os.getpid()
        if pid not in _pools_of:
            _pools_of.clear()
            _pools_of[pid] = (
                ThreadPoolExecutor(frames.default_threads(), thread_name_prefix="tpde-decode"),
                ThreadPoolExecutor(2, thread_name_prefix="tpde-prefetch"))
        return _pools_of[pid]


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _attempt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` returning its TPDEError instead of raising it, for results gathered from a pool."""
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except TPDEError as exc:
            return exc
    return run


def _decompress(r: Record, framed: dict[str, list[memoryview]], values_elsewhere: bool = False
                ) -> dict[str, bytes]:
    """The record's sections decompressed here (without its values where a GPU decodes them)."""
    return {name: frames.decompress(fr, s.raw, s.chunk)
            for (name, s), fr in zip(r.sections.items(), framed.values())
            if not (values_elsewhere and name == "values")}


def _rebuild(job: tuple[Record, bool, Any, torch.Tensor | None, Any, codec.CPU | None]
             ) -> torch.Tensor:
    """Decode one record against its reference words (``backend`` None: here; the GPU
    backend keeps the words on its device)."""
    r, _, secs, ref, positions, backend = job
    if isinstance(secs, TPDEError):
        raise secs
    dt = dtypes.by_name(r.dtype)
    n = r.numel * dt.words_per_element
    # `ref` is a previous decode of this same materialize call: safe to overwrite.
    return codec.decode(r.codec, r.residual, secs, ref, n, dt.word_dtype, dt.kind,
                        positions=positions, inplace=True, backend=backend)


def _check(r: Record, check: bool, words: torch.Tensor | TPDEError) -> torch.Tensor:
    """``words`` if they hash to the record's hash (or need no check)."""
    if isinstance(words, TPDEError):
        raise words
    if check and content_hash(words.view(torch.uint8).cpu().numpy()) != r.hash:
        raise CorruptionError("restored bytes do not match the stored hash; the chain is "
                              "damaged at this step")
    return words


def _rebuild_checked(job: tuple[Record, bool, Any, torch.Tensor | None, Any, None]
                     ) -> torch.Tensor:
    """``_rebuild`` and ``_check`` on the host, where the decompressed sections can go as soon
    as their record is rebuilt (a GPU's stay until the device is done with them)."""
    try:
        return _check(job[0], job[1], _rebuild(job))
    finally:
        if isinstance(job[2], dict):
            job[2].clear()


@dataclass(frozen=True)
class _Piece:
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


def _pieces(flat: tree.Flat, piece_bytes: int) -> Iterator[_Piece]:
    """What a step stores, in order: each span whole, or in pieces of at most ``piece_bytes``."""
    for span in flat.spans:
        n, per = span.tensor.numel(), max(1, piece_bytes // span.tensor.element_size())
        for lo in range(0, n, per) if n > per else [0]:
            yield _Piece(span, lo, min(n, lo + per), n <= per)


def _batches(items: list[tuple[Record, bool]], limit: int) -> list[list[tuple[Record, bool]]]:
    """``items`` in order, in runs of at most ``limit`` raw bytes (at least one record each)."""
    out: list[list[tuple[Record, bool]]] = []
    size = 0
    for item in items:
        if out and size + item[0].raw_bytes <= limit:
            out[-1].append(item)
            size += item[0].raw_bytes
        else:
            out.append([item])
            size = item[0].raw_bytes
    return out


def span_words(names: Iterable[str], words: dict[str, torch.Tensor],
               device: torch.device | None = None, *, consume: bool = False) -> torch.Tensor:
    """One span's words from the words of its records (named in ``Manifest.spans`` order), on
    ``device`` (None: where they are); a copy whenever they move or the span has pieces.
    ``consume`` takes the records' words out of ``words`` as they are used, so that pieces are
    freed while the span fills."""
    names = list(names)
    take = words.pop if consume else words.__getitem__
    if len(names) == 1:
        part = take(names[0])
        return part.to(device if device is not None else part.device, copy=device is not None)
    first = words[names[0]]
    whole = torch.empty(sum(words[n].numel() for n in names), dtype=first.dtype,
                        device=device if device is not None else first.device)
    at = 0
    for name in names:
        part = take(name)
        whole[at : at + part.numel()].copy_(part)
        at += part.numel()
    return whole


@dataclass
class Reference:
    """What the next delta is coded against: the host words of the last saved or loaded step."""

    step: int
    depth: int
    words: dict[str, torch.Tensor]
    records: dict[str, Record]


@dataclass
class GcReport:
    freed_bytes: int = 0
    deleted: list[str] = field(default_factory=list)
    purged_steps: list[int] = field(default_factory=list)


@dataclass
class Problem:
    """Damage found by ``verify``: where it is, and which visible step it breaks."""

    step: int
    tensor: str | None
    message: str
    needed_by: int | None = None


class Chain:
    """One run in one store."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.store = Store(url, storage_options)
        self._manifests: dict[int, Manifest] = {}
        self._known_run = False

    # ------------------------------------------------------------------ listing
    def _listed(self, prefix: str, suffix: str = "") -> dict[int, int]:
        out = {}
        for e in self.store.list(prefix):
            stem = e.path.rsplit("/", 1)[-1]
            if suffix:
                if not stem.endswith(suffix):
                    continue
                stem = stem[: -len(suffix)]
            if stem.isdigit():
                out[int(stem)] = e.size
        return out

    def committed(self) -> list[int]:
        """Every step with a manifest, hidden ones included."""
        return sorted(self._listed(STEPS, ".json"))

    def hidden(self) -> set[int]:
        return set(self._listed(REMOVED))

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
            data = self.store.read(f"{STEPS}/{_name(step)}.json")
        except FileNotFoundError:
            self.require_run()
            raise StepNotFoundError("no such committed step; `tpde ls` lists the steps",
                                    run=self.url, step=step) from None
        try:
            m = parse(data, step=step)
        except TPDEError as exc:
            raise exc.located(run=self.url, step=step) from None
        self._manifests[step] = m
        return m

    # ------------------------------------------------------------------ writing
    def write(self, step: int, flat: tree.Flat, reference: Reference | None, *,
              settings: codec.Settings, keyframe_every: int, keep_reference: bool = True,
              max_inflight_bytes: int = 256 << 20, owned: bool = False) -> tuple[Manifest, Reference]:
        """Commit ``flat`` as ``step``; returns the manifest and the reference for the next step.

        With ``keep_reference`` the returned reference holds a host copy of every tensor, and
        ``reference.words`` is consumed as tensors are encoded, so peak host memory stays near
        one copy of the state. Without it nothing is kept: each tensor's reference is re-read
        from the committed chain when it is encoded. Either way at most ``max_inflight_bytes``
        of tensors (and at least one piece) are being encoded at once; spans larger than half
        of it, or than ``PIECE_BYTES``, are stored in pieces. Callers drop the reference if
        this raises. ``owned`` says the spans are private host copies (a snapshot), so they
        become the next reference as they are instead of being copied again.
        """
        if type(step) is not int or step < 0:
            raise TPDEError(f"step must be a non-negative int, got {step!r}", run=self.url)
        self._make_room(step)
        if not self.is_run():
            self.store.put_atomic(MARKER, json.dumps({"format": "tpde", "version": 1}).encode())
        started = time.perf_counter()
        keyframe = reference is None or reference.depth + 1 >= keyframe_every
        blob_rel = f"{DATA}/{_name(step)}-{uuid.uuid4().hex[:12]}.tpd"
        writer = self.store.open_write(blob_rel)
        records: list[Record] = []
        new_words: dict[str, torch.Tensor] = {}

        def encode(piece: _Piece) -> tuple[dtypes.DType, torch.Tensor | None, codec.Encoding, str]:
            dt = dtypes.of_tensor(piece.span.tensor, name=piece.span.name)
            w = dt.words_per_element
            words = codec.to_words(piece.span.tensor.detach(), dt.word_dtype)
            words = words[piece.lo * w : piece.hi * w]
            copy = words.is_cuda or (keep_reference and not owned)
            host = words.to("cpu", copy=True) if copy else words
            if keyframe:
                ref_words = None
            elif keep_reference:
                ref_words = reference.words.pop(piece.name, None)
            else:
                ref_words = self._stored_words(reference, piece.name)
            enc = codec.encode(words if words.is_cuda else host, ref_words, dt.kind, settings)
            # Bit-identical to the reference, whose hash is known: a repeated save hashes nothing.
            digest = (reference.records[piece.name].hash if enc.codec == "same"
                      else content_hash(host.view(torch.uint8).numpy()))
            return dt, host if keep_reference else None, enc, digest

        def commit(piece: _Piece, done: tuple[dtypes.DType, torch.Tensor, codec.Encoding, str]
                   ) -> None:
            dt, host, enc, digest = done
            sections = {}
            for sname, sec in enc.sections.items():
                offset = writer.size
                for frame in sec.frames:
                    writer.write(frame)
                sections[sname] = SectionRef(offset, sec.raw, sec.chunk, sec.table())
            ref = None
            if enc.codec == "same":
                prev = reference.records[piece.name]
                ref = prev.ref if prev.codec == "same" else reference.step
            elif enc.codec != "key":
                ref = reference.step
            records.append(Record(piece.name, dt.name, piece.hi - piece.lo, piece.span.device,
                                  enc.codec, digest, ref, enc.residual, enc.count, sections,
                                  piece.start))
            if host is not None:
                new_words[piece.name] = host

        try:
            workers = settings.threads or frames.default_threads()
            with ThreadPoolExecutor(workers, thread_name_prefix="tpde-encode") as pool:
                pending: deque[tuple[_Piece, Future]] = deque()
                inflight = 0
                for piece in _pieces(flat, min(PIECE_BYTES, max(1, max_inflight_bytes // 2))):
                    while pending and (len(pending) >= 2 * workers
                                       or inflight + piece.nbytes > max_inflight_bytes):
                        done_piece, fut = pending.popleft()
                        commit(done_piece, fut.result())
                        inflight -= done_piece.nbytes
                    pending.append((piece, pool.submit(encode, piece)))
                    inflight += piece.nbytes
                while pending:
                    done_piece, fut = pending.popleft()
                    commit(done_piece, fut.result())
            writer.close()
        except TPDEError as exc:
            writer.abort()
            raise exc.located(run=self.url, step=step) from exc
        except BaseException:
            writer.abort()
            raise
        self_contained = all(r.ref is None for r in records)
        m = Manifest(
            step=step, keyframe=self_contained, depth=0 if self_contained else reference.depth + 1,
            parent=None if self_contained else reference.step, blob=blob_rel,
            blob_size=writer.size, created=time.time(), seconds=0.0, skeleton=flat.skeleton,
            records=records,
            format=PIECES_FORMAT if any(r.start is not None for r in records) else 1,
        )
        m.seconds = time.perf_counter() - started
        data = m.to_bytes()
        try:
            self.store.put_atomic(f"{STEPS}/{_name(step)}.json", data)
        except TPDEError as exc:
            if self.store.local:  # a failed local rename is final; a remote PUT may still land
                self.store.delete(blob_rel)
            raise exc.located(run=self.url, step=step) from exc
        self._manifests[step] = m = parse(data, step=step)
        return m, Reference(step, m.depth, new_words, {r.name: r for r in records})

    def _stored_words(self, reference: Reference, name: str) -> torch.Tensor | None:
        """The reference step's words of one tensor, read back from the store."""
        if name not in reference.records:
            return None
        return self.materialize(reference.step, [name])[name]

    def _make_room(self, step: int) -> None:
        """Refuse to overwrite a committed step; a hidden one that nothing needs is purged first."""
        if not self.store.exists(f"{STEPS}/{_name(step)}.json"):
            return
        if step not in self.hidden():
            raise StepExistsError("already committed and immutable; save under a new step or "
                                  "remove() it first", run=self.url, step=step)
        if step in self.needed():
            raise StepExistsError("was removed, but later steps still need its data, so the "
                                  "number cannot be reused yet; save under a new step",
                                  run=self.url, step=step)
        self._purge(step, GcReport(), self._sizes())

    # ------------------------------------------------------------------ reading
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

    def _lineage(self, name: str, step: int) -> list[tuple[int, Record]]:
        """The records to decode, keyframe first, to rebuild ``name`` at ``step``."""
        out: list[tuple[int, Record]] = []
        at, rec = step, self._record(step, name, step)
        while True:
            if rec.codec != "same":
                out.append((at, rec))
                if rec.codec == "key":
                    return out[::-1]
            at, rec = rec.ref, self._record(rec.ref, name, step)

    def _fetch(self, m: Manifest, recs: list[Record]) -> list[dict[str, list[memoryview]]]:
        """The frames of ``recs``' sections: one GET of the blob, or range reads for a few."""
        wanted = [(s.offset, s.offset + s.length) for r in recs for s in r.sections.values()]
        if not wanted:
            return [{} for _ in recs]
        try:
            if self.store.whole_blob_reads and sum(b - a for a, b in wanted) * 2 >= m.blob_size:
                blob = self.store.read(m.blob, m.blob_size)
                if len(blob) != m.blob_size:
                    raise CorruptionError(f"blob {m.blob} holds {len(blob)} bytes, the manifest "
                                          f"says {m.blob_size} (truncated?)", run=self.url,
                                          step=m.step)
                view = memoryview(blob)
                pieces = [view[a:b] for a, b in wanted]
            else:
                pieces = [memoryview(p) for p in self.store.read_ranges(m.blob, wanted)]
        except FileNotFoundError:
            raise CorruptionError(f"blob {m.blob} is missing", run=self.url, step=m.step) from None
        out, it = [], iter(pieces)
        for r in recs:
            secs = {}
            for sname, s in r.sections.items():
                piece, at, fr = next(it), 0, []
                for n in s.frames:
                    fr.append(piece[at : at + n])
                    at += n
                secs[sname] = fr
            out.append(secs)
        return out

    def materialize(self, step: int, names: Iterable[str] | None = None, *,
                    problems: list[Problem] | None = None, check_every: bool = False,
                    check: bool = True, progress: Progress | None = None,
                    on: torch.device | None = None, batch_bytes: int = DECODE_BATCH_BYTES
                    ) -> dict[str, torch.Tensor]:
        """Host words of ``step``'s records, rebuilt step by step and checked against hashes.

        The words a caller gets are hash-checked (``check=False`` only for bytes already checked
        once and held unchanged since, as a mount does); with ``check_every`` so is every delta
        on the way, which is what ``verify`` does. ``on`` rebuilds the words on that device
        with ``tpde.kernels.backend`` (nvCOMP and Triton; the hash check copies them to the
        host). A mismatch is traced back to the first damaged step either way. With
        ``problems`` given, damaged tensors are reported there and skipped instead of raised.
        Each step is read and decompressed in batches of about ``batch_bytes`` of words, so
        that beside the words themselves a rebuild holds two batches, not two steps.
        """
        target = self.manifest(step)
        wanted = [r for r in target.records if names is None or r.name in set(names)]
        plan: dict[int, list[tuple[Record, bool]]] = defaultdict(list)
        failed: set[str] = set()

        def fail(exc: TPDEError, at: int, name: str) -> None:
            exc = exc.located(run=self.url, step=at, tensor=name)
            if problems is None:
                raise exc
            problems.append(Problem(exc.step if exc.step is not None else at, name, str(exc)))
            failed.add(name)

        for rec in wanted:
            try:
                lineage = self._lineage(rec.name, step)
            except TPDEError as exc:
                fail(exc, step, rec.name)
                continue
            for i, (at, r) in enumerate(lineage):
                plan[at].append((r, check_every or (check and i == len(lineage) - 1)))
        current: dict[str, torch.Tensor] = {}
        # (step, batch) in step order; each is prepared while the one before is rebuilt.
        units = [(at, batch) for at in sorted(plan) for batch in _batches(plan[at], batch_bytes)]
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
                fetched = self._fetch(self.manifest(at), [r for r, _ in todo])
            except TPDEError as exc:
                return exc
            recs = [r for r, _ in todo]
            on_gpu = backend is not None and backend.nvcomp
            sections = list(pool.map(_attempt(_decompress), recs, fetched,
                                     [on_gpu] * len(recs)))
            if on_gpu:
                backend.add_values(sections, [
                    (f["values"], r.sections["values"].raw, r.sections["values"].chunk)
                    if "values" in r.sections else None for r, f in zip(recs, fetched)])
            if backend is not None:  # positions are decoded on the device
                return todo, sections, [None] * len(todo)
            return todo, sections, self._positions(recs, sections)

        pool, ahead = _pools()
        if units:
            upcoming = ahead.submit(prepare, units[0]) if len(units) > 1 else \
                _done(prepare(units[0]))
            for k, (at, batch) in enumerate(units):
                prepared = upcoming.result()
                if k + 1 < len(units):
                    upcoming = ahead.submit(prepare, units[k + 1])
                if isinstance(prepared, TPDEError):
                    for r, _ in batch:
                        if r.name not in failed:
                            fail(prepared, at, r.name)
                    continue
                jobs = [(r, checked, secs, current.get(r.name), pos, backend)
                        for (r, checked), secs, pos in zip(*prepared) if r.name not in failed]
                if backend is None:
                    rebuilt = pool.map(_attempt(_rebuild_checked), jobs)
                else:
                    # Kernels are launched from this thread, one record after another (the
                    # device runs them in order either way); the hashes are computed in the pool.
                    words = [_attempt(_rebuild)(job) for job in jobs]
                    backend.done([w for w in words if isinstance(w, torch.Tensor)])
                    rebuilt = pool.map(_attempt(_check), [j[0] for j in jobs],
                                       [j[1] for j in jobs], words)
                for (r, checked, *_), done in zip(jobs, rebuilt):
                    if isinstance(done, TPDEError):
                        if checked and not check_every and isinstance(done, CorruptionError) \
                                and not isinstance(done, FormatError):
                            done, at_bad = self._trace(r.name, step, done, at)
                            fail(done, at_bad, r.name)
                        else:
                            fail(done, at, r.name)
                        continue
                    current[r.name] = done
                    if progress:
                        progress(r.raw_bytes)
                del prepared, jobs, rebuilt  # this batch's sections, before the next is waited on
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
            return CorruptionError(found[0].message), found[0].step
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

    def _data_hash(self, rec: Record, step: int) -> str:
        while rec.codec == "same":
            rec = self._record(rec.ref, rec.name, step)
        return rec.hash

    def load(self, step: int, *, map_location: tree.MapLocation = None, trusted: bool = False,
             progress: Progress | None = None, keep_words: bool = True
             ) -> tuple[Any, dict[str, torch.Tensor]]:
        """The checkpoint at ``step`` and the host words it was built from.

        Without ``keep_words`` no words are returned and the checkpoint's tensors are the
        rebuilt words themselves wherever they need not move: a restore then holds one copy of
        the state, not two. (A writer keeps the words to code the next delta against, so the
        tensors it hands out must be copies that training can change.)
        """
        m = self.manifest(step)
        words = self.materialize(step, progress=progress)
        spans = []
        for recs in m.spans():
            dt = dtypes.by_name(recs[0].dtype)
            names = [r.name for r in recs]
            device = tree.resolve_device(recs[0].device, map_location)
            if not keep_words and words[names[0]].device == device:
                device = None
            # Moved as words, then viewed: some dtypes (int1..int7) have no copy kernel.
            data = span_words(names, words, device, consume=not keep_words)
            spans.append(data.view(torch.uint8).view(dt.torch_dtype))
        try:
            state = tree.unflatten(m.skeleton, spans, trusted=trusted, where=f"step {step}")
        except TPDEError as exc:
            raise exc.located(run=self.url, step=step) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"skeleton is malformed ({exc})", run=self.url, step=step) from None
        return state, words

    # ------------------------------------------------------------------ removal and gc
    def remove(self, step: int) -> None:
        """Hide ``step``; its data stays while later steps need it."""
        if step not in self.steps():
            raise StepNotFoundError("no such visible step to remove", run=self.url, step=step)
        self.store.put_atomic(f"{REMOVED}/{_name(step)}", b"")

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

    def _sizes(self) -> dict[str, int]:
        return {e.path: e.size for prefix in (DATA, STEPS) for e in self.store.list(prefix)}

    def _purge(self, step: int, report: GcReport, sizes: dict[str, int]) -> None:
        try:
            blob = self.manifest(step).blob
        except TPDEError:
            blob = None  # a damaged manifest of an unneeded step: its blob goes as an orphan
        for rel in (f"{STEPS}/{_name(step)}.json", blob, f"{REMOVED}/{_name(step)}"):
            if rel:
                report.freed_bytes += sizes.get(rel, 0)
                self.store.delete(rel)
                report.deleted.append(rel)
        report.purged_steps.append(step)
        self._manifests.pop(step, None)

    def gc(self, *, grace_seconds: float = 3600.0, keep: Iterable[int] = ()) -> GcReport:
        """Delete what no visible step needs: hidden steps' data and leftovers of crashed saves.

        Leftovers younger than ``grace_seconds`` are kept, since they may belong to a save in
        progress in another process.
        """
        self.require_run()
        report = GcReport()
        needed = self.needed(keep)
        sizes = self._sizes()
        for step in self.committed():
            if step not in needed:
                self._purge(step, report, sizes)
        live = {self.manifest(s).blob for s in needed}
        now = time.time()
        for prefix in (DATA, STEPS):
            for e in self.store.list(prefix):
                leftover = (prefix == DATA and e.path not in live) or e.path.endswith(".tmp")
                young = e.mtime is not None and now - e.mtime < grace_seconds
                if leftover and not young:
                    self.store.delete(e.path)
                    report.freed_bytes += e.size
                    report.deleted.append(e.path)
        committed = set(self.committed())
        for step in self.hidden() - committed:
            self.store.delete(f"{REMOVED}/{_name(step)}")
            report.deleted.append(f"{REMOVED}/{_name(step)}")
        return report

    def verify(self, step: int | None = None, *, progress: Progress | None = None) -> list[Problem]:
        """Rebuild and hash-check ``step`` (or every visible step); returns what is damaged."""
        problems: list[Problem] = []
        for s in [step] if step is not None else self.steps():
            found: list[Problem] = []
            try:
                self.materialize(s, problems=found, check_every=True, progress=progress)
            except TPDEError as exc:
                exc = exc.located(run=self.url, step=s)
                found.append(Problem(exc.step if exc.step is not None else s, exc.tensor, str(exc)))
            problems += [Problem(p.step, p.tensor, p.message, needed_by=s) for p in found]
        return problems
