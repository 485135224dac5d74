"""``TPDECheckpointIO``: Lightning's checkpoint I/O, writing into a tpde chain beside the files.

Every checkpoint path gets a small entry (see ``tpde.entries.entry``) in place of the checkpoint file,
and the chain it names lives in ``<dirpath>/.tpde``, so ``ModelCheckpoint`` keeps doing what
it does with files: existence checks, ``last*.ckpt`` listing, modification times, top-k
removal. While a ``Trainer`` is fitting, a save snapshots the state and writes a pending entry
at once; the plugin's background worker (``tpde.plugins.worker``) encodes, uploads and
commits saves and removals in the order they were asked for, and makes each entry final.
Plugins of one process share one writer per folder (``tpde.plugins.writers``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from tpde.api import Checkpointer, Snapshot, StepInfo, snapshot
from tpde.chain import SaveOptions
from tpde.entries import checkpoint_folder
from tpde.entries import entry as entries
from tpde.errors import TPDEError
from tpde.plugins import pending, trainer_state, writers
from tpde.plugins.ledger import Ledger, SaveReport
from tpde.plugins.worker import Job, Worker, finish_at_exit
from tpde.runtime import frame_threads

log = logging.getLogger("tpde.lightning")


#: The stock plugin of each Lightning installed: ``lightning`` and ``pytorch_lightning`` each
#: carry a copy. The first is the base class, the others have it registered.
_BASES = trainer_state.import_all(("lightning.fabric.plugins", "lightning_fabric.plugins"),
                     "TorchCheckpointIO")
if not _BASES:
    raise ImportError("TPDECheckpointIO needs Lightning: pip install 'tpde[lightning]'")


class TPDECheckpointIO(_BASES[0]):  # type: ignore[misc, valid-type]
    """Lightning ``CheckpointIO`` storing checkpoints as a tpde chain; a drop-in for the default.

    ``Trainer(plugins=[TPDECheckpointIO()])`` and nothing else changes: ``ModelCheckpoint``
    (top-k, ``save_last`` including ``"link"``), ``trainer.save_checkpoint`` and
    ``fit(ckpt_path="last" | "best" | path)`` work locally and on any fsspec store.

    It is a ``TorchCheckpointIO``, as code that checks for the default expects: it loads every
    file the stock plugin writes, and each entry it writes is a ``torch.save`` archive. It
    overrides all three of its methods; nothing is written through the stock one.

    ``async_save`` (default): ``save_checkpoint`` returns once the state is copied
    (``device="cpu"``: to host memory; ``"cuda"``: on the GPU, encoded there); at most
    ``max_pending`` saves wait behind the running one, after which the training thread waits.
    ``teardown()`` waits for everything and raises a deferred error; the plugin stays usable.
    ``async_save=False`` saves in ``save_checkpoint`` from the checkpoint itself, with no copy:
    with ``reference="store"`` (see ``Checkpointer``) a save then needs memory bounded by
    ``max_inflight_bytes``, not by the state.

    Args:
        device: where a save's snapshot is kept and coded: ``"cpu"`` or ``"cuda"``.
        storage_options: fsspec's options for the checkpoint folder's store.
        async_save: save in a background thread while training goes on.
        max_pending: saves that may wait behind the running one before training waits.
        chain_dir: the chain's folder inside the checkpoint folder.
        **options: the save settings, ``Checkpointer``'s (``SaveOptions`` lists them).

    Example:
        >>> trainer = L.Trainer(plugins=[tpde.TPDECheckpointIO(keyframe_every=8)])

    ``error_bound`` (opt-in, lossy) is ``Checkpointer``'s: e.g. ``{"state_dict/*":
    tpde.Rel(1e-3)}`` keeps every weight within 0.1% of its saved value; a pattern that matches
    no tensor fails at the first ``save_checkpoint``, on the training thread.

    ``deltas_against="keyframe"`` is ``Checkpointer``'s: every checkpoint, ``last`` included,
    restores by decoding at most one delta of each tensor, for a few percent more bytes on
    fp32 state.
    """

    def __init__(self, *, device: str = "cpu", storage_options: dict[str, Any] | None = None,
                 async_save: bool = True, max_pending: int = 1,
                 chain_dir: str = entries.CHAIN_DIR, **options: Any) -> None:
        super().__init__()
        if max_pending < 0:
            raise ValueError("max_pending must be >= 0")
        # Checked here, not first in the background worker.
        self.options = SaveOptions.of(options, "TPDECheckpointIO")
        self.bounds = self.options.bounds
        self.device = device
        self.storage_options = dict(storage_options or {})
        self.async_save = async_save
        self.chain_dir = chain_dir
        self.ledger = Ledger()
        self.max_pending = max_pending
        self._start()

    def _start(self) -> None:
        self._used: set[str] = set()  # the runs (``writers``) this plugin writes
        self._room = threading.Semaphore(self.max_pending + 1)
        self._worker = Worker("tpde-lightning")
        self._seen: checkpoint_folder.Seen = {}
        # A plugin dropped without a teardown no longer keeps its runs (and their reference
        # words) in memory; its lease lapses as a dead writer's does.
        weakref.finalize(self, writers.forget, self._used)
        self._asked = 0  # saves and removals asked for, in order
        self._removed: dict[str, int] = {}  # path -> when it was last removed (of _asked)
        finish_at_exit(self, TPDECheckpointIO.wait)

    # ------------------------------------------------------------------ the contract
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and write a pending entry at ``path``; the step is encoded
        and committed in the background, then the entry becomes final.

        The path exists when this returns, as a plain checkpoint file would: Lightning's
        callbacks look for it at once. Readers in this process wait for the save; readers
        elsewhere read what the path held before (``entry.PendingEntry``)."""
        self._worker.raise_deferred()
        path = str(path)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options of save_checkpoint({path!r}) are fsspec options, "
                            f"a dict (got {type(storage_options).__name__}); or leave them "
                            "out to use the plugin's own")
        options = {**self.storage_options, **(storage_options or {})}
        started = time.perf_counter()
        self._room.acquire()
        try:
            # A synchronous save reads the checkpoint before training goes on: no copy needed.
            background = self.async_save and trainer_state.fitting()
            snap = snapshot(checkpoint, device=self.device) if background else checkpoint
            if self.bounds is not None and isinstance(snap, Snapshot):
                # A pattern that matches nothing fails on the training thread, not later.
                self.bounds.check(n for span in snap.flat.spans for n in span.names)
            announced = pending.announce(path, options, self.chain_dir, self.chain_url(
                entries.split(path)[0])) if background else None
        except BaseException:
            self._room.release()
            raise
        meta = {k: checkpoint[k] for k in ("epoch", "global_step")
                if type(checkpoint.get(k)) is int}
        stall = (time.perf_counter() - started) * 1e3
        asked = self._asked = self._asked + 1

        def job(run: bool) -> None:
            done = False
            try:
                if run:
                    self._write(snap, path, options, meta, stall, asked)
                    done = True
            finally:
                if background:
                    if announced is not None and not done:
                        pending.withdraw(path, options, announced)
                    entries.PENDING.end(path)
                self._room.release()

        self._run(job, f"save of {path}", background)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self.wait()
        path = str(path)
        try:
            chain, step, _ = entries.resolve(path, self.storage_options)
        except FileNotFoundError as exc:
            if isinstance(exc, TPDEError):
                raise
            raise FileNotFoundError(f"Checkpoint file not found: {path}") from exc
        if step is None:  # not an entry: a plain checkpoint, or nothing
            from lightning.fabric.utilities.cloud_io import _load

            at, name = entries.store_at(path, self.storage_options)
            if not at.exists(name):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            return _load(path, map_location=map_location, weights_only=weights_only)
        # Lightning's default (a torch-style callable) keeps tensors on the CPU, as this does.
        location = map_location if isinstance(map_location, (str, dict, torch.device)) else "cpu"
        trusted = weights_only is False
        here = self.chain_url(entries.split(path)[0])
        if trainer_state.rank() == 0 and entries.normalize(chain.url) == entries.normalize(here):
            # The writer resumes here: its next save is a delta against this step.
            run = self.run_for(here)
            with run.lock:
                return run.ckpt.load(step, location, trusted=trusted)
        state, _ = chain.load(step, map_location=location, trusted=trusted,
                              keep_words=False)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the file at ``path`` now, as Lightning's own plugin does; what its step
        holds in the chain is freed in the background, after the saves queued before."""
        self._worker.raise_deferred()
        path = str(path)
        self._asked += 1
        self._removed[entries.normalize(path)] = self._asked
        at, name = entries.store_at(path, self.storage_options)
        if entries.is_local(path) and os.path.islink(local := os.path.join(*entries.split(path))):
            os.unlink(local)  # save_last="link": the link goes, what it points to stays
            return
        kind = at.kind(name)
        if kind is None:
            return
        if kind == "directory":
            log.warning("tpde: %s is a folder, not a tpde entry: a sharded strategy wrote it "
                        "with torch.distributed.checkpoint without calling CheckpointIO, so "
                        "tpde stored nothing for it (use tpde.TPDEModelParallelStrategy or "
                        "tpde.TPDEFSDPStrategy); removing it as Lightning would", path)
            at.delete_tree(name)
            return
        try:
            found = entries.read_any(path, self.storage_options)
        except TPDEError:  # damaged: Lightning removes it; orphans are found by listing
            found = None
        at.delete(name)
        if found is None:
            return  # a plain checkpoint from before the run switched to tpde
        folder, name = entries.split(path)
        url = self.chain_url(folder)

        def job(run: bool) -> None:
            if run:
                run_ = self.run_for(url)
                with run_.lock:
                    if run_.ckpt.chain.is_run():
                        self._collect(run_.ckpt, folder, name)

        self._run(job, f"removal of {path}", self.async_save and trainer_state.fitting())

    def teardown(self) -> None:
        """Wait for every queued save and removal, raise a deferred error, free what removed
        checkpoints still hold, and give up the lease: a finished ``Trainer`` leaves no
        thread, no copy of its state and no writer behind. tpde's coding threads end too,
        whoever started them: the next save, restore or mount starts them again. The plugin
        stays usable."""
        try:
            self.wait()
        finally:
            for url in sorted(self._used):
                self.ledger.freed_bytes += writers.release(url, self).freed_bytes
            self._used.clear()
            frame_threads.stop()

    # ------------------------------------------------------------------ extras
    def wait(self) -> None:
        """Block until queued saves and removals are done; raise the first that failed."""
        self._worker.wait()

    @property
    def reports(self) -> list[SaveReport]:
        """Every save's report, in the order they were committed."""
        return self.ledger.reports

    @property
    def freed_bytes(self) -> int:
        """The bytes this plugin's removals and teardowns freed."""
        return self.ledger.freed_bytes

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.reports)

    # ------------------------------------------------------------------ the worker side
    def chain_url(self, folder: str) -> str:
        """The URL of the chain of the checkpoint folder ``folder``."""
        return f"{folder}/{self.chain_dir}"

    def run_for(self, url: str) -> "writers.Run":
        """The process's writer of the chain at ``url`` (shared by its plugins), which this
        plugin now uses and lets go of at ``teardown``."""
        self._used.add(url)
        return writers.acquire(url, self, self.storage_options, self.options.given())

    def _write(self, snap: Snapshot | dict[str, Any], path: str, options: dict[str, Any],
               meta: dict[str, Any], stall_ms: float, asked: int) -> None:
        started = time.perf_counter()
        run = self.run_for(self.chain_url(entries.split(path)[0]))
        with run.lock:
            if run.next is None:
                run.next = run.ckpt.next_step()
            info = run.ckpt.save(run.next, snap)
            run.next = info.step + 1
            if self._removed.get(entries.normalize(path), 0) > asked:
                # removed after this save was asked for: its step is named by nothing
                self._collect(run.ckpt, *entries.split(path))
                return
            self._publish(path, options, run.ckpt, info, meta, stall_ms, started)

    def _publish(self, path: str, options: dict[str, Any], ckpt: Checkpointer, info: StepInfo,
                 meta: dict[str, Any], stall_ms: float, started: float) -> None:
        """Write the entry naming a committed step at ``path``; free what an entry it
        replaces named."""
        folder, name = entries.split(path)
        step = info.step
        replaced = pending.publish(path, options, entries.CheckpointEntry(
            run=self.chain_dir, run_url=ckpt.chain.url, step=step,
            blob=ckpt.chain.manifest(step).id, raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes, meta=meta))
        self.ledger.saved(path, name, info, stall_ms, time.perf_counter() - started)
        if replaced is not None:  # save_last: the step the old entry named may now be free
            self._collect(ckpt, folder, name)
        elif info.run_bytes is not None:
            self.ledger.at_rest(ckpt.chain, info.run_bytes, added=info.raw_bytes)

    def _collect(self, ckpt: Checkpointer, folder: str, name: str) -> None:
        """Hide the steps no entry names any more; their bytes go before the run could hold
        more than ``TorchCheckpointIO`` would, or at teardown (``Checkpointer.remove``'s
        ``defer``): many of a top-k run's removals then cost no re-base."""
        hidden = checkpoint_folder.orphans(ckpt.chain, folder, self.storage_options, self._seen)
        self.ledger.collected(name, hidden, ckpt.remove(*hidden, defer=True))
        self.ledger.at_rest(ckpt.chain, ckpt.chain.at_rest().total)

    def _run(self, job: Job, what: str, background: bool) -> None:
        """Queue ``job`` for the worker, or run it now."""
        if background:
            self._worker.submit(job, what)
        else:
            job(True)

    def __getstate__(self) -> dict[str, Any]:
        """Every setting (for spawned processes); queue, worker and open chains start afresh."""
        self.wait()
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()


for _other in _BASES[1:]:
    _other.register(TPDECheckpointIO)  # type: ignore[attr-defined]
