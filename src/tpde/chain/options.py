"""How a run's steps are saved: one set of settings, with one set of defaults, checked once,
for every front end (``Checkpointer``, ``attach``, ``TPDECheckpointIO``, ``tpde.dcp.Writer``)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from tpde.chain.plan import DEFAULT_KEYFRAME_EVERY, DELTAS_AGAINST, PREVIOUS
from tpde.codec import encoder, frames, quant
from tpde.store.lease import DEFAULT_LEASE_SECONDS

#: Where the reference of the next delta is kept: a host copy of the last save, or nowhere
#: (each tensor's reference is read back from the store as it is coded).
REFERENCES = ("host", "store")


def whole(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SaveOptions:
    """The settings of a run's saves. Every front end takes them as keyword arguments and
    refuses, before anything is written, one a save could only fail on later (in Lightning's
    background worker) or quietly turn into another.

    Args:
        keyframe_every: a tensor is stored whole again before it would be this many deltas
            deep (re-keys are spread over steps).
        level: the zstd level; None is tpde's fast default.
        chunk_bytes: the size of each zstd frame's input, in [4 KiB, 16 MiB].
        threads: the threads that code a save; None is one a CPU the process may run on, up
            to 8.
        key_margin: a delta is stored only where it is at most this fraction of its keyframe.
        reference: ``"host"`` keeps a host copy of the last save, which the next delta is
            coded against; ``"store"`` keeps nothing and reads each tensor's reference back
            from the store, so that a save's extra memory is bounded by
            ``max_inflight_bytes``.
        max_inflight_bytes: the bytes of tensors being coded at once; larger tensors are
            stored in pieces.
        deltas_against: ``"previous"`` codes each delta against the step saved before,
            ``"keyframe"`` against its tensor's last keyframe (every record one delta deep).
        error_bound: opt-in lossy coding: ``fnmatch`` patterns over tensor names to a bound
            (``tpde.Abs``, ``tpde.Rel``); None is lossless.
        lease_seconds: how long the writer lease lasts between saves.
        takeover: take the run from a writer known to be dead.

    Example:
        >>> tpde.SaveOptions(keyframe_every=8, reference="store").keep_reference
        False
    """

    keyframe_every: int = DEFAULT_KEYFRAME_EVERY
    level: int | None = frames.DEFAULT_LEVEL
    chunk_bytes: int = frames.DEFAULT_CHUNK
    threads: int | None = None
    key_margin: float = 0.95
    reference: str = "host"
    max_inflight_bytes: int = 256 << 20
    deltas_against: str = PREVIOUS
    error_bound: dict[str, quant.Bound] | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    takeover: bool = False

    def __post_init__(self) -> None:
        if not whole(self.keyframe_every) or self.keyframe_every < 1:
            raise ValueError(f"keyframe_every must be a whole number >= 1, got "
                             f"{self.keyframe_every!r}")
        if self.level is not None and (not whole(self.level)
                                       or not frames.MIN_LEVEL <= self.level <= frames.MAX_LEVEL):
            raise ValueError(f"level must be None (tpde's fast default) or a zstd level in "
                             f"[{frames.MIN_LEVEL}, {frames.MAX_LEVEL}], got {self.level!r}")
        if not whole(self.chunk_bytes) or \
                not frames.MIN_CHUNK <= self.chunk_bytes <= frames.MAX_CHUNK:
            raise ValueError(f"chunk_bytes must be in [{frames.MIN_CHUNK}, {frames.MAX_CHUNK}], "
                             f"got {self.chunk_bytes!r}")
        if self.threads is not None and (not whole(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be None (one a core, up to 8) or >= 1, got "
                             f"{self.threads!r}")
        if not isinstance(self.key_margin, numbers.Real) or not 0 < self.key_margin <= 1:
            # above 1 a delta could be stored larger than a keyframe
            raise ValueError(f"key_margin must be in (0, 1], got {self.key_margin!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")
        if not whole(self.max_inflight_bytes) or self.max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be a whole number of bytes >= 1, got "
                             f"{self.max_inflight_bytes!r}")
        if self.deltas_against not in DELTAS_AGAINST:
            raise ValueError(f"deltas_against must be one of {DELTAS_AGAINST}, got "
                             f"{self.deltas_against!r}")
        if self.error_bound is not None:
            quant.Bounds(self.error_bound)  # refuses a pattern or bound it cannot hold
        if not isinstance(self.lease_seconds, numbers.Real) or \
                not math.isfinite(self.lease_seconds) or self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be a finite number > 0, got "
                             f"{self.lease_seconds!r}")

    @classmethod
    def of(cls, given: dict[str, Any], where: str) -> SaveOptions:
        """The options named in ``given``; an unknown name is refused with the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(f"{where} got unknown setting(s) {', '.join(unknown)}; the "
                            f"settings of a save are {', '.join(sorted(known))}")
        return cls(**given)

    @property
    def keep_reference(self) -> bool:
        return self.reference == "host"

    @property
    def settings(self) -> encoder.Settings:
        """The codec's settings."""
        return encoder.Settings(level=self.level, chunk=self.chunk_bytes, threads=self.threads,
                                key_margin=self.key_margin)

    @property
    def bounds(self) -> quant.Bounds | None:
        return quant.Bounds(self.error_bound) if self.error_bound is not None else None

    def given(self) -> dict[str, Any]:
        """The settings that differ from the defaults, as keyword arguments."""
        default = SaveOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}
