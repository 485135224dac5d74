"""Loading a sharded step through ``torch.distributed.checkpoint``: DCP's planner asks for
slices of the saved chunks, and ``Reader`` rebuilds each chunk once from its records,
hash-checked, into any world size and placement. ``load_full`` gives the step as one ordinary
state dict in one process. The writing side is ``tpde.plugins.dcp``.

    dcp.load(state, storage_reader=tpde.dcp.Reader("s3://bucket/run"))   # the latest step
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from tpde.chain import DECODE_BATCH_BYTES, Chain, batches
from tpde.codec import dtypes
from tpde.errors import FormatError, TPDEError, UnsupportedError
from tpde.plugins import dcp_metadata as layout
from tpde.plugins.dcp import OnRun, process_rank, unwrapped

__all__ = ["Reader", "load_full"]


class Reader(OnRun, StorageReader):
    """Load step ``step`` (None: the latest) of the run at ``run`` through DCP, into any world
    size and placement: DCP's planner asks for slices of saved chunks, which are rebuilt from
    their records and hash-checked.

    Args:
        run: the run's folder or URL, the same on every rank.
        step: the step to load; None is the latest, resolved once for every rank.
        storage_options: fsspec's options for the run's store.

    Example:
        >>> dcp.load(state, storage_reader=tpde.dcp.Reader("s3://bucket/run"))
    """

    def __init__(self, run: str, step: int | None = None, *,
                 storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.run, self.step, self.storage_options = run, step, storage_options
        self.rank = 0
        self._chain: Chain | None = None
        self._storage: dict[Any, list[str]] = {}
        self._dtypes: dict[str, str] = {}
        self._at: int | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self._refuse_other(checkpoint_id, "dcp.load")
        self._storage = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        chain = self.chain
        chain.require_run()
        step = self.step if self.step is not None else chain.latest()
        m = chain.manifest(step)
        if m.dcp is None:
            raise UnsupportedError("was saved by Checkpointer (one process), not through "
                                   "torch.distributed.checkpoint: load it with "
                                   "tpde.Checkpointer(run).load(step)", run=self.run, step=step)
        self._at = step
        meta, self._storage = layout.from_json(m.dcp, run=self.run, step=step)
        self._dtypes = {fqn: t["dtype"] for fqn, t in m.dcp["tensors"].items()}
        return meta

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self.rank = rank if rank is not None else process_rank()
        if not self._storage:  # metadata read by another rank (or another Reader)
            self._storage = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self._at)  # the step this rank planned

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """One step per load: each rank resolved "the latest" for itself, and a save that
        committed in between would give ranks different steps (and chunk layouts), so the
        coordinator refuses the load before anything is read."""
        steps = sorted({p.storage_data for p in plans})
        if len(steps) > 1:
            raise TPDEError(f"the ranks of this load read different latest steps ({steps}): a "
                            "save committed while they started; nothing was loaded. Load "
                            f"again, or name the step: tpde.dcp.Reader(run, step={steps[-1]})",
                            run=self.run)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._at is None:
            self.read_metadata()
        step = self._at
        # Each saved chunk is rebuilt once, however many slices of it this rank asks for.
        by_chunk: dict[Any, list[Any]] = {}
        for req in plan.items:
            by_chunk.setdefault(req.storage_index, []).append(req)
        chunks = list(by_chunk)
        sizes = [sum(self.chain.manifest(step).record(n).raw_bytes
                     for n in self._records(key, step)) for key in chunks]
        for batch in batches(chunks, sizes, DECODE_BATCH_BYTES):
            names = [n for key in batch for n in self._records(key, step)]
            words = self.chain.materialize(step, names)
            for key in batch:
                parts = [words.pop(n) for n in self._records(key, step)]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                for req in by_chunk[key]:
                    self._serve(req, flat, planner, step)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    # ------------------------------------------------------------------ helpers
    def _records(self, key: Any, step: int) -> list[str]:
        found = self._storage.get(key)
        if found is None:
            raise FormatError(f"rank {self.rank} asked for {key.fqn!r} at offsets "
                              f"{list(key.offset or [])}, which the step does not hold",
                              run=self.run, step=step, tensor=key.fqn)
        return found

    def _serve(self, req: Any, words: torch.Tensor, planner: LoadPlanner, step: int) -> None:
        fqn = req.storage_index.fqn
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(words.view(torch.uint8).numpy().tobytes()))
            return
        saved = self._dtypes[fqn]
        dt = dtypes.by_name(saved)
        target = planner.resolve_tensor(req).detach()
        if target.dtype != dt.torch_dtype:
            raise TPDEError(f"rank {self.rank} loads it into a {target.dtype} tensor, but it "
                            f"was saved as {dt.torch_dtype}; convert after loading, or load "
                            "into a state of the saved dtype", run=self.run, step=step,
                            tensor=fqn)
        sizes = self._chunk_sizes(fqn, req.storage_index.offset)
        chunk = words.view(torch.uint8).view(dt.torch_dtype).reshape(sizes)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            chunk = chunk.narrow(dim, start, length)
        if target.size() != chunk.size():
            raise FormatError(f"rank {self.rank} asked for a {list(target.size())} slice where "
                              f"the stored chunk gives {list(chunk.size())}", run=self.run,
                              step=step, tensor=fqn)
        target.copy_(chunk)
        planner.commit_tensor(req, target)

    def _chunk_sizes(self, fqn: str, offsets: Any) -> list[int]:
        m = self.chain.manifest(self._at)
        for c in m.dcp["tensors"][fqn]["chunks"]:
            if list(c["offsets"]) == list(offsets or []):
                return list(c["sizes"])
        raise FormatError(f"no stored chunk at offsets {list(offsets or [])}", run=self.run,
                          step=self._at, tensor=fqn)


def load_full(run: str, step: int | None = None, *,
              storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A sharded step as one ordinary state dict in this process (what
    ``dcp_to_torch_save`` builds from a DCP folder): every tensor whole, on the CPU.

    Args:
        run: the run's folder or URL.
        step: the step; None is the latest.
        storage_options: fsspec's options for the run's store.

    Returns:
        The state dict, as one process would have saved it.

    Example:
        >>> state = tpde.dcp.load_full("s3://bucket/run")
        >>> torch.save(state, "consolidated.pt")
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = Reader(run, step, storage_options=storage_options)
    reader.read_metadata()  # what is wrong with the step is raised here, not inside DCP
    with unwrapped():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state
