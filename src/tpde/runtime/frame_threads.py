"""The process's frame threads, and how one call's frames are shared out over them.

Below the codec: what is shared out is a caller's own work on indices (frames to compress,
slices of words to decode), nothing about frames or formats.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

#: The fewest raw bytes worth handing to another frame thread. The writer's and the reader's
#: tasks already code tensors side by side, and spreading a small tensor's frames as well
#: slowed fp32 saves (``benchmarks/README.md``).
SPREAD_BYTES = 2 << 20

_pool_lock = threading.Lock()
_pools: dict[tuple[str, int], "Pool"] = {}


class Pool:
    """``size`` threads called ``name``, started on first use and ended by ``stop``.

    The next ``submit`` or ``map`` after a ``stop`` starts new threads, so a caller holding a
    pool across a stop (a restore under way while a plugin tears down) never meets a shut-down
    executor; what was queued before the stop still runs to the end."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _started(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.size, thread_name_prefix=f"tpde-{self.name}")
        return self._executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            return self._started().submit(fn, *args)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        # ``Executor.map`` submits every call before it returns, so under the lock all of
        # them reach the executor this pool has now.
        with self._lock:
            return self._started().map(fn, *iterables)

    def stop(self) -> None:
        """End the threads once the work already handed to them is done."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _in_child() -> None:
    """A forked child (a DataLoader worker) makes its own pools: the parent's threads do not
    exist there, and the lock may have been held by one of them."""
    global _pool_lock
    _pool_lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_in_child)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which a mount's worker and torch's
    intra-op threads share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


def default_threads() -> int:
    """The CPUs this thread may run on, up to 8. ``os.cpu_count`` counts the machine's, and a
    process held to fewer (by ``taskset``, or a launcher binding each rank to its cores) ran
    that many threads on them. Asked afresh each time (a system call of about a microsecond):
    a process bound to its cores after its first save or restore, or held to fewer for a
    while, kept the count it had first, and a restore on two cores ran on one."""
    return max(1, min(8, usable_cpus()))


def pool(name: str, size: int) -> Pool:
    """The process's ``size`` threads called ``name``, made once per process and size.

    Threads outlive the call that started them: a mount decodes many times a second, and
    starting threads for every decode cost more than decoding a small module. A process whose
    CPUs change gets pools of the new size; those of the old size stay, idle, until ``stop``."""
    with _pool_lock:
        if (name, size) not in _pools:
            _pools[name, size] = Pool(name, size)
        return _pools[name, size]


def stop() -> None:
    """End every coding thread of the process once its work is done. A front end calls this
    when it is finished (a Lightning ``Trainer`` leaves no thread behind, as the stock plugin
    does); the next save, restore or mount starts them again, so a caller mid-restore only
    pays for starting threads anew."""
    with _pool_lock:
        pools = list(_pools.values())
    for p in pools:
        p.stop()


def spread(count: int, threads: int | None, work: Callable[[Iterable[int]], None],
           raw: int, least: int | None = None) -> None:
    """``work`` over ``count`` frames (or slices of words) on up to ``threads`` threads, this
    one included. ``work`` gets the indices it is to do, in order; a thread that has none left
    takes the upper half of what remains of the fullest share (``_Shares``), and runs ``work``
    again on it.

    Static shares left a thread idle wherever the other was slowed: by a stream's byte planes
    compressing at very different speeds, or by the pool's threads being busy with another
    caller's frames when the share was handed out (two encode tasks spreading at once), after
    which the whole share fell to the caller. Consecutive indices stay with one thread (slices
    of words share frames with their neighbours), and a helper the pool starts late only takes
    what is left by then.

    zstd releases the GIL for each frame; the process keeps its frame threads, where
    zstandard's ``multi_*_to_buffer`` start threads on every call, and gain less from a
    second one than compression here does (``benchmarks/frames_bench.py``). Each thread
    gets at least ``least`` of the ``raw`` bytes (None: ``SPREAD_BYTES``): below that a
    hand-off costs more than it spares, and small tensors are already coded side by side by
    the writer's tasks.
    """
    n = max(1, min(threads or default_threads(), count, raw // (least or SPREAD_BYTES)))
    if n == 1:
        work(range(count))
        return
    shares = _Shares(count)
    pool = _frame_pool()
    helpers = [pool.submit(shares.run, work, None) for _ in range(n - 1)]
    try:
        shares.run(work, shares.first)
    finally:
        for f in helpers:
            if not f.cancel():
                f.result()


class _Shares:
    """The indices of one ``spread``, as each thread's share ``[at, end)``. Shares change
    under a lock: a thread takes its next index from its own, a thief the upper half of the
    fullest."""

    def __init__(self, count: int) -> None:
        self.lock = threading.Lock()
        self.first = [0, count]
        self.all = [self.first]

    def run(self, work: Callable[[Iterable[int]], None], mine: list[int] | None) -> None:
        """``work`` on ``mine`` (None: a stolen share), then on stolen shares until no share
        has two indices left."""
        if mine is None:
            mine = self._steal()
        while mine is not None:
            work(self._indices(mine))
            mine = self._steal()

    def _indices(self, share: list[int]) -> Iterator[int]:
        while True:
            with self.lock:
                i, end = share
                if i >= end:
                    return
                share[0] = i + 1
            yield i

    def _steal(self) -> list[int] | None:
        with self.lock:
            victim = max(self.all, key=lambda s: s[1] - s[0])
            left = victim[1] - victim[0]
            if left < 2:
                return None
            share = [victim[1] - left // 2, victim[1]]
            victim[1] = share[0]
            self.all.append(share)
            return share


def _frame_pool() -> Pool:
    """Only leaf work runs on it, so callers on other pools cannot deadlock it."""
    return pool("frames", default_threads() - 1 or 1)
