"""Folder checkpoints saved into one chain: what ``tpde.hf`` does for the ``Trainer``'s
``checkpoint-N/`` folders and Accelerate's ``save_state`` folders alike, once the framework has
handed over a folder's weights and optimizer state (``entries.folder_checkpoint`` has the
step's layout).

A save copies the state in the training thread and codes and writes it in the background
(``plugins/worker.py``, as the Lightning plugin does); the folder's entry is pending until the
step commits. The framework's rotation deletes folders; the steps only those folders named are
hidden and freed before the next step is written, so that a re-base they need writes while the
new step's bytes are not there yet. Files unchanged since the previous checkpoint become hard
links to it, and each folder keeps the modification time the framework left it with
(``hf_folders``).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Any, Iterator

from tpde.api import Checkpointer, snapshot
from tpde.chain import Chain, SaveOptions
from tpde.entries import checkpoint_folder
from tpde.entries import entry as entries
from tpde.errors import TPDEError
from tpde.plugins import hf_folders, pending, writers
from tpde.plugins.ledger import Ledger, SaveReport
from tpde.plugins.worker import Worker, finish_at_exit
from tpde.state import tree


def options_of(options: dict[str, Any], who: str) -> SaveOptions:
    """The save settings of a folder-checkpoint front end: ``Checkpointer``'s, less the error
    bound (a resumed run must continue bit for bit)."""
    opts = SaveOptions.of(options, who)
    if opts.bounds is not None:
        raise TPDEError(f"{who} does not take error_bound: a resumed run must continue bit "
                        "for bit; use tpde.Checkpointer for a lossy chain")
    return opts


def entry_at(checkpoint: str | None, storage_options: dict[str, Any] | None = None
             ) -> tuple[Chain, int] | None:
    """The chain and step of the checkpoint folder ``checkpoint``'s entry (None: it has
    none). A save of it still under way in this process is waited for."""
    if checkpoint is None:
        return None
    path = os.path.join(str(checkpoint), entries.FOLDER_ENTRY)
    if not os.path.isfile(path):
        return None
    found = entries.read(path)
    if found is None:
        return None
    chain = entries.chain_for(path, found, storage_options)
    entries.check(chain, found.step, found.blob, path)
    return chain, found.step


def read(at: tuple[Chain, int], within: str | None = None) -> Any:
    """The state of step ``at`` (``within``: that part alone, None where it has none)."""
    chain, step = at
    if within is not None and within not in tree.keys(chain.manifest(step).skeleton):
        return None
    return chain.load(step, map_location="cpu", keep_words=False, within=within)[0]


class FolderSaves:
    """The checkpoint folders under ``output_dir`` and the chain that holds their tensors.

    Args:
        output_dir: the folder whose checkpoint folders (at any depth) name the chain's steps.
        chain: the chain's URL (any fsspec URL).
        storage_options: fsspec's options for the chain's store.
        async_save: code and write in a background thread.
        max_pending: saves that may wait behind the running one before training waits.
        link_unchanged: hard-link files unchanged since the previous checkpoint (the one
            of the highest step below, among the folders ``pattern`` names).
        pattern: the framework's checkpoint folder names, their step the group.
        options: the save settings (``SaveOptions``); an error bound is refused.
        who: the front end, as messages name it.
    """

    def __init__(self, output_dir: str, chain: str, storage_options: dict[str, Any] | None,
                 *, async_save: bool, max_pending: int, link_unchanged: bool,
                 options: dict[str, Any], who: str,
                 pattern: re.Pattern[str] = hf_folders.CHECKPOINT) -> None:
        if max_pending < 0:
            raise ValueError("max_pending must be >= 0")
        self.options = options_of(options, who)
        self.output_dir = os.path.abspath(output_dir)
        self.chain_url = chain
        self.storage_options = dict(storage_options or {})
        self.async_save = async_save
        self.link_unchanged = link_unchanged
        self.pattern = pattern
        self.ledger = Ledger()
        self._room = threading.Semaphore(max_pending + 1)
        self._worker = Worker("tpde-folders")
        self._seen: checkpoint_folder.Seen = {}
        # Held while the framework writes and rotates checkpoint folders (``writing``), and
        # while a background save writes into one: no folder is written into as it is deleted.
        self._folders = threading.Lock()
        self._used = False
        finish_at_exit(self, FolderSaves.close)

    @property
    def reports(self) -> list[SaveReport]:
        return self.ledger.reports

    def wait(self) -> None:
        self._worker.wait()

    def raise_deferred(self) -> None:
        self._worker.raise_deferred()

    def close(self) -> None:
        """Wait for every save, free what removed checkpoints still hold and give up the
        writer lease."""
        try:
            self.wait()
            if self._used:  # folders deleted since the last save (the end of training's)
                run = self.run_for()
                with run.lock:
                    self._collect(run.ckpt)
        finally:
            if self._used:
                self.ledger.freed_bytes += writers.release(self.chain_url, self).freed_bytes
                self._used = False

    def run_for(self) -> writers.Run:
        """This process's writer of the chain, used until ``close``."""
        self._used = True
        return writers.acquire(self.chain_url, self, self.storage_options, self.options.given())

    def relative_chain(self, folder: str) -> str:
        """The chain as an entry in ``folder`` names it: relative where it is on this disk."""
        if entries.is_local(self.chain_url):
            return os.path.relpath(os.path.abspath(self.chain_url.removeprefix("file://")),
                                   os.path.abspath(folder))
        return self.chain_url

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around the framework's own writes and rotations of checkpoint folders."""
        with self._folders:
            yield

    # ------------------------------------------------------------------ saving
    def save(self, folder: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save ``state`` (``folder_checkpoint.state_of``'s) as the step of the checkpoint
        folder ``folder``, which the framework has finished writing; ``meta`` goes into its
        entry."""
        path = os.path.join(folder, entries.FOLDER_ENTRY)
        started = time.perf_counter()
        self._room.acquire()
        try:
            snap = snapshot(state) if self.async_save else state
            times = hf_folders.Times(folder)
        except BaseException:
            self._room.release()
            raise
        entries.PENDING.begin(path)  # readers in this process wait for the save from here
        stall = (time.perf_counter() - started) * 1e3

        def job(run: bool) -> None:
            announced, done = None, False
            try:
                if run:
                    with self._folders, _unless_deleted(folder):
                        if not os.path.isdir(folder):
                            return  # rotated away while this save waited
                        announced = pending.announce(path, {}, self.relative_chain(folder),
                                                     self.chain_url, begin=False)
                        before = hf_folders.previous(folder, self.pattern) if self.link_unchanged \
                            else None
                        if before is not None:
                            hf_folders.link_unchanged(folder, before)
                        times.restore()
                    self._write(snap, folder, path, meta, stall, times)
                    done = True
            finally:
                try:
                    with self._folders, _unless_deleted(folder):
                        if os.path.isdir(folder):
                            if announced is not None and not done:
                                pending.withdraw(path, {}, announced)
                            times.restore()
                finally:
                    entries.PENDING.end(path)
                    self._room.release()

        if self.async_save:
            self._worker.submit(job, f"save of {path}")
        else:
            job(True)

    def _write(self, snap: Any, folder: str, path: str, meta: dict[str, Any],
               stall_ms: float, times: hf_folders.Times) -> None:
        started = time.perf_counter()
        run = self.run_for()
        with run.lock:
            if not os.path.isdir(folder):  # rotated away while this save waited
                return
            # Steps whose folders rotation deleted go first: a re-base they need then writes
            # before this step's bytes are there, as the framework's own peak has room for.
            self._collect(run.ckpt)
            if run.next is None:
                run.next = run.ckpt.next_step()
            info = run.ckpt.save(run.next, snap)
            run.next = info.step + 1
            published = False
            with self._folders, _unless_deleted(folder):
                if os.path.isdir(folder):
                    pending.publish(path, {}, entries.CheckpointEntry(
                        run=self.relative_chain(folder), run_url=run.ckpt.chain.url,
                        step=info.step, blob=run.ckpt.chain.manifest(info.step).id or "",
                        raw_bytes=info.raw_bytes, stored_bytes=info.stored_bytes, meta=meta))
                    published = True
                    times.restore()
            if published:
                self.ledger.saved(path, os.path.basename(folder), info, stall_ms,
                                  time.perf_counter() - started)
            if not self._collect(run.ckpt) and info.run_bytes is not None:
                self.ledger.at_rest(run.ckpt.chain, info.run_bytes, added=info.raw_bytes)

    def _collect(self, ckpt: Checkpointer) -> bool:
        """Hide the steps no checkpoint folder names any more (the framework's rotation
        deleted theirs); their bytes go before the run could hold more than the framework's
        own files would (``Checkpointer.remove``'s ``defer``). Whether any was hidden."""
        hidden = checkpoint_folder.orphans(ckpt.chain, self.output_dir, {}, self._seen)
        if not hidden:
            return False
        self.ledger.collected("rotated checkpoints", hidden, ckpt.remove(*hidden, defer=True))
        self.ledger.at_rest(ckpt.chain, ckpt.chain.at_rest().total)
        return True

    # ------------------------------------------------------------------ loading
    def entry_at(self, checkpoint: str | None) -> tuple[Chain, int] | None:
        """``entry_at`` with this run's storage options."""
        return entry_at(checkpoint, self.storage_options)

    def load(self, at: tuple[Chain, int], resuming: bool, within: str | None = None) -> Any:
        """The state of step ``at`` (``within``: that part alone, None where it has none);
        ``resuming`` (this process saves next): the whole state, read by this process's writer
        where it is this chain, so that the next save is a delta against it."""
        chain, step = at
        if resuming and within is None \
                and entries.normalize(chain.url) == entries.normalize(self.chain_url):
            run = self.run_for()
            with run.lock:
                return run.ckpt.load(step, "cpu")
        return read(at, within)


@contextlib.contextmanager
def _unless_deleted(folder: str) -> Iterator[None]:
    """A framework may delete a checkpoint folder outside the writes ``writing`` guards (the
    ``Trainer`` deletes the last one at the end of training when ``save_total_limit`` is 1):
    what fails because the folder is gone is no error. Its step, saved or not, is named by no
    folder, and the next collection frees it."""
    try:
        yield
    except (OSError, TPDEError):
        if os.path.isdir(folder):
            raise
