"""The plain-PyTorch front end: ``Checkpointer`` saves, loads, removes and verifies steps."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from tpde.chain import Chain, GcReport, Problem, Reference, SaveOptions
from tpde.codec import dtypes, transform
from tpde.errors import UnsafeContentWarning
from tpde.manifest import Manifest, collector_paused
from tpde.runtime.heap import Trims
from tpde.state import tree
from tpde.store.lease import Lease


@dataclass(frozen=True)
class StepInfo:
    """What one save wrote, and (right after a save) what the whole run holds at rest."""

    step: int
    keyframe: bool
    raw_bytes: int
    stored_bytes: int
    seconds: float
    codecs: dict[str, int] = field(default_factory=dict)
    #: Bytes the run's store holds, every step, manifest and leftover included (None: not
    #: measured). Counted by the writer's first save, and again after anything but a save put
    #: or deleted an object (a lease renewal, a re-base, a purge, a deleted leftover); other
    #: saves add what they wrote, so a save costs the same however many steps the run holds.
    run_bytes: int | None = None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.stored_bytes)

    @classmethod
    def of(cls, m: Manifest, run_bytes: int | None = None) -> "StepInfo":
        return cls(m.step, m.keyframe, m.raw_bytes, m.stored_bytes, m.seconds,
                   dict(Counter(r.codec for r in m.records)), run_bytes)


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
    pinned memory and synchronise once at the end. A ``Checkpointer`` saves a snapshot without
    copying it again, so training may change ``state`` while the snapshot is saved elsewhere.

    Args:
        state: anything ``Checkpointer.save`` takes.
        device: where the copies are kept.

    Returns:
        The snapshot, for ``Checkpointer.save``.

    Example:
        >>> snap = tpde.snapshot({"model": model.state_dict()})
        >>> threading.Thread(target=ckpt.save, args=(step, snap)).start()
    """
    flat = tree.flatten(state)
    target = torch.device(device)
    pinned = target.type == "cpu" and torch.cuda.is_available()
    raw, synced = 0, False
    for span in flat.spans:
        src = span.tensor.detach()
        dt = dtypes.of_tensor(src, name=span.name)
        words = transform.to_words(src, dt.word_dtype)
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

    The writer keeps the last saved step in host memory, in each tensor's own dtype: one extra
    copy of the state, which is what the next delta is coded against.  A new ``Checkpointer`` on
    an existing run starts with a keyframe unless ``load()`` is called first. A loaded step is
    not copied: ``load()`` hands back the restored tensors themselves (a restore makes one copy
    of the state, not two), and the first save after it reads each tensor's reference back from
    the chain as ``reference="store"`` does.

    ``reference="store"`` keeps no such copy: each tensor's previous version is read back from
    the chain while it is encoded, so saving a state larger than the free memory works, with
    extra memory bounded by ``max_inflight_bytes`` (bytes of tensors being encoded at once; a
    few times that in buffers, measured in docs/reliability.md), at the cost of reading and
    decoding the previous step on every save. Tensors larger than half of it (at most 64 MiB)
    are stored in pieces, each coded on its own, so one huge tensor is bounded the same way.

    Saving, removing and gc hold the run's writer lease (checked by each of them, and renewed
    by those a minute or more after the last renewal; set ``lease_seconds`` a minute above the
    time between your saves); a second writer is refused with ``WriterConflictError`` until
    ``close()``, expiry, or the holder's process dying on this host. ``takeover=True`` takes
    the run from a writer known to be dead.  Loading never waits.

    Keyframes are decided per tensor: a tensor is re-keyed before it would be
    ``keyframe_every`` deltas deep, the re-keys spread over steps, and a tensor that never
    changes is stored once. ``remove`` re-bases the steps that read from the removed one and
    frees its bytes, so a run holds at most what its visible steps would cost as keyframes.

    ``deltas_against="keyframe"`` codes each delta against its tensor's last keyframe record
    instead of the step saved before, so that restoring any step, the latest included, decodes
    at most one delta of each tensor, however far past its keyframe. Deltas against an older
    state are larger where tensors drift, bf16 weights most (docs/performance.md, "Deltas
    against keyframes"). The run's marker records the choice, so that re-bases (``remove``,
    ``gc``, the CLI's) keep every record one delta deep.

    ``error_bound`` (opt-in; default lossless) saves the tensors it names within a pointwise
    bound, e.g. ``{"model/*": tpde.Rel(1e-3), "*.bias": tpde.Abs(1e-6)}``: keys are ``fnmatch``
    patterns over the names ``tpde info`` prints, the first match wins, and integer and bool
    tensors stay exact. Every restored element of such a tensor is within the bound of the
    value saved at that step, however long the chain; see docs/lossy.md.

    Args:
        run: the run's folder or URL (``runs/exp1``, ``s3://bucket/runs/exp1``).
        storage_options: fsspec's options for the store (credentials, endpoint, ...).
        **options: the save settings, each checked here (``SaveOptions`` lists them and
            their defaults, the same for every front end).

    Example:
        >>> ckpt = tpde.Checkpointer("runs/exp1", keyframe_every=16)
        >>> info = ckpt.save(100, {"model": model.state_dict()})
        >>> state = ckpt.load()  # the latest step
    """

    def __init__(self, run: str, *, storage_options: dict[str, Any] | None = None,
                 **options: Any) -> None:
        self.options = opts = SaveOptions.of(options, "Checkpointer")
        self.deltas_against = opts.deltas_against
        self.bounds = opts.bounds
        self._bounds_checked = False
        self.keep_reference = opts.keep_reference
        self.max_inflight_bytes = opts.max_inflight_bytes
        self.run = run
        self.keyframe_every = opts.keyframe_every
        self.settings = opts.settings
        self.chain = Chain(run, storage_options)
        self.lease = Lease(self.chain.store, opts.lease_seconds)
        self._takeover = opts.takeover
        self._reference: Reference | None = None
        # The run's bytes at rest as last counted, kept up by this writer's saves (None: count
        # them again), and the store's changes when they were: counting lists the whole store,
        # which made each save O(steps).
        self._run_bytes: int | None = None
        self._counted = 0
        self._deferred: set[int] = set()  # removed with defer=True, their bytes not yet freed
        # While removals wait, beside the run's bytes: the raw bytes of its visible steps and
        # of the largest one (``AtRest.plain``, ``AtRest.largest``), kept up the same way.
        self._plain: tuple[int, int] | None = None
        # The C heap, trimmed after a save once it holds max_inflight_bytes more free than
        # after this writer's last trim.
        self._trims = Trims()
        #: Stored objects already checked against the weights-only unpickler, and what was
        #: said of them (``_say_untrusted``).
        self._pickles: dict[int, str | None] = {}
        self._refused: set[tuple[str, str]] = set()

    def _writing(self) -> None:
        """Hold or renew the run's writer lease before changing anything."""
        self.lease.acquire(takeover=self._takeover and not self.lease.held)

    @collector_paused()
    def save(self, step: int, state: Any) -> StepInfo:
        """Commit ``state`` (anything you would pass to ``torch.save``, or a ``Snapshot``) as
        ``step``: a step exists whole once this returns, or not at all.

        Args:
            step: a non-negative int above the run's committed steps.
            state: the checkpoint.

        Returns:
            What the save wrote (``raw_bytes``, ``stored_bytes``, ``ratio``, ``codecs``) and
            the run's bytes at rest.

        Example:
            >>> info = ckpt.save(100, {"model": model.state_dict(), "step": 100})
            >>> print(info.ratio, info.codecs)
        """
        owned = isinstance(state, Snapshot)
        flat = state.flat if owned else tree.flatten(state)
        self._say_untrusted(step, flat)
        if self.bounds is not None and not self._bounds_checked:
            self.bounds.check(n for span in flat.spans for n in span.names)
            self._bounds_checked = True
        self._writing()
        counted, self._run_bytes = self._run_bytes, None  # until this save is counted
        reference, self._reference = self._reference, None
        try:
            manifest, self._reference = self.chain.write(
                step, flat, reference, settings=self.settings,
                keyframe_every=self.keyframe_every, keep_reference=self.keep_reference,
                max_inflight_bytes=self.max_inflight_bytes, owned=owned, bounds=self.bounds,
                against=self.deltas_against)
        finally:
            del flat
            self._trims.after(self.max_inflight_bytes)
        if self._deferred:
            self._free_deferred(saved=manifest, counted=counted)
        elif reference is not None:
            self._collect_hidden(reference.step)
        # (Waiting removals may have counted the run, this save included, on the way.)
        if self._run_bytes is None:
            kept_up = self._kept_up(counted, manifest)
            self._run_bytes = kept_up if kept_up is not None else self.chain.at_rest().total
            self._counted = self.chain.store.changes
        return StepInfo.of(manifest, self._run_bytes)

    def _say_untrusted(self, step: int, flat: tree.Flat) -> None:
        """Warn, once a run and object, of what only a trusted load will read back."""
        for where, refused in tree.refused_pickles(flat.pickles, self._pickles):
            if (where, refused) in self._refused:
                continue
            self._refused.add((where, refused))
            warnings.warn(UnsafeContentWarning(
                f"run {self.run!r}, step {step}: {where!r} is stored as a pickled Python object "
                f"({refused}), which torch's weights-only unpickler refuses, so loading it will "
                "need trusted=True (CLI: --trusted; Lightning: weights_only=False), or "
                f"torch.serialization.add_safe_globals([{refused}]). Store tensors, numbers, "
                "strings, lists and dicts instead (a model's state_dict(), not the model)"),
                stacklevel=4)  # past the collector's wrapper, to the caller of save

    def _collect_hidden(self, former: int) -> None:
        """A step removed while it was this writer's reference goes once it no longer is."""
        if self.chain.is_hidden(former):
            self.chain.collect(keep=self._keep(), settings=self.settings,
                               keyframe_every=self.keyframe_every, later=self._reference)

    def next_step(self) -> int:
        """One past the highest step ever committed here, taken under this writer's lease."""
        self._writing()
        return max(self.chain.committed(), default=0) + 1

    def load(self, step: int | None = None, map_location: tree.MapLocation = None, *,
             trusted: bool = False) -> Any:
        """The checkpoint at ``step`` (the latest when None); later saves are deltas against it.

        Args:
            step: the step; None is the latest.
            map_location: as ``torch.load``'s.
            trusted: unpickle objects outside torch's weights-only allowlist.

        Returns:
            The checkpoint, bit for bit as saved (within its bound, for an error-bounded step).

        Example:
            >>> state = ckpt.load(map_location="cpu")
            >>> model.load_state_dict(state["model"])
        """
        if step is None:
            step = self.chain.latest()
        elif type(step) is not int:
            raise TypeError(f"Checkpointer.load: step must be an int, not {step!r} "
                            f"({type(step).__name__}); the run's steps: {self.steps()}")
        state, _ = self.chain.load(step, map_location=map_location, trusted=trusted,
                                   keep_words=False)
        # The state's tensors are the restored words themselves, not a copy beside a kept one:
        # the next save reads its reference back from the chain.
        former, self._reference = self._reference, Reference(step, {}, held=False)
        if former is not None and former.step != step and self.lease.held:
            self._collect_hidden(former.step)  # removed while it was the reference: it goes now
        return state

    def steps(self) -> list[int]:
        return self.chain.steps()

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int) -> StepInfo:
        return StepInfo.of(self.chain.manifest(step))

    @collector_paused()
    def remove(self, *steps: int, defer: bool = False) -> GcReport:
        """Hide ``steps`` and free their bytes: the steps that read from them are re-based
        first (rewritten to read from kept steps only), so every other step stays restorable.
        Then, as ``gc`` does, leftovers of crashed saves older than an hour go too.

        ``defer=True`` is for retention policies (the Lightning plugin's removals use it): the
        steps are hidden at once, but their bytes are freed only when the run could otherwise
        come to hold more than the plain format's files of its visible steps (``AtRest.plain``,
        less room for a re-base to write the largest step before it deletes), and when this
        writer closes or calls ``gc``. Steps removed in the meantime are re-based off in one
        go, and a step removed before anything kept had to be re-based off it costs no
        re-base at all. The report is empty unless this call freed something.

        Example:
            >>> ckpt.remove(100, 200)  # every other step still restores
        """
        self._writing()
        for step in steps:
            self.chain.remove(step)
        if not defer:
            return self.gc()
        self._deferred.update(steps)
        return self._free_deferred()

    def _free_deferred(self, saved: Manifest | None = None, counted: int | None = None
                       ) -> GcReport:
        """Free what deferred removals hold before the run could hold more than the plain
        format's files would: a re-base writes a step's new blob (at most its raw bytes) before
        it deletes anything, so that much room is kept. After a save (``saved``, the run's
        bytes ``counted`` before it) that was the only change since the last count, the counts
        are kept up without listing the store."""
        total = self._kept_up(counted, saved) if saved is not None and self._plain else None
        if total is not None:
            plain, largest = self._plain[0] + saved.raw_bytes, max(self._plain[1],
                                                                    saved.raw_bytes)
        else:
            rest = self.chain.at_rest()
            total, plain, largest = rest.total, rest.plain, rest.largest
        if total + largest > plain:
            return self.gc()
        self._plain = (plain, largest)
        # the save need not count them again
        self._run_bytes, self._counted = total, self.chain.store.changes
        return GcReport()

    def _kept_up(self, counted: int | None, saved: Manifest) -> int | None:
        """The run's bytes ``counted`` before a save plus what it stored, if that save's
        manifest was the only thing put since the count (a lease renewal, a re-base, a purge, a
        deleted leftover would have put or deleted more); None where the run must be listed."""
        if counted is not None and self.chain.store.changes == self._counted + 1:
            return counted + saved.stored_bytes
        return None

    def gc(self, *, grace_seconds: float = 3600.0) -> GcReport:
        """Re-base and free what no visible step needs, keeping this writer's reference, and
        delete leftovers of crashed saves older than ``grace_seconds``."""
        self._writing()
        self._deferred.clear()
        self._plain = None
        return self.chain.gc(grace_seconds=grace_seconds, keep=self._keep(),
                             settings=self.settings, keyframe_every=self.keyframe_every,
                             later=self._reference)

    def _keep(self) -> Iterable[int]:
        """The step the next delta is coded against, kept even when hidden."""
        return [self._reference.step] if self._reference else []

    def close(self) -> GcReport:
        """Free what deferred removals and this writer's reference held, and release the
        writer lease so another job may write the run; reading needs none."""
        report = GcReport()
        if self.lease.held:
            former, self._reference = self._reference, None
            if self._deferred or (former is not None and self.chain.is_hidden(former.step)):
                self._deferred.clear()
                self._plain = None
                report = self.chain.collect(settings=self.settings,
                                            keyframe_every=self.keyframe_every, later=former)
        self.lease.release()
        return report

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify(self, step: int | None = None) -> list[Problem]:
        """Hash-check ``step`` (or every visible step); an empty list means all is well."""
        return self.chain.verify(step)
