"""Lightning's sharded strategies with their checkpoints stored as tpde steps:
``TPDEModelParallelStrategy`` (``ModelParallelStrategy``: FSDP2, tensor parallelism) and
``TPDEFSDPStrategy`` (``FSDPStrategy(state_dict_type="sharded")``).

Lightning's sharded strategies save with ``torch.distributed.checkpoint`` directly and never
call a ``CheckpointIO``, so a plugin alone cannot see their checkpoints. These subclasses
replace only where the bytes go: every rank saves through ``tpde.dcp.Writer`` into the chain
beside the checkpoint files (``<dirpath>/.tpde``), and rank 0 writes the checkpoint's entry,
exactly as ``TPDECheckpointIO`` does for single-process checkpoints. Everything else is
Lightning's: ``ModelCheckpoint`` top-k, ``last``, resume and removal (which the
``TPDECheckpointIO`` carries out: the entry goes, the chain re-bases and frees the step).

Both store Lightning's own checkpoint layout (``state_dict``, ``optimizer_states`` and the
rest), their model and optimizer states sharded, so a consolidated restore (``tpde restore
last.ckpt --output plain.ckpt``) is a plain Lightning checkpoint, whichever strategy saved it.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from tpde.api import StepInfo
from tpde.chain import PREVIOUS
from tpde.entries import entry as entries
from tpde.plugins.dcp import Writer, hold
from tpde.plugins.dcp_read import Reader
from tpde.plugins.lightning import TPDECheckpointIO
from tpde.state import tree
from tpde.store.lease import DEFAULT_LEASE_SECONDS


class _TPDESharded:
    """Saving and loading through tpde.dcp, for a Lightning strategy whose model and optimizer
    states are sharded (DTensor or ShardedTensor) and read with ``get_model_state_dict`` /
    ``get_optimizer_state_dict``, which serve FSDP, FSDP2 and tensor parallelism alike."""

    def __init__(self, *args: Any, checkpoint_io: TPDECheckpointIO | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint_io = checkpoint_io or TPDECheckpointIO()

    def _tpde(self) -> TPDECheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, TPDECheckpointIO):
            raise TypeError(f"{type(self).__name__} needs a TPDECheckpointIO, not "
                            f"{type(io).__name__}")
        if io.options.deltas_against != PREVIOUS or io.options.error_bound is not None:
            raise ValueError(f"{type(self).__name__} saves sharded checkpoints lossless, their "
                             "deltas coded against the step saved before: leave the "
                             "TPDECheckpointIO's deltas_against and error_bound out")
        return io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        io = self._tpde()
        path = str(self.broadcast(str(filepath)))
        options = {**io.storage_options, **(storage_options or {})}
        url = io.chain_url(entries.split(path)[0])
        started = time.perf_counter()
        step, lease_seconds = None, DEFAULT_LEASE_SECONDS
        if self.global_rank == 0:
            io.wait()  # a removal still re-basing the chain finishes before this step starts
            ckpt = io.run_for(url).ckpt
            step, lease_seconds = ckpt.next_step(), ckpt.lease.seconds
            hold(ckpt.lease)  # the Writer's coordinator renews this job's one lease
        step = self.broadcast(step)
        meta = {k: checkpoint[k] for k in ("epoch", "global_step")
                if type(checkpoint.get(k)) is int}
        # Lightning's own layout, its model and optimizer states sharded: a consolidated
        # restore (``tpde restore last.ckpt --output plain.ckpt``) is a plain Lightning
        # checkpoint.
        settings = {**io.options.given(), "lease_seconds": lease_seconds}
        dcp.save(checkpoint, storage_writer=Writer(url, step, storage_options=io.storage_options,
                                                   **settings))
        if self.global_rank == 0:
            io.run_for(url).next = step + 1
            info = StepInfo.of(ckpt.chain.manifest(step))
            io._publish(path, options, ckpt, info, meta,
                        (time.perf_counter() - started) * 1e3, started)
        self.barrier("tpde-sharded-save")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        path = str(self.broadcast(str(checkpoint_path)))
        io = self._tpde()
        chain, step, _ = entries.resolve(path, io.storage_options)
        if step is None:  # a plain or DCP-folder checkpoint from before the run used tpde
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.lightning_module is not None
        reader = lambda: Reader(chain.url, step, storage_options=io.storage_options)  # noqa: E731
        model = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model, storage_reader=reader())
        self.model.load_state_dict(model["state_dict"],
                                   strict=self.lightning_module.strict_loading)
        if self.optimizers:
            optim = {"optimizer_states": [get_optimizer_state_dict(self.model, o)
                                          for o in self.optimizers]}
            dcp.load(optim, storage_reader=reader())
            for optimizer, state in zip(self.optimizers, optim["optimizer_states"]):
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state,
                                         options=StateDictOptions(cpu_offload=True))
        # The rest (loops, callbacks, hyperparameters) is small: read part by part, so that
        # the model and optimizer states are not consolidated here.
        skeleton = chain.manifest(step).skeleton
        return {key: chain.load(step, trusted=weights_only is False, keep_words=False,
                                within=key)[0]
                for key in tree.keys(skeleton) if key not in ("state_dict", "optimizer_states")}


class TPDEModelParallelStrategy(_TPDESharded, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints are sharded tpde steps.

    ``TPDEModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=...,
    checkpoint_io=TPDECheckpointIO(...))``: the other arguments are
    ``ModelParallelStrategy``'s; ``checkpoint_io`` (default ``TPDECheckpointIO()``) gives the
    chain's settings and carries out removals. Checkpoints are always sharded (one blob per
    rank in the chain): ``save_distributed_checkpoint=False`` is refused.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ValueError("TPDEModelParallelStrategy saves sharded checkpoints; for one "
                             "full checkpoint use ModelParallelStrategy("
                             "save_distributed_checkpoint=False) with TPDECheckpointIO")
        super().__init__(*args, **kwargs)


class TPDEFSDPStrategy(_TPDESharded, FSDPStrategy):
    """``FSDPStrategy(state_dict_type="sharded")`` whose checkpoints are sharded tpde steps.

    The arguments are ``FSDPStrategy``'s, with ``checkpoint_io`` as for
    ``TPDEModelParallelStrategy``. ``state_dict_type`` is always ``"sharded"``: for full
    checkpoints, ``FSDPStrategy(state_dict_type="full")`` already saves through a
    ``TPDECheckpointIO``. Like ``FSDPStrategy``, it needs CUDA devices (torch's FSDP does).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.setdefault("state_dict_type", "sharded") != "sharded":
            raise ValueError("TPDEFSDPStrategy saves sharded checkpoints; for full ones use "
                             "FSDPStrategy(state_dict_type='full') with TPDECheckpointIO")
        super().__init__(*args, **kwargs)
