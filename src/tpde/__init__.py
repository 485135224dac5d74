"""tpde — Temporal Position Delta Encoding for PyTorch checkpoints.

Keyframes plus temporal deltas of training state, lossless and hash-checked, in any fsspec store.
"""

from typing import Any

from .api import DEFAULT_KEYFRAME_EVERY, Checkpointer, Snapshot, StepInfo, snapshot
from .chain import GcReport, Problem
from .entry import load_checkpoint, load_state_dict
from .mount import Mount, mount
from .quant import Abs, Bound, BoundError, Rel
from .errors import (CorruptionError, FormatError, LossyWarning, NotARunError, StepExistsError,
                     StepNotFoundError, StepPendingError, StoreError, TPDEError,
                     UnsafeContentError, UnsupportedError, WriterConflictError)
from tpde.plugins.hook import AttachHandle, attach

__version__ = "0.2.0"

__all__ = [
    "Abs",
    "AttachHandle",
    "Bound",
    "BoundError",
    "Checkpointer",
    "CorruptionError",
    "DEFAULT_KEYFRAME_EVERY",
    "FormatError",
    "Mount",
    "GcReport",
    "LossyWarning",
    "NotARunError",
    "Problem",
    "Rel",
    "StepExistsError",
    "StepInfo",
    "Snapshot",
    "StepNotFoundError",
    "StepPendingError",
    "StoreError",
    "TPDECheckpointIO",
    "TPDEError",
    "TPDEFSDPStrategy",
    "TPDEModelParallelStrategy",
    "UnsafeContentError",
    "UnsupportedError",
    "WriterConflictError",
    "attach",
    "load_checkpoint",
    "load_state_dict",
    "mount",
    "snapshot",
]


def __getattr__(name: str) -> Any:
    # Lightning is an optional dependency, imported only when its plugins are asked for.
    if name == "TPDECheckpointIO":
        from tpde.plugins.lightning import TPDECheckpointIO

        return TPDECheckpointIO
    if name in ("TPDEModelParallelStrategy", "TPDEFSDPStrategy"):
        from tpde.plugins import lightning_sharded

        return getattr(lightning_sharded, name)
    if name == "dcp":  # torch.distributed.checkpoint's storage layer, imported when asked for
        import importlib

        return importlib.import_module("tpde.dcp")
    raise AttributeError(f"module 'tpde' has no attribute {name!r}")
