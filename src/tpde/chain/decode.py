"""One record's decode on the host, and the process's decode threads that run them.

Below ``read``: what rebuilds a single record from its sections and its reference's words, and
checks it; ``read`` plans which records of which steps to rebuild, in what order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from tpde.chain.plan import batches
from tpde.codec import decoder, dtypes, unframe
from tpde.errors import CorruptionError, TPDEError
from tpde.manifest import Record, hash_matches
from tpde.runtime import frame_threads

#: A decode hands its records to the pool in runs of neighbouring records of up to about this
#: many raw bytes, a task each: one task per record cost a restore of many small records
#: more in hand-offs than in decoding.
TASK_BYTES = 1 << 20


def pools() -> tuple[frame_threads.Pool, frame_threads.Pool]:
    """The process's decode threads, one for each CPU this thread may run on, and the threads
    that fetch one step ahead."""
    return (frame_threads.pool("decode", frame_threads.default_threads()),
            frame_threads.pool("prefetch", 2))


def attempt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` returning its TPDEError instead of raising it, for results gathered from a pool."""
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except TPDEError as exc:
            return exc
    return run


def in_runs(run: Callable[..., Iterable[Any]], fn: Callable[..., Any], jobs: list[tuple],
            sizes: list[int]) -> list[Any]:
    """``fn(*job)`` of every job, in order; ``run`` (a pool's ``map``, or ``map``) gets runs of
    neighbouring jobs of up to ``TASK_BYTES`` (``sizes`` are the jobs' raw bytes)."""
    return list(runs_of(run, fn, jobs, sizes))


def runs_of(run: Callable[..., Iterable[Any]], fn: Callable[..., Any], jobs: list[tuple],
            sizes: list[int]) -> Iterator[Any]:
    """``in_runs``, its results taken as they are iterated: a pool's ``map`` has handed every
    run to the pool already, and ``map`` runs each as it is reached."""
    return (out for outs in run(lambda js: [fn(*j) for j in js], batches(jobs, sizes, TASK_BYTES))
            for out in outs)


def decompress(r: Record, framed: dict[str, list[memoryview]], mode: str) -> dict[str, Any]:
    """The record's sections made ready for its decode. ``mode``: ``"fused"`` leaves the
    values of keyframe and dense records as frames that the decode decompresses straight into
    their words (``unframe.Frames``); ``"stream"`` leaves them as frames decompressed as the
    decode reaches them, through a few reused buffers (``unframe.Framed``: memory first), but
    for streams of up to ``unframe.WHOLE_BYTES``, fewer bytes than those buffers, which it
    leaves as ``"fused"`` does;
    ``"gpu"`` leaves every record's values to nvCOMP; ``"host"`` decompresses everything here.
    """
    out: dict[str, Any] = {}
    for (name, s), fr in zip(r.sections.items(), framed.values()):
        if name != "values" or mode == "host" or (mode != "gpu" and r.codec not in STREAMED):
            out[name] = unframe.decompress(fr, s.raw, s.chunk)
        elif mode == "fused" or mode == "stream" and s.raw <= unframe.WHOLE_BYTES:
            out[name] = unframe.Frames(fr, s.raw, s.chunk)
        elif mode == "stream":
            out[name] = unframe.Framed(fr, s.raw, s.chunk)
    return out


def rebuild(job: tuple[Record, bool, Any, torch.Tensor | None, Any, decoder.CPU | None],
             dest: torch.Tensor | None = None) -> torch.Tensor:
    """Decode one record against its reference words (``backend`` None: here; the GPU
    backend keeps the words on its device); a keyframe record into ``dest`` where it can."""
    r, _, secs, ref, positions, backend = job
    if isinstance(secs, TPDEError):
        raise secs
    dt = dtypes.by_name(r.dtype)
    n = r.numel * dt.words_per_element
    # `ref` is a previous decode of this same materialize call: safe to overwrite.
    return decoder.decode(r.codec, r.residual, secs, ref, n, dt.word_dtype, dt.kind,
                        positions=positions, inplace=True, backend=backend,
                        grid=(r.grid, r.scale, r.dtype) if r.codec == "quant" else None,
                        dest=dest)


def verified(r: Record, check: bool, words: torch.Tensor | TPDEError) -> torch.Tensor:
    """``words`` if they hash to the record's hash (or need no check)."""
    if isinstance(words, TPDEError):
        raise words
    if check and not hash_matches(words.view(torch.uint8).cpu().numpy(), r.hash):
        raise CorruptionError("restored bytes do not match the stored hash; the chain is "
                              "damaged at this step")
    return words


def rebuild_checked(job: tuple[Record, bool, Any, torch.Tensor | None, Any, None], *,
                     at: int, final: dict[str, int], into: dict[str, torch.Tensor],
                     taken: dict[str, int], passed: dict[str, torch.Tensor],
                     later: Callable[[Record, int], bool]) -> torch.Tensor:
    """``rebuild`` and ``verified`` on the host, where the decompressed sections can go as soon
    as their record is rebuilt (a GPU's stay until the device is done with them). A record
    with a place in ``into`` is decoded there from its keyframe on, or, where its codecs
    could not work in place, copied there once rebuilt at step ``final[name]``. Words that
    ``materialize``'s caller asked for on the way (rebuilt at ``taken[name]``) are copied
    into ``passed`` here, beside the other rebuilds: the next delta changes them in place.
    Where ``later(record, at)``, the caller checks the words itself."""
    r = job[0]
    dest = into.get(r.name)
    try:
        words = rebuild(job, dest if job[3] is None else None)
        if not later(r, at):
            words = verified(r, job[1], words)
    finally:
        if isinstance(job[2], dict):
            job[2].clear()
    if taken.get(r.name) == at:
        passed[r.name] = words.clone()
    if dest is not None and final[r.name] == at and words.data_ptr() != dest.data_ptr():
        dest.copy_(words)
        return dest
    return words


#: Codecs whose values a memory-first decode streams (``transform.stream_words``,
#: ``transform.apply_streamed``); the others' values are small or needed whole.
STREAMED = ("key", "dense")
