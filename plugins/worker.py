"""One background thread that runs a plugin's saves and removals in the order they were asked
for, and ends once nothing is queued: no thread outlives the work it was started for.

A job is called with ``run=True``, or with ``run=False`` after an earlier job failed, so that
it can undo what it announced (a pending entry) without doing the work. The first failure is
kept and raised by the next ``raise_deferred`` or ``wait``.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours)
import logging
import threading
import weakref
from collections import deque
from typing import Any, Callable

Job = Callable[[bool], None]


class Worker:
    """The jobs of one plugin, on a thread named ``name`` while there are any."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._jobs: deque[Job] = deque()
        self._thread: threading.Thread | None = None
        self._started: list[threading.Thread] = []  # the running one, and ones that are ending
        self._error: BaseException | None = None

    def submit(self, job: Job, what: str) -> None:
        """Queue ``job``; a failure it raises carries a note naming ``what``."""

        def tagged(run: bool) -> None:
            try:
                job(run)
            except BaseException as exc:
                exc.add_note(f"tpde: raised by the background {what}")
                raise

        with self._lock:
            self._jobs.append(tagged)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._started.append(self._thread)
                self._thread.start()

    def wait(self) -> None:
        """Block until every queued job is done; raise the first that failed."""
        me = threading.current_thread()
        while True:
            with self._lock:
                thread = next((t for t in self._started if t is not me), None)
            if thread is None:
                break
            thread.join()
            with self._lock:
                self._started.remove(thread)
        self.raise_deferred()

    def raise_deferred(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                job(self._error is None)  # after a failure nothing queued behind it runs
            except BaseException as exc:
                if self._error is None:
                    self._error = exc
            del job  # a save's job holds the state's snapshot


log = logging.getLogger("tpde")
_AT_EXIT: "weakref.WeakKeyDictionary[Any, Callable[[Any], None]]" = weakref.WeakKeyDictionary()


def finish_at_exit(owner: Any, finish: Callable[[Any], None]) -> None:
    """Call ``finish(owner)`` at interpreter exit if ``owner`` is still alive then: saves still
    queued (a script that saves last and ends, a trainer fitting in a thread of its own) are
    committed, not lost."""
    _AT_EXIT[owner] = finish  # not a closure over ``owner``: that would keep it alive


def _finish() -> None:
    for owner, finish in list(_AT_EXIT.items()):
        try:
            finish(owner)
        except BaseException as exc:  # nobody is left to raise it to
            log.error("tpde: a background checkpoint failed at exit: %s", exc)


# Before the interpreter stops its thread pools (which the background saves encode on), not
# after: an ``atexit`` function runs too late to save anything.
threading._register_atexit(_finish)  # type: ignore[attr-defined]
