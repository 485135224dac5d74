"""tpde's optional C extensions: each loaded where it was built, and one log line a process
where one was not (an install without a C compiler works, on numpy's slower paths, and says
so here and in ``tpde --version``)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

#: Each extension and the work it speeds up.
NAMES = {"_elias": "sparse positions", "_planes": "byte planes and residuals",
         "_zframes": "small zstd frames", "_rebuild": "a mount's rebuilds"}

log = logging.getLogger("tpde")
_said = False


def _try(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"tpde.codec.{name}")
    except ImportError:
        return None


def load(name: str) -> ModuleType | None:
    """The extension ``name`` (of ``NAMES``), or None where this install lacks it."""
    global _said
    module = _try(name)
    if module is None and not _said:
        _said = True
        log.warning("tpde was installed without its C extension %s (%s): it works, on "
                    "numpy's slower paths. `tpde --version` lists what is missing; reinstall "
                    "from the source with a C compiler present to build them", name,
                    NAMES[name])
    return module


def note() -> str:
    """What ``tpde --version`` says of the extensions."""
    missing = [n for n in NAMES if _try(n) is None]
    if not missing:
        return "C extensions built"
    return (f"without the C extensions {', '.join(missing)}: numpy's slower paths "
            "(reinstall with a C compiler present)")
