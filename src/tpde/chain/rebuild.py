"""Carrying out a rebuild's plan (``plan.RebuildPlan``) step by step: each batch fetched,
decompressed and its positions decoded one batch ahead, its records rebuilt on the decode
threads (or a GPU), and the final words hash-checked, a damaged tensor traced to its first
damaged step."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from tpde.chain.base import Problem, Progress
from tpde.chain.decode import (attempt, decompress, in_runs, pools, rebuild, rebuild_checked,
                               runs_of, verified)
from tpde.chain.plan import RebuildPlan
from tpde.codec import dtypes, elias
from tpde.errors import CorruptionError, FormatError, TPDEError
from tpde.manifest import Record
from tpde.runtime import heap

if TYPE_CHECKING:
    from tpde.chain.read import Reader

Batch = tuple[tuple[Record, bool], ...]
Prepared = tuple[list[tuple[Record, bool]], list[Any], list[Any]]


def positions(recs: list[Record], sections: list[Any]) -> list[Any]:
    """Decode a batch's sparse position streams at once (None where not sparse).

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


class Rebuild:
    """One attempt at rebuilding a plan's records (``Reader.materialize`` makes it).

    Args:
        reader: the run's reader.
        plan: what to decode, step by step.
        problems: where damaged tensors are reported instead of raised (None: raise).
        check, check_every: hash-check the final words; and every record's on the way.
        progress: told the words rebuilt, as they are.
        on: rebuild on this device (``tpde.kernels.backend``), None on the host.
        look_ahead: prepare the next batch while one is rebuilt.
        into: host words to rebuild records in, by name.
        passed: where the words of ``plan.taken`` are put, by name.
    """

    def __init__(self, reader: Reader, plan: RebuildPlan, *, problems: list[Problem] | None,
                 check: bool, check_every: bool, progress: Progress | None,
                 on: torch.device | None, look_ahead: bool, into: dict[str, torch.Tensor],
                 passed: dict[str, torch.Tensor]) -> None:
        self.reader, self.plan, self.problems = reader, plan, problems
        self.check, self.check_every, self.progress = check, check_every, progress
        self.look_ahead, self.into, self.passed = look_ahead, into, passed
        self.backend = None
        if on is not None:
            from tpde.kernels.backend import Kernels

            self.backend = Kernels(on)
        self.failed: set[str] = set()
        self.current: dict[str, torch.Tensor] = {}
        # With look-ahead, words that nothing rebuilds further are hashed on the prefetch
        # threads while the next records are rebuilt, a task per batch: otherwise a piece's
        # hash is time the other core has nothing to do beside.
        self.checks: list[tuple[int, list[Record], Future]] = []
        self.pool, self.ahead = pools()
        # Without look-ahead memory comes first: values streamed frame by frame, and records
        # rebuilt on this thread (each decode thread's malloc arena would keep what it freed,
        # several times a small module's size); only a large record's slices are shared out
        # over the frame threads (``unframe.by_slices``).
        self.stream = not look_ahead and self.backend is None
        self.spread = self.pool.map if look_ahead else map
        passed.clear()  # of an attempt that found the run rewritten

    def fail(self, exc: TPDEError, at: int, name: str) -> None:
        exc = exc.located(run=self.reader.run.url, step=at, tensor=name)
        if self.problems is None:
            raise exc
        self.problems.append(Problem.of(exc, at, name))
        self.failed.add(name)

    def run(self) -> dict[str, torch.Tensor]:
        """Rebuild every record; the words of those wanted, checked as the plan says."""
        for name, exc in self.plan.broken:
            self.fail(exc, self.plan.step, name)
        self._rebuild_units()
        for at, recs, done in self.checks:
            for r, found in zip(recs, done.result()):
                if isinstance(found, TPDEError):
                    self.refused(r, True, found, at)
        result = {}
        step = self.plan.step
        for rec in self.plan.wanted:
            if rec.name in self.failed:
                continue
            if self.check and rec.hash != self.reader.run.data_hash(rec, step):
                self.fail(CorruptionError("record's hash differs from the data it points to"),
                          step, rec.name)
                continue
            result[rec.name] = self.current[rec.name]
        return result

    def _rebuild_units(self) -> None:
        """Each (step, batch) in turn, the next prepared while one is rebuilt.

        With look-ahead on the host, a batch's records are handed to the decode threads before
        the batch before is done, unless it rebuilds one of the same tensors: the threads that
        finish one batch start on the next instead of waiting for the other's last frames. Its
        sections are prepared once that batch is done, so that two batches are held.
        """
        units, look_ahead = self.plan.units, self.look_ahead
        overlap = look_ahead and self.backend is None
        running: tuple[Callable[[], None], set[str]] | None = None  # its finish, its tensors
        upcoming = self.ahead.submit(self.prepare, units[0]) \
            if len(units) > 1 and look_ahead else None
        for k, (at, batch) in enumerate(units):
            prepared = upcoming.result() if upcoming is not None else self.prepare(units[k])
            upcoming = None
            names = {r.name for r, _ in batch}
            if running is not None and running[1] & names:
                running[0]()
                running = None
            jobs, rebuilt = self._start(at, batch, prepared)
            del prepared
            if running is not None:
                running[0]()
            running = (partial(self.finish, at, batch, jobs, rebuilt), names)
            del jobs, rebuilt  # held by ``running`` alone, and let go once it is finished
            if not overlap:
                running[0]()
                running = None
            if look_ahead and k + 1 < len(units):
                upcoming = self.ahead.submit(self.prepare, units[k + 1])
        if running is not None:
            running[0]()

    def prepare(self, unit: tuple[int, Batch]) -> Prepared | TPDEError:
        """Fetch, decompress and decode positions of one batch of a step: nothing here needs
        the previous step's words, so it runs one batch ahead of the rebuild."""
        at, batch = unit
        backend = self.backend
        todo = [(r, checked) for r, checked in batch if r.name not in self.failed]
        try:
            fetched = self.reader.fetch(self.reader.run.manifest(at), [r for r, _ in todo],
                                       streamed=self.stream)
        except TPDEError as exc:
            return exc
        recs = [r for r, _ in todo]
        on_gpu = backend is not None and backend.nvcomp
        mode = "gpu" if on_gpu else "host" if backend is not None else \
            "stream" if self.stream else "fused"
        sections = in_runs(self.spread, attempt(decompress),
                           [(r, f, mode) for r, f in zip(recs, fetched)],
                           [r.raw_bytes for r in recs])
        if on_gpu:
            backend.add_values(sections, [
                (f["values"], r.sections["values"].raw, r.sections["values"].chunk)
                if "values" in r.sections else None for r, f in zip(recs, fetched)])
        if backend is not None:  # positions are decoded on the device
            return todo, sections, [None] * len(todo)
        return todo, sections, positions(recs, sections)

    def _start(self, at: int, batch: Batch, prepared: Prepared | TPDEError
               ) -> tuple[list[tuple], Iterable[Any]]:
        """Start rebuilding a prepared batch: its jobs, and their words as they come."""
        if isinstance(prepared, TPDEError):
            for r, _ in batch:
                if r.name not in self.failed:
                    self.fail(prepared, at, r.name)
            return [], []
        backend = self.backend
        jobs = [(r, checked, secs, self.current.get(r.name), pos, backend)
                for (r, checked), secs, pos in zip(*prepared) if r.name not in self.failed]
        if backend is None:  # on the decode threads at once (a pool's map)
            plan = self.plan
            return jobs, runs_of(self.spread, attempt(partial(
                rebuild_checked, at=at, final=plan.final, into=self.into, taken=plan.taken,
                passed=self.passed, later=self.later)), [(job,) for job in jobs],
                [j[0].raw_bytes for j in jobs])
        # Kernels are launched from this thread, one record after another (the device runs
        # them in order either way); the hashes are computed in the pool.
        words = [attempt(rebuild)(job) for job in jobs]
        backend.done([w for w in words if isinstance(w, torch.Tensor)])
        return jobs, self.pool.map(attempt(verified), [j[0] for j in jobs], [j[1] for j in jobs],
                                   words)

    def later(self, r: Record, at: int) -> bool:
        """Whether ``r``'s final words are checked later, on the prefetch threads."""
        return self.look_ahead and self.plan.final[r.name] == at \
            and self.plan.taken.get(r.name) != at

    def refused(self, r: Record, checked: bool, exc: TPDEError, at: int) -> None:
        if checked and not self.check_every and isinstance(exc, CorruptionError) \
                and not isinstance(exc, FormatError):
            exc, at = self.reader.trace(r.name, self.plan.step, exc, at)
        self.fail(exc, at, r.name)

    def finish(self, at: int, batch: Batch, jobs: list[tuple], rebuilt: Iterable[Any]) -> None:
        """Take one batch's rebuilt words (waiting for them), and queue their checks."""
        finals: list[tuple[Record, torch.Tensor]] = []
        for (r, checked, *_), done in zip(jobs, rebuilt):
            if isinstance(done, TPDEError):
                self.refused(r, checked, done, at)
                continue
            self.current[r.name] = done
            if self.backend is None and checked and self.later(r, at):
                finals.append((r, done))
            if self.plan.taken.get(r.name) == at and r.name not in self.passed:  # on a device
                self.passed[r.name] = done.clone()
            if self.progress:
                self.progress(r.raw_bytes)
        if finals:
            self.checks.append((at, [r for r, _ in finals], self.ahead.submit(
                lambda fs: [attempt(verified)(r, True, w) for r, w in fs], finals)))
        if not self.look_ahead:
            heap.freed(sum(r.raw_bytes for r, _ in batch))
