"""tpde — Temporal Position Delta Encoding for PyTorch checkpoints.

Keyframes plus temporal deltas of training state, lossless and hash-checked, in any fsspec store.
"""

import importlib
from typing import Any

__version__ = "0.2.0"

#: Where each public name lives. Importing tpde imports none of them (nor torch): each is
#: imported when first used, so that ``tpde --version`` and ``--help`` answer at once.
_PUBLIC = {
    **dict.fromkeys(("Checkpointer", "Snapshot", "StepInfo", "snapshot"), "tpde.api"),
    **dict.fromkeys(("DEFAULT_KEYFRAME_EVERY", "GcReport", "Problem"), "tpde.chain"),
    **dict.fromkeys(("load_checkpoint", "load_state_dict"), "tpde.entries.entry"),
    **dict.fromkeys(("Mount", "mount"), "tpde.mounting.model"),
    **dict.fromkeys(("Abs", "Bound", "BoundError", "Rel"), "tpde.codec.quant"),
    **dict.fromkeys(("CorruptionError", "FormatError", "LossyWarning", "NotARunError",
                     "StepExistsError", "StepNotFoundError", "StepPendingError", "StoreError",
                     "TPDEError", "UnsafeContentError", "UnsafeContentWarning",
                     "UnsupportedError",
                     "WriterConflictError"), "tpde.errors"),
    **dict.fromkeys(("AttachHandle", "attach"), "tpde.plugins.hook"),
    # Lightning is an optional dependency, imported only when its plugins are asked for.
    "TPDECheckpointIO": "tpde.plugins.lightning",
    **dict.fromkeys(("TPDEModelParallelStrategy", "TPDEFSDPStrategy"),
                    "tpde.plugins.lightning_sharded"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # looked up once
        return value
    try:  # a module of the package, e.g. tpde.dcp (torch.distributed.checkpoint's storage)
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'tpde' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
