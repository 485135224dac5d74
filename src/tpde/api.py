"""The plain-PyTorch front end: ``Checkpointer`` saves, loads, removes and verifies steps."""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from . import codec, dtypes, frames, tree
from .chain import Chain, GcReport, Problem, Reference
from .lease import DEFAULT_LEASE_SECONDS, Lease
from .manifest import Manifest

#: Chosen on real training chains (benchmarks/README.md): for bf16 weights 8 -> 16 -> 32 gives
#: 4.15x -> 4.69x -> 5.38x while restoring the deepest step gets several times slower; dense
#: fp32 state gains nothing past 4. 16 keeps most of the ratio and at most 15 deltas per restore.
DEFAULT_KEYFRAME_EVERY = 16


def _malloc_trim() -> Any:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to ask (Windows): nothing to trim
        return None


_MALLOC_TRIM = _malloc_trim()


def _return_freed_memory() -> None:
    """Hand heap pages freed by an encode back to the OS.

    glibc raises its mmap threshold to the size of the large buffers an encode frees and then
    keeps such buffers in its heaps, so without this a long run's writer holds several states'
    worth of idle memory (measured over 20 saves of a 46 MB bf16 state: about 550 MB, 110 MB
    with it).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def check_reference(reference: str) -> None:
    if reference not in ("host", "store"):
        raise ValueError('reference must be "host" or "store"')


@dataclass(frozen=True)
class StepInfo:
    """What one save wrote."""

    step: int
    keyframe: bool
    raw_bytes: int
    stored_bytes: int
    seconds: float
    codecs: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.stored_bytes)

    @classmethod
    def of(cls, m: Manifest) -> "StepInfo":
        return cls(m.step, m.keyframe, m.raw_bytes, m.stored_bytes, m.seconds,
                   dict(Counter(r.codec for r in m.records)))


@dataclass
class Snapshot:
    """A private point-in-time copy of a state, taken on the training thread and saved later.

    Saving it costs no further copy: its tensors become the writer's reference as they are.
    """

    flat: tree.Flat
    raw_bytes: int


def snapshot(state: Any, *, device: str | torch.device = "cpu") -> Snapshot:
    """Copy every tensor of ``state`` to ``device`` now; non-tensor values are serialised now.

    Shared storages are copied once and stay shared. From CUDA, copies to the host go through
    pinned memory and synchronise once at the end.
    """
    flat = tree.flatten(state)
    target = torch.device(device)
    pinned = target.type == "cpu" and torch.cuda.is_available()
    raw, synced = 0, False
    for span in flat.spans:
        src = span.tensor.detach()
        dt = dtypes.of_tensor(src, name=span.name)
        words = codec.to_words(src, dt.word_dtype)
        if words.device == target and target.type == "cpu":
            copy = words.clone()
        else:
            copy = torch.empty(words.shape, dtype=words.dtype, device=target,
                               pin_memory=pinned and words.is_cuda)
            copy.copy_(words, non_blocking=words.is_cuda)
            synced = synced or words.is_cuda
        span.tensor = copy.view(torch.uint8).view(src.dtype)
        raw += copy.numel() * copy.element_size()
    if synced:
        torch.cuda.synchronize()
    return Snapshot(flat, raw)


class Checkpointer:
    """A chain of checkpoints of one run, in any fsspec location.

    The writer keeps the last saved (or loaded) step in host memory, in each tensor's own dtype:
    one extra copy of the state, which is what the next delta is coded against.  A new
    ``Checkpointer`` on an existing run starts with a keyframe unless ``load()`` is called first.

    ``reference="store"`` keeps no such copy: each tensor's previous version is read back from
    the chain while it is encoded, so saving a state larger than the free memory works, with
    extra memory bounded by ``max_inflight_bytes`` (bytes of tensors being encoded at once; a
    few times that in buffers, measured in the README), at the cost of reading and decoding the
    previous step on every save. Tensors larger than half of it (at most 64 MiB) are stored in
    pieces, each coded on its own, so one huge tensor is bounded the same way.

    Saving, removing and gc hold the run's writer lease (renewed on each of them; set
    ``lease_seconds`` above the time between your saves); a second writer is refused with
    ``WriterConflictError`` until ``close()``, expiry, or the holder's process dying on this host.
    ``takeover=True`` takes the run from a writer known to be dead.  Loading never waits.
    """

    def __init__(self, run: str, *, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 storage_options: dict[str, Any] | None = None, level: int = frames.DEFAULT_LEVEL,
                 chunk_bytes: int = frames.DEFAULT_CHUNK, threads: int | None = None,
                 key_margin: float = 0.9, lease_seconds: float = DEFAULT_LEASE_SECONDS,
                 takeover: bool = False, reference: str = "host",
                 max_inflight_bytes: int = 256 << 20) -> None:
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be >= 1")
        check_reference(reference)
        self.keep_reference = reference == "host"
        self.max_inflight_bytes = max_inflight_bytes
        self.run = run
        self.keyframe_every = keyframe_every
        self.settings = codec.Settings(level=level, chunk=chunk_bytes, threads=threads,
                                       key_margin=key_margin)
        self.chain = Chain(run, storage_options)
        self.lease = Lease(self.chain.store, lease_seconds)
        self._takeover = takeover
        self._reference: Reference | None = None

    def _writing(self) -> None:
        """Hold or renew the run's writer lease before changing anything."""
        self.lease.acquire(takeover=self._takeover and not self.lease.held)

    def save(self, step: int, state: Any) -> StepInfo:
        """Commit ``state`` (anything you would pass to ``torch.save``, or a ``Snapshot``)."""
        owned = isinstance(state, Snapshot)
        flat = state.flat if owned else tree.flatten(state)
        self._writing()
        reference, self._reference = self._reference, None
        try:
            manifest, self._reference = self.chain.write(
                step, flat, reference, settings=self.settings,
                keyframe_every=self.keyframe_every, keep_reference=self.keep_reference,
                max_inflight_bytes=self.max_inflight_bytes, owned=owned)
        finally:
            del flat, reference
            _return_freed_memory()
        return StepInfo.of(manifest)

    def next_step(self) -> int:
        """One past the highest step ever committed here, taken under this writer's lease."""
        self._writing()
        return max(self.chain.committed(), default=0) + 1

    def load(self, step: int | None = None, map_location: tree.MapLocation = None, *,
             trusted: bool = False) -> Any:
        """The checkpoint at ``step`` (the latest when None); later saves are deltas against it.

        ``trusted=True`` allows unpickling objects outside torch's weights-only allowlist.
        """
        if step is None:
            step = self.chain.latest()
        state, words = self.chain.load(step, map_location=map_location, trusted=trusted,
                                       keep_words=self.keep_reference)
        m = self.chain.manifest(step)
        # Without keep_words the chain hands back no words: nothing is kept.
        self._reference = Reference(step, m.depth, words, {r.name: r for r in m.records})
        return state

    def steps(self) -> list[int]:
        return self.chain.steps()

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int) -> StepInfo:
        return StepInfo.of(self.chain.manifest(step))

    def remove(self, step: int) -> None:
        """Hide ``step``; every other step stays restorable (its bytes go once nothing needs them)."""
        self._writing()
        self.chain.remove(step)

    def gc(self, *, grace_seconds: float = 3600.0) -> GcReport:
        """Free what no visible step needs, keeping this writer's reference."""
        self._writing()
        keep: Iterable[int] = [self._reference.step] if self._reference else []
        return self.chain.gc(grace_seconds=grace_seconds, keep=keep)

    def close(self) -> None:
        """Release the writer lease so another job may write the run; reading needs none."""
        self.lease.release()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify(self, step: int | None = None) -> list[Problem]:
        """Hash-check ``step`` (or every visible step); an empty list means all is well."""
        return self.chain.verify(step)
