"""What the Lightning plugin asks of the ``Trainer`` it serves, without importing it: whether a
call comes from a ``Trainer`` that is fitting, and this process's rank.

``lightning`` and ``pytorch_lightning`` each carry a copy of Lightning; both are looked for.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any


def import_all(names: tuple[str, ...], attr: str) -> list[Any]:
    found = []
    for name in names:
        try:
            found.append(getattr(importlib.import_module(name), attr))
        except ImportError:
            pass
    return found


#: The calls a save or a removal comes through while a ``Trainer`` runs, by module:
#: ``Trainer.save_checkpoint`` (its ``self`` is the trainer) and ``Strategy.remove_checkpoint``
#: (its ``self`` is the trainer's strategy). Looked up when a save is made: a ``Trainer`` that
#: is saving has been imported (importing it here would import the whole trainer).
_CALLERS = (("lightning.pytorch.trainer.trainer", "Trainer", "save_checkpoint"),
            ("pytorch_lightning.trainer.trainer", "Trainer", "save_checkpoint"),
            ("lightning.pytorch.strategies.strategy", "Strategy", "remove_checkpoint"),
            ("pytorch_lightning.strategies.strategy", "Strategy", "remove_checkpoint"))
#: How far up the stack those calls are looked for (wrapping plugins add a frame each).
_STACK_DEPTH = 6


@functools.lru_cache(maxsize=None)
def _callers(imported: tuple[bool, ...]) -> dict[Any, list[type]]:
    """The code objects of the ``_CALLERS`` whose modules are ``imported``, each with the
    classes it came from. Code objects compare by value: ``lightning.pytorch``'s and
    ``pytorch_lightning``'s copies of one method are equal keys."""
    codes: dict[Any, list[type]] = {}
    for (module, cls, method), there in zip(_CALLERS, imported):
        if there:
            kind = getattr(sys.modules[module], cls)
            codes.setdefault(getattr(kind, method).__code__, []).append(kind)
    return codes


def fitting() -> bool:
    """Whether this thread is inside a ``Trainer`` that is fitting. Only then does training
    go on beside a save or a removal; anywhere else (before or after ``fit``, in
    ``validate``, Fabric, a wrapping plugin's thread) they are done before they return, so
    none is left in flight when the caller goes on, reads the file or exits."""
    codes = _callers(tuple(module in sys.modules for module, _, _ in _CALLERS))
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        frame = frame.f_back
        if frame is None:
            return False
        kinds = codes.get(frame.f_code)
        if kinds:  # only this frame's locals are read: reading a frame's locals keeps them
            owner = frame.f_locals.get("self")  # alive as long as the frame lives
            if not isinstance(owner, tuple(kinds)):
                return False
            trainer = (owner if kinds[0].__name__ == "Trainer"
                       else getattr(owner.lightning_module, "_trainer", None))
            state = getattr(trainer, "state", None)
            return state is not None and state.fn == "fit" and state.status == "running"
    return False


def rank() -> int:
    for rank_zero in import_all(("lightning.fabric.utilities.rank_zero",
                                  "lightning_fabric.utilities.rank_zero"), "rank_zero_only"):
        rank = getattr(rank_zero, "rank", None)
        if rank is not None:
            return int(rank)
    return 0
