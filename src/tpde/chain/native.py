"""Records rebuilt in one C call outside the GIL (``tpde.codec._rebuild``): a mount's decodes, and
a restore's batches.

A mount at budget 0 rebuilds each module's tensors on every forward. Through ``materialize``
that is a rebuild plan, a few pools and a dozen Python calls per record, every time: a large share
of a forward's decode. Here a tensor's lineage is worked out once
(``lineages``); after that its records are read and rebuilt, keyframe, deltas and hash check, by
one call for the whole module, which the forward's thread shares with torch's own OpenMP
threads: with torch's default threads those wait, spinning, on the cores a decode thread of
tpde's would need. A restore (``restore``) rebuilds its tensors the same way, a batch at a
time, each lineage in one pass over its words, however many deltas deep.

Only exact keyframes, dense deltas and sparse XOR deltas (up to ``SPARSE_BYTES``) of words
whose records hash with XXH3-128 are rebuilt here; ``lineages`` leaves the rest (error-bounded
records, records of older formats, larger sparse deltas, missing records) to ``materialize``,
and so does ``rebuild`` with any tensor it could not rebuild or check: ``materialize`` rebuilds
them again and says where the chain is damaged.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import xxhash

from tpde.chain.base import Progress, Run
from tpde.codec import dtypes, elias, unframe
from tpde.codec.transform import residual_mode
from tpde.errors import TPDEError
from tpde.manifest import XXH3, Record, SectionRef
from tpde.runtime import extensions, frame_threads

_rebuild = extensions.load("_rebuild")

#: By process: whether ``rebuild`` can run, and whether it can share its work over a team.
_opened: dict[int, tuple[bool, bool]] = {}
#: Held while a process opens the call: opened again while another thread's call ran, it
#: reset the OpenMP entry points that call was using (a Lightning save with
#: ``reference="store"``, whose threads read their references at once, crashed 1 run in 5).
_opening_lock = threading.Lock()
#: Set in a child forked from this process: libgomp's threads are the parent's there, and a
#: team would wait for them forever.
_forked = False


def _in_child() -> None:
    global _forked, _opening_lock
    _forked = True
    _opening_lock = threading.Lock()  # held, maybe, by a thread the child does not have


os.register_at_fork(after_in_child=_in_child)


#: A sparse delta's mode in ``_rebuild`` (0 is a keyframe's, 1-3 a dense residual's).
SPARSE = 9
#: The most bytes the sparse deltas of one lineage may take while rebuilt here: all their
#: positions are decoded (as int64) and values decompressed before the call. A lineage of
#: larger ones is left to ``materialize``, which at budget 0 holds one batch at a time: a
#: large embedding's sparse deltas would otherwise take several times its size in positions
#: here, and raise a mount's peak over a forward.
SPARSE_BYTES = 4 << 20
#: The most words one call of a restore rebuilds (``restore``), where the words are what it
#: returns and it holds little beside them: fewer, larger calls restore faster (in small
#: ones each piece's hash ran on one thread while the other waited); a restore's progress
#: moves once a call.
CALL_BYTES = 256 << 20


@dataclass(frozen=True)
class Stored:
    """One record's values: where its frames are, and how they rebuild the words (a sparse
    delta's positions too: the section, in the same blob)."""

    blob: str
    values: SectionRef
    mode: int  # 0: a keyframe's words; else the residual, as ``_planes`` numbers them
    positions: SectionRef | None = None

    def ranges(self) -> list[tuple[int, int]]:
        return [_span(s) for s in (self.values, self.positions) if s]

    @property
    def stored(self) -> int:
        return sum(b - a for a, b in self.ranges())


@dataclass(frozen=True)
class Lineage:
    """What rebuilds one record name's words at a step: its keyframe and deltas, in order."""

    name: str
    words: int
    word_dtype: torch.dtype
    hash: int  # XXH3-128 of the words, as the last record stores it
    records: tuple[Stored, ...]
    raw: int  # the records' raw bytes together, as a restore's progress counts them
    sparse: int  # bytes the sparse deltas' positions (int64) and values take while rebuilt

    @property
    def word_bytes(self) -> int:
        return self.words * self.word_dtype.itemsize

    def beside(self, read_first: bool) -> int:
        """Bytes a call holds for this lineage beside its words: its sparse deltas' positions
        and values, and with ``read_first`` its stored bytes (a store that hands no
        descriptors)."""
        return self.sparse + (sum(s.stored for s in self.records) if read_first else 0)


def _span(s: SectionRef) -> tuple[int, int]:
    return s.offset, s.offset + s.length


def available() -> bool:
    """Whether ``rebuild`` can run in this process: the extension built, the system's zstd
    and ``xxhash``'s XXH3-128 found."""
    return _opening()[0]


