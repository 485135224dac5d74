"""tpde — Temporal Position Delta Encoding for PyTorch checkpoints.

Keyframes plus temporal deltas of training state, lossless and hash-checked, in any fsspec store.
"""

from .api import DEFAULT_KEYFRAME_EVERY, Checkpointer, StepInfo
from .chain import GcReport, Problem
from .errors import (CorruptionError, FormatError, NotARunError, StepExistsError,
                     StepNotFoundError, StoreError, TPDEError, UnsafeContentError,
                     UnsupportedError, WriterConflictError)
from tpde.plugins.hook import AttachHandle, attach

__version__ = "0.1.0"

__all__ = [
    "AttachHandle",
    "Checkpointer",
    "CorruptionError",
    "DEFAULT_KEYFRAME_EVERY",
    "FormatError",
    "GcReport",
    "NotARunError",
    "Problem",
    "StepExistsError",
    "StepInfo",
    "StepNotFoundError",
    "StoreError",
    "TPDEError",
    "UnsafeContentError",
    "UnsupportedError",
    "WriterConflictError",
    "attach",
]
