"""tpde as the storage layer under ``torch.distributed.checkpoint`` (DCP).

DCP stays the distributed engine: it plans which rank writes which chunk of which tensor,
deduplicates replicated items and reshards on load. ``Writer`` (here) and ``Reader``
(``dcp_read``) only store and serve chunks. Each rank codes its chunks as tpde records, as
deltas against the chunk of the same tensor, offsets and sizes at the previous step (whichever
rank wrote it), into a blob of its own; the coordinator commits the step last, in one manifest
that names every rank's records and carries DCP's metadata as JSON (chain format 5,
``docs/format.md`` §12). A step is visible only once every rank's blob is durable, so a rank
killed mid-save leaves no half step.

    dcp.save(state, storage_writer=tpde.dcp.Writer("s3://bucket/run", step))
    dcp.load(state, storage_reader=tpde.dcp.Reader("s3://bucket/run"))   # the latest step
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import math
import time
import uuid
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from tpde.chain import PREVIOUS, Chain, Held, RankPiece, RankSave, SaveOptions, Share, \
    commit_shards
from tpde.codec import encoder
from tpde.errors import TPDEError, UnsupportedError
from tpde.plugins import dcp_metadata as layout
from tpde.store.lease import Lease

__all__ = ["Writer"]


def process_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclasses.dataclass
class _Plan:
    """What the coordinator tells every rank about the step being saved."""

    step: int
    reference: int | None


class OnRun:
    """What Writer and Reader share: the run they were made with, opened when first used."""

    run: str
    storage_options: dict[str, Any] | None
    _chain: Chain | None

    @property
    def chain(self) -> Chain:
        if self._chain is None:
            self._chain = Chain(self.run, self.storage_options)
        return self._chain

    def _refuse_other(self, checkpoint_id: Any, call: str) -> None:
        """DCP passes its ``checkpoint_id`` to ``reset``; the run is this object's."""
        if checkpoint_id is not None and str(checkpoint_id) != self.run:
            raise TPDEError(f"{call} was given checkpoint_id={checkpoint_id!r}; a "
                            f"tpde.dcp.{type(self).__name__} "
                            "uses the run it was made with: leave checkpoint_id out",
                            run=self.run)
        self._chain = None  # manifests are read afresh for every save and load


#: ``reference="host"``: by (run, rank), the step a rank saved last, its blob, and its words.
_HELD: dict[tuple[str, int], Held] = {}
#: By (run, rank): each piece's delta coding as last chosen, tried first at the next save.
_CHOICES: dict[tuple[str, int], dict[str, encoder.Choice]] = {}
#: By run (however its URL is spelled): the writer lease this process's coordinator holds. A
#: job's saves are one writer whatever Writer objects carry them, so the lease outlives each
#: save (renewed by the next) and is given up when the process exits.
_LEASES: dict[str, Lease] = {}


def hold(lease: Lease) -> None:
    """Make ``lease`` (a ``Checkpointer``'s, held on its run) the one this process's Writers
    renew, so that a job saving both ways is one writer."""
    _LEASES[lease.store.location] = lease


@atexit.register
def _release_leases() -> None:
    for lease in _LEASES.values():
        with contextlib.suppress(Exception):  # a store gone at exit: the lease expires
            lease.release()