def _opening() -> tuple[bool, bool]:
    pid = os.getpid()
    if pid not in _opened:
        with _opening_lock:
            if pid not in _opened:
                openmp = _openmp()
                _opened[pid] = (_rebuild is not None and
                                _rebuild.open(xxhash._xxhash.__file__, openmp),
                                openmp is not None)
    return _opened[pid]


def _openmp() -> str | None:
    """The GNU OpenMP runtime this process has loaded (torch's CPU wheels ship libgomp), whose
    threads ``rebuild`` may share its work with; None where there is none, or where this is a
    forked child."""
    if _forked:
        return None
    try:
        with open("/proc/self/maps") as maps:
            found = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    return min(found) if len(found) == 1 else None


def lineages(run: Run, step: int, names: Iterable[str]) -> dict[str, Lineage]:
    """The lineages of ``names`` at ``step`` that ``rebuild`` can rebuild, by name; the others
    are left out, those with a record missing on the way too (``materialize`` says which)."""
    out: dict[str, Lineage] = {}
    for name in names:
        try:
            found = _lineage(run, step, name)
        except TPDEError:
            continue
        if found is not None:
            out[name] = found
    return out


def _lineage(run: Run, step: int, name: str) -> Lineage | None:
    lineage = run.lineage(name, step)
    last = lineage[-1][1]
    dt = dtypes.by_name(last.dtype)
    n = last.numel * dt.words_per_element
    if not last.hash.startswith(XXH3) or n == 0:
        return None
    stored: list[Stored] = []
    sparse = 0
    for at, rec in lineage:
        mode = _mode(rec, dt.kind)
        if mode is None or rec.dtype != last.dtype or (mode == 0) != (not stored):
            return None
        values = rec.sections["values"]
        if mode == SPARSE:
            sparse += values.raw // dt.word_bytes * 8 + values.raw
            if sparse > SPARSE_BYTES:
                return None
        stored.append(Stored(run.manifest(at).blob_of(rec), values, mode,
                             rec.sections.get("positions")))
    return Lineage(name, n, dt.word_dtype, int(last.hash[len(XXH3):], 16), tuple(stored),
                   sum(rec.raw_bytes for _, rec in lineage), sparse)


def _mode(rec: Record, kind: str) -> int | None:
    """The record's mode in ``_rebuild`` where it is an exact keyframe, a dense delta or a
    sparse XOR delta; else None. Its sections, their sizes and chunk tables are the codec's:
    the manifest's parser checked them (``manifest.parsing``)."""
    if rec.codec == "key":
        return 0
    if rec.codec == "sparse":
        return SPARSE if rec.residual == "xor" else None
    if rec.codec != "dense":
        return None
    try:
        return residual_mode(rec.residual or "", kind)
    except TPDEError:
        return None


def rebuild(run: Run, lineages: dict[str, Lineage], *, check: bool, threads: int,
            into: dict[str, torch.Tensor], alloc: Callable[[int, torch.dtype], torch.Tensor],
            read_limit: int | None = None, fresh: bool = False) -> dict[str, torch.Tensor]:
    """The words of every lineage, by name, rebuilt in one call (in ``into``'s words where it
    has a place for them, else in ``alloc(words, word_dtype)``), checked against their hashes
    with ``check``, on an OpenMP team of the calling thread of ``threads`` threads. A tensor
    that could not be read, rebuilt or checked is left out, for ``materialize`` to rebuild.

    The values of a local run are read by the call a frame at a time, as it decompresses them
    (a forward at budget 0 holds the words and a few frames, not the compressed lineage);
    other stores' are read first, unless that is more than ``read_limit`` bytes: then every
    lineage is left out. ``fresh``: the words are new memory, which the call asks to be
    backed by huge pages where the kernel has them (a restore's: faulting its words in a page
    at a time was half of a keyframe's restore); a mount's are reused (``heap.Arena``)."""
    if not available():  # opened again in a forked child: without a team there
        return {}
    try:
        with run.store.kept_open():
            return _rebuild_read(run, lineages, check, threads, into, alloc, read_limit,
                                 fresh)
    except (OSError, TPDEError, ValueError):  # gone (re-based meanwhile), unreadable, or a
        return {}  # manifest whose sizes do not add up: materialize says which


