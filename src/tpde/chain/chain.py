"""The facade front ends hold: one run, composed of a reader, a writer and a retainer.

Each part is an object of its own over the shared ``base.Run`` (listings and cached
manifests), given the parts it works through: the writer reads reference words back through the
reader, the retainer rebuilds through the reader and commits through the writer. ``Chain`` adds
nothing of its own; its operations are the parts' methods, reached through it.
"""

from __future__ import annotations

from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar

from tpde.chain.base import Run
from tpde.chain.read import Reader
from tpde.chain.retain import Retainer
from tpde.chain.write import Writer

P = ParamSpec("P")
R = TypeVar("R")


class _Through(Generic[P, R]):
    """A part's method, reached through the facade: ``Chain.load`` is ``chain.reader.load``,
    with its signature and docstring."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.part, self.method = part, method
        self.__doc__, self.__wrapped__ = method.__doc__, method

    def __get__(self, chain: "Chain | None", owner: type | None = None) -> Callable[P, R]:
        if chain is None:
            return self.method  # type: ignore[return-value]
        return getattr(getattr(chain, self.part), self.method.__name__)


class Chain(Run):
    """One run in one store: writing, reading, re-basing and collecting its steps.

    Args:
        url: the run's folder, a local path or any fsspec URL.
        storage_options: passed to fsspec for a remote store.

    Example:
        >>> chain = Chain("memory://runs/demo")
        >>> chain.steps()
        []
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.reader = Reader(self)
        self.writer = Writer(self, self.reader)
        self.retainer = Retainer(self, self.reader, self.writer)

    fetch = _Through("reader", Reader.fetch)
    materialize = _Through("reader", Reader.materialize)
    stored_words = _Through("reader", Reader.stored_words)
    trace = _Through("reader", Reader.trace)
    load = _Through("reader", Reader.load)

    blob_for = _Through("writer", Writer.blob_for)
    mark_run = _Through("writer", Writer.mark_run)
    commit = _Through("writer", Writer.commit)
    write = _Through("writer", Writer.write)
    make_room = _Through("writer", Writer.make_room)

    remove = _Through("retainer", Retainer.remove)
    collect = _Through("retainer", Retainer.collect)
    rebase = _Through("retainer", Retainer.rebase)
    gc = _Through("retainer", Retainer.gc)
    at_rest = _Through("retainer", Retainer.at_rest)
    verify = _Through("retainer", Retainer.verify)