class Writer(OnRun, StorageWriter):
    """Save step ``step`` of the run at ``run`` (any fsspec URL) through DCP.

    The save settings are ``Checkpointer``'s (``SaveOptions``), with the same defaults.
    Chunks larger than half of ``max_inflight_bytes`` (or than 64 MiB) are stored in pieces,
    and each rank codes at most that many bytes at once. ``reference="host"`` (the default)
    keeps a copy of this rank's words of each save in the process for the next one, which then
    reads back only the chunks another rank wrote before; ``reference="store"`` reads every
    chunk's reference back from the store as it is coded, so a rank holds no copy of its
    shards between saves. Sharded steps are lossless, their deltas coded against the step
    saved before: ``error_bound`` and ``deltas_against="keyframe"`` are refused.

    The coordinator holds the run's writer lease (``Checkpointer``'s): a second job saving into
    the run is refused with ``WriterConflictError`` before anything is written. The lease is
    checked by every save of this process, renewed as ``Checkpointer`` renews it, and given up
    when it exits; ``lease_seconds`` and ``takeover`` are ``Checkpointer``'s.

    Args:
        run: the run's folder or URL, the same on every rank.
        step: the step this save commits.
        storage_options: fsspec's options for the run's store.
        **options: the save settings (``SaveOptions``).

    Example:
        >>> dcp.save(state, storage_writer=tpde.dcp.Writer("s3://bucket/run", step))
    """

    def __init__(self, run: str, step: int, *, storage_options: dict[str, Any] | None = None,
                 **options: Any) -> None:
        super().__init__()
        opts = SaveOptions.of(options, "tpde.dcp.Writer")
        if opts.error_bound is not None or opts.deltas_against != PREVIOUS:
            raise ValueError("tpde.dcp.Writer stores sharded steps lossless, their deltas coded "
                             "against the step saved before: leave error_bound and "
                             "deltas_against out")
        self.lease_seconds, self.takeover = opts.lease_seconds, opts.takeover
        self.reference = opts.reference
        if type(step) is not int or step < 0:
            raise TPDEError(f"step must be a non-negative int, got {step!r}", run=run)
        self.run, self.step = run, step
        self.keyframe_every, self.max_inflight_bytes = opts.keyframe_every, opts.max_inflight_bytes
        self.settings = opts.settings
        self.storage_options = storage_options
        self.rank = 0
        self._chain: Chain | None = None
        self._started = time.perf_counter()

    # ------------------------------------------------------------------ DCP's protocol
    def reset(self, checkpoint_id: Any = None) -> None:
        self._refuse_other(checkpoint_id, "dcp.save")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Refuses ``use_collectives=False`` where more than one process saves, before anything
        is written: a step is committed once, by the coordinator, from every rank's results,
        and without collectives each rank would commit the step with its own part alone."""
        rank = kwargs.get("rank")
        self.rank = rank if rank is not None else process_rank()
        if kwargs.get("use_collectives") is False and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise UnsupportedError(
                "dcp.save(..., use_collectives=False) with more than one process: tpde commits "
                "a step once, from every rank's part, and without collectives no rank has "
                "them all; nothing was written. Save with collectives (the default)",
                run=self.run, step=self.step)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: take the run's writer lease, refuse a committed step, and name
        the reference every rank codes against (the newest visible step before this one)."""
        self._started = time.perf_counter()
        chain = self.chain
        lease = _LEASES.setdefault(chain.store.location, Lease(chain.store, self.lease_seconds))
        lease.seconds = self.lease_seconds
        lease.acquire(takeover=self.takeover and not lease.held)
        chain.make_room(self.step)
        earlier = [s for s in chain.steps() if s < self.step]
        shared = _Plan(self.step, earlier[-1] if earlier else None)
        return [dataclasses.replace(p, storage_data=shared) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        shared: _Plan = plan.storage_data
        fut: Future[list[WriteResult]] = Future()
        key = (self.chain.url, self.rank)
        host = self.reference == "host"
        save = RankSave(self.chain.writer, self.step, self.rank, shared.reference,
                        settings=self.settings, keyframe_every=self.keyframe_every,
                        max_inflight_bytes=self.max_inflight_bytes,
                        held=_HELD.get(key) if host else None,
                        choices=_CHOICES.setdefault(key, {}), keep=host)
        results = self._write(plan.items, planner, save)
        if save.kept is not None:
            # Kept for the next save, which uses it only if this very save, by its blob, is
            # its reference (a step the coordinator fails to commit never is, nor a step of
            # the same number in a run made again at the same place).
            _HELD[key] = Held(self.step, save.blob_name, save.kept)
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank's blob is durable: commit the step."""
        shares: list[Share] = []
        storage: dict[tuple[str, tuple[int, ...] | None], list[str]] = {}
        for per_rank in results:
            for wr in per_rank:
                shares.append(wr.storage_data)
                key = (wr.index.fqn, None if wr.index.offset is None else tuple(wr.index.offset))
                storage[key] = [r.name for r in wr.storage_data.records]
        commit_shards(self.chain.writer, self.step, shares, skeleton=layout.skeleton(metadata),
                      layout=layout.to_json(metadata, storage, len(results)),
                      started=self._started)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.run, save_id=uuid.uuid4().hex)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # a tpde run is named by the Writer, never by a checkpoint_id

    # ------------------------------------------------------------------ coding
    def _write(self, items: list[WriteItem], planner: SavePlanner, save: RankSave
               ) -> list[WriteResult]:
        blob = save.blob_name
        writer = self.chain.store.open_write(blob)
        results: list[list] = [[] for _ in items]
        # An item's data is taken from the planner only when its first piece is coded, and
        # let go after its last: a rank never stages its whole state (a GPU's, say) at once.
        held: dict[int, tuple[torch.Tensor, str]] = {}
        for k, item in enumerate(items):
            if item.type == WriteItemType.BYTE_IO:  # small, and its size is known only so
                held[k] = (_as_tensor(item, planner.resolve_data(item)), "cpu")
        todo = [p for k, item in enumerate(items)
                for p in _pieces(save, k, item, held[k][0] if k in held else None)]
        left = {k: sum(p.item == k for p in todo) for k in range(len(items))}
        try:
            for batch in save.batches(todo):
                for p in batch:
                    if p.item not in held:
                        data = planner.resolve_data(items[p.item])
                        held[p.item] = (_as_tensor(items[p.item], data), str(data.device))
                words = [held[p.item][0].reshape(-1)[p.lo : p.hi] for p in batch]
                refs = save.references([(p.name, w) for p, w in zip(batch, words)])
                for p, w in zip(batch, words):
                    results[p.item].append(save.record(writer, p.name, p.start, w,
                                                       held[p.item][1], refs.pop(p.name, None)))
                    left[p.item] -= 1
                    if not left[p.item]:
                        del held[p.item]
                del words
            writer.close()
        except TPDEError as exc:
            writer.abort()
            raise exc.located(run=self.run, step=self.step) from exc
        except BaseException:
            writer.abort()
            raise
        return [WriteResult(index=item.index,
                            size_in_bytes=sum(r.stored_bytes for r in recs),
                            storage_data=Share(blob, writer.size, recs))
                for item, recs in zip(items, results)]


def _as_tensor(item: WriteItem, data: Any) -> torch.Tensor:
    """An item's bytes as a contiguous host tensor (DCP's byte items as uint8)."""
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw \
            else torch.empty(0, dtype=torch.uint8)
    return data.detach().to("cpu").contiguous()


def _pieces(save: RankSave, k: int, item: WriteItem, data: torch.Tensor | None
            ) -> list[RankPiece]:
    """The records of item ``k`` (``data``: a byte item's bytes, already taken)."""
    if item.type == WriteItemType.BYTE_IO:
        assert data is not None
        return save.pieces(k, item.index.fqn, data.numel(), 1)
    chunk = item.tensor_data.chunk
    size = torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()
    return save.pieces(k, layout.chunk_name(item.index.fqn, chunk.offsets, chunk.sizes),
                       math.prod(chunk.sizes), size)


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """DCP wraps what a storage layer raises into a ``CheckpointException`` (a
    ``BaseException``) of every rank's failures; in one process, tpde's own error is raised
    as it is."""
    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = getattr(failure, "exc", None)
            if isinstance(inner, TPDEError):
                raise inner from None
        raise