def restore(run: Run, step: int, names: Iterable[str], *, check: bool,
            into: dict[str, torch.Tensor], progress: Progress | None, batch_bytes: int
            ) -> dict[str, torch.Tensor]:
    """The words of those of ``names`` at ``step`` that ``rebuild`` can rebuild, by name: the
    restore path's share of the work (``materialize`` rebuilds the rest).

    Each call rebuilds up to ``CALL_BYTES`` of words, holding at most ``batch_bytes`` beside
    them (``Lineage.beside``), on a team of the CPUs this thread may run on (up to 8, as the
    decode threads): a restore has no forward whose threads to share. Where there is no such
    team (no libgomp, or a forked child) and more than one CPU, nothing is rebuilt here: the
    Python path's decode threads share the work. A store that hands no descriptors reads a
    lineage's stored bytes before its call, so there a lineage storing more than
    ``batch_bytes`` is left to ``materialize``, which reads a step at a time. Called within the
    store's ``kept_open``."""
    threads = frame_threads.default_threads()
    opened, teamed = _opening()
    if not opened or (threads > 1 and not teamed):
        return {}  # on one thread where the Python path's decode threads would share the work
    found = list(lineages(run, step, names).values())
    if not found:
        return {}
    try:
        read_first = run.store.descriptor(found[0].records[0].blob) is None
    except OSError:  # a blob gone: its lineages fail in the call, and materialize says where
        read_first = False
    calls: list[list[Lineage]] = []
    held = beside = 0
    for lin in found:
        extra = lin.beside(read_first)
        if extra > batch_bytes:
            continue
        if calls and held + lin.word_bytes <= CALL_BYTES and beside + extra <= batch_bytes:
            calls[-1].append(lin)
            held, beside = held + lin.word_bytes, beside + extra
        else:
            calls.append([lin])
            held, beside = lin.word_bytes, extra
    words: dict[str, torch.Tensor] = {}
    for call in calls:
        got = rebuild(run, {lin.name: lin for lin in call}, check=check, threads=threads,
                      into=into, alloc=_empty, read_limit=batch_bytes, fresh=True)
        words.update(got)
        if progress:
            progress(sum(lin.raw for lin in call if lin.name in got))
    return words


def _empty(words: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(words, dtype=dtype)


def _rebuild_read(run: Run, lineages: dict[str, Lineage], check: bool, threads: int,
                  into: dict[str, torch.Tensor],
                  alloc: Callable[[int, torch.dtype], torch.Tensor],
                  read_limit: int | None, fresh: bool) -> dict[str, torch.Tensor]:
    """``rebuild`` within the store's ``kept_open``: descriptors for every blob, else every
    range read (a read may close a descriptor handed out before it)."""
    wanted: dict[str, set[tuple[int, int]]] = defaultdict(set)
    reads: dict[str, set[tuple[int, int]]] = defaultdict(set)  # read before the call
    for lin in lineages.values():
        for s in lin.records:
            wanted[s.blob].update(s.ranges())
            if s.positions is not None:
                reads[s.blob].add(_span(s.positions))
    fds = {blob: run.store.descriptor(blob) for blob in wanted}
    if None in fds.values():
        fds, reads = {}, wanted
        if read_limit is not None and \
                sum(b - a for ranges in reads.values() for a, b in ranges) > read_limit:
            return {}
    data: dict[tuple[str, int, int], Any] = {}
    for blob, ranges in reads.items():
        order = sorted(ranges)
        data.update(((blob, a, b), got) for (a, b), got in
                    zip(order, run.store.read_ranges(blob, order)))
    words: dict[str, torch.Tensor] = {}
    tasks, names = [], []
    for name, lin in lineages.items():
        try:
            records = [_record(s, data, fds, lin.words) for s in lin.records]
        except TPDEError:  # a damaged position stream: materialize says where
            continue
        out = into.get(name)
        if out is None:
            out = alloc(lin.words, lin.word_dtype)
        words[name] = out
        names.append(name)
        tasks.append((out.view(torch.uint8).numpy(), lin.word_dtype.itemsize, check,
                      lin.hash >> 64, lin.hash & (1 << 64) - 1, records))
    for i, _why in _rebuild.rebuild(tasks, threads, fresh):
        del words[names[i]]
    return words


def _record(s: Stored, data: dict[tuple[str, int, int], Any], fds: dict[str, int | None],
            n: int) -> tuple:
    """A record as ``_rebuild`` takes it; a sparse delta's positions decoded here (a small
    stream: a tenth of the words, or fewer, where a delta is stored sparse)."""
    v = s.values
    source = (fds[s.blob], v.offset) if fds else data[(s.blob, *_span(v))]
    out: tuple = (source, v.frames, v.chunk, v.raw, s.mode)
    if s.positions is None:
        return out
    p = s.positions
    stream = unframe.decompress(unframe.cut(data[(s.blob, *_span(p))], p.frames), p.raw,
                                p.chunk)
    return (*out, elias.decode(stream, limit=n))
