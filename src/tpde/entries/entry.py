"""Checkpoint entries: the small file at a checkpoint path that names one step of a chain.

Frameworks that own the file layout (Lightning's ``ModelCheckpoint``) expect a file at every
checkpoint path: they check that it exists, list and sort files by modification time, delete
them. An entry is that file; the chain it points into lives in a hidden folder beside it.

An entry is a valid ``torch.save`` archive whose only object is the call
``tpde.load_checkpoint(run, step, blob)``, so ``torch.load(path, weights_only=False)`` (and
``LightningModule.load_from_checkpoint(path, weights_only=False)``) return the full checkpoint,
while weights-only loading refuses it with torch's error naming ``tpde.load_checkpoint``. A JSON
member carries the same facts for readers that never unpickle. Entries are the roots of their
chain: a step no entry names is an orphan, hidden and freed once nothing needs it.

What a user names as a run may be any of these (``resolve``); ``load_checkpoint`` and
``load_state_dict`` (a model's weights alone, the dense counterpart of ``tpde.mount``) read
from it.
"""

from __future__ import annotations

import io
import json
import lzma
import os
import posixpath
import socket
import threading
import time
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tpde.chain import MARKER, Chain
from tpde.errors import (FormatError, NotARunError, StepNotFoundError, StepPendingError,
                         StoreError, TPDEError)
from tpde.state import keys, tree
from tpde.store import store

MEMBER = "archive/tpde-entry.json"
#: Entries are about a kilobyte; anything larger at a checkpoint path is a plain checkpoint.
MAX_ENTRY_BYTES = 64 * 1024
#: Where a chain lives relative to the entries that point into it.
CHAIN_DIR = ".tpde"
#: The entry of a checkpoint that is a folder (a Hugging Face ``checkpoint-N/``): its chain
#: is the checkpoint folder's parent's ``CHAIN_DIR`` (``run`` is ``../.tpde``), or elsewhere.
FOLDER_ENTRY = "checkpoint.tpde"


@dataclass(frozen=True)
class CheckpointEntry:
    """What an entry says: which step of which chain, and what saving it cost."""

    run: str  # the chain, relative to the entry's folder (or a URL: a chain elsewhere)
    run_url: str  # the chain where it was written, for copies of the entry moved elsewhere
    step: int
    blob: str  # the step's first blob name (``Manifest.id``): a reused step number never matches
    raw_bytes: int = 0
    stored_bytes: int = 0
    created: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingEntry:
    """An entry written when a save was asked for, before its step commits (version 2).

    It makes the path exist at once, as a plain checkpoint file would, and keeps the entry it
    replaced (``previous``): until the writer puts the final entry there, readers in the
    writer's process wait for it (``PENDING``), and readers elsewhere get ``previous``, which
    is what the path held before the save, as after an interrupted plain save."""

    run: str
    run_url: str
    writer: str  # host:pid of the process whose save this is
    token: str  # tells this pending save from another one of the same path
    previous: CheckpointEntry | None
    created: float = field(default_factory=time.time)


class _Call:
    """Pickles as ``tpde.load_checkpoint(run_url, step, blob)``."""

    def __init__(self, entry: CheckpointEntry) -> None:
        self.args = (entry.run_url, entry.step, entry.blob)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return load_checkpoint, self.args


class _Awaited:
    """Pickles as ``tpde.load_checkpoint(run_url, PENDING_STEP, token)``: it names no step, so
    loading it says that the save has not committed yet."""

    def __init__(self, entry: PendingEntry) -> None:
        self.args = (entry.run_url, PENDING_STEP, entry.token)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return load_checkpoint, self.args


#: The step a pending entry without a previous one pickles: no step has it.
PENDING_STEP = -1


def _archive(call: Any, doc: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(call, buf)
    with zipfile.ZipFile(buf, "a") as z:
        z.writestr(MEMBER, json.dumps({"format": "tpde-entry", **doc}))
    return buf.getvalue()


def to_bytes(entry: CheckpointEntry | PendingEntry) -> bytes:
    if isinstance(entry, PendingEntry):
        doc = asdict(entry)
        call = _Call(entry.previous) if entry.previous is not None else _Awaited(entry)
        return _archive(call, {"version": 2, "pending": True, **doc})
    return _archive(_Call(entry), {"version": 1, **asdict(entry)})


def this_writer() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def parse_any(data: bytes, where: str = "") -> CheckpointEntry | PendingEntry | None:
    """The entry in ``data`` as written, or None when ``data`` is not an entry."""
    if len(data) > MAX_ENTRY_BYTES or not data.startswith(b"PK\x03\x04"):
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if MEMBER not in z.namelist():
                return None
            doc = json.loads(z.read(MEMBER))
    # What zipfile raises for damaged archives: a mutated header may also name a compression
    # method or version it lacks, or an encryption flag.
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError,
            RuntimeError, zlib.error, lzma.LZMAError) as exc:
        where_from = where.rsplit("/", 1)[0] if "/" in where else "FOLDER"
        raise FormatError(f"checkpoint entry {where} is damaged ({exc}); its step is still in "
                          f"the chain: `tpde repair {where_from}` writes the entry again "
                          f"(`tpde ls {where_from}` shows the step it names)") from None
    try:
        if doc.pop("format") != "tpde-entry":
            raise ValueError("unknown format")
        version = doc.pop("version")
        if version == 2 and doc.pop("pending") is True:
            previous = doc.pop("previous")
            entry: CheckpointEntry | PendingEntry = PendingEntry(
                **doc, previous=None if previous is None else _final(previous))
            if not isinstance(entry.token, str):
                raise ValueError("token has the wrong type")
            return entry
        if version != 1:
            raise ValueError(f"unknown version {version}")
        return _final(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"checkpoint entry {where} is malformed ({exc})") from None


def _final(doc: dict[str, Any]) -> CheckpointEntry:
    entry = CheckpointEntry(**doc)
    if type(entry.step) is not int or not isinstance(entry.blob, str):
        raise ValueError("step or blob has the wrong type")
    return entry


def parse(data: bytes, where: str = "") -> CheckpointEntry | None:
    """The committed entry in ``data``, or None when ``data`` is not an entry (a plain
    checkpoint). A pending entry gives the entry it replaced; with none, it raises
    ``StepPendingError``: the path's first save has not committed."""
    entry = parse_any(data, where)
    return _committed(entry, where) if isinstance(entry, PendingEntry) else entry


class Pending:
    """The saves of this process whose entries are still pending, by path: a reader here
    waits for them, so a path saved in this process reads as saved once the call returns."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._count: dict[str, int] = {}

    def begin(self, path: str) -> None:
        with self._lock:
            key = normalize(path)
            self._count[key] = self._count.get(key, 0) + 1

    def end(self, path: str) -> None:
        with self._lock:
            key = normalize(path)
            self._count[key] -= 1
            if not self._count[key]:
                del self._count[key]
                self._lock.notify_all()

    def wait(self, path: str) -> None:
        with self._lock:
            key = normalize(path)
            self._lock.wait_for(lambda: key not in self._count)


PENDING = Pending()


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def split(path: str) -> tuple[str, str]:
    """(folder, name) of a checkpoint path; local folders absolute (a link stays a link)."""
    path = str(path)
    if is_local(path):
        path = os.path.abspath(path.removeprefix("file://"))
        return os.path.dirname(path), os.path.basename(path)
    head, _, name = path.rpartition("/")
    return head, name


def store_at(path: str, storage_options: dict[str, Any] | None) -> tuple[store.Store, str]:
    """The store of the folder that holds ``path``, and the name of ``path`` in it: every
    byte of an entry is read and written through a ``Store``, with its retries and
    deadlines."""
    folder, name = split(path)
    return store.Store(folder, storage_options), name


def read(path: str, storage_options: dict[str, Any] | None = None, *,
         wait: bool = True) -> CheckpointEntry | None:
    """The entry at ``path``, or None when the file there is not one. A missing file raises.

    A save of ``path`` still under way in this process is waited for (``wait=False``: the
    entry it replaces is read instead, as from another process)."""
    if wait:
        PENDING.wait(path)
    found = read_any(path, storage_options)
    return _committed(found, str(path)) if isinstance(found, PendingEntry) else found


def read_any(path: str, storage_options: dict[str, Any] | None = None
             ) -> CheckpointEntry | PendingEntry | None:
    """The entry at ``path`` as written (pending or final), or None when it is no entry."""
    at, name = store_at(path, storage_options)
    if at.size(name) > MAX_ENTRY_BYTES:
        return None
    return parse_any(bytes(at.read(name)), where=str(path))


def replaced(path: str, storage_options: dict[str, Any] | None = None
             ) -> tuple[CheckpointEntry | None, bool]:
    """What a save of ``path`` replaces: the committed entry there (a pending entry's
    previous one), and whether the file there is a plain checkpoint, not an entry. Nothing
    there, or a damaged entry: ``(None, False)``; a writer replaces it."""
    try:
        found = read_any(path, storage_options)
    except (FileNotFoundError, NotADirectoryError, TPDEError):
        return None, False
    if found is None:
        return None, True
    return (found.previous if isinstance(found, PendingEntry) else found), False


def _committed(entry: PendingEntry, where: str) -> CheckpointEntry:
    if entry.previous is None:
        raise StepPendingError(
            f"the checkpoint at {where} is still being saved by {entry.writer}, or that save "
            "was interrupted before it committed; wait for the save, or load another "
            "checkpoint of the run (tpde ls on its folder lists them)", run=entry.run_url)
    return entry.previous


def folder(path: str) -> str:
    """The folder an entry's relative chain is resolved in (a symlink's target's, on disk)."""
    path = str(path)
    if "://" not in path or path.startswith("file://"):
        return os.path.dirname(os.path.realpath(path.removeprefix("file://")))
    return path.rsplit("/", 1)[0]


def beside(path: str, entry: CheckpointEntry | PendingEntry) -> str:
    """Where the chain of ``entry``, read at ``path``, is: its ``run`` in the entry's folder,
    or the URL its ``run`` is."""
    if "://" in entry.run:
        return entry.run
    scheme, sep, rest = f"{folder(path)}/{entry.run}".rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(rest)}"  # a folder's ``../.tpde``, spelled out


def chain_for(path: str, entry: CheckpointEntry,
              storage_options: dict[str, Any] | None = None) -> Chain:
    """The chain ``entry`` (read at ``path``) points into: beside it, else where it was made."""
    for url in (beside(path, entry), entry.run_url):
        chain = Chain(url, storage_options)
        if chain.is_run():
            return chain
    raise NotARunError(f"the checkpoint entry {path} points to a chain that is gone (looked "
                       f"beside it in {entry.run}/ and at {entry.run_url})", run=entry.run_url,
                       step=entry.step)


def check(chain: Chain, step: int, blob: str | None, where: str) -> None:
    """Refuse an entry whose step was deleted, even if the number was reused since."""
    try:
        actual = chain.manifest(step).id
    except StepNotFoundError:
        actual = None
    if blob is not None and actual != blob:
        raise StepNotFoundError(f"the step that {where} points to was deleted (removed and "
                                "collected); this entry is stale", run=chain.url, step=step)


def load_checkpoint(path: str, step: int | None = None, blob: str | None = None, *,
                    map_location: tree.MapLocation = None,
                    storage_options: dict[str, Any] | None = None, trusted: bool = False) -> Any:
    """The plain checkpoint dict behind ``path``.

    ``path`` is a checkpoint entry (what ``TPDECheckpointIO`` writes at each checkpoint path),
    a tpde run (then ``step``, default the latest), or a plain ``torch.save`` file. Loading never
    unpickles arbitrary objects unless ``trusted=True``.

    Args:
        path: an entry, a run or a plain checkpoint file (path or URL).
        step: a run's step; None is the entry's step, or the run's latest.
        blob: the blob an entry names its step by (checked against the step's).
        map_location: as ``torch.load``'s.
        storage_options: fsspec's options for the store.
        trusted: unpickle stored Python objects that torch's weights-only loader refuses.

    Returns:
        The checkpoint, as ``torch.load`` of the plain file would give it.

    Example:
        >>> ckpt = tpde.load_checkpoint("ckpts/last.ckpt")
        >>> model.load_state_dict(ckpt["state_dict"])
    """
    path = str(path)
    if step is None:
        chain, step, _ = resolve(path, storage_options)
        at, name = store_at(path, storage_options)
        if step is None and not chain.is_run() and at.kind(name) == "file":
            with at.open_read(name) as f:  # a plain checkpoint
                try:
                    return torch.load(f, map_location=map_location, weights_only=not trusted)
                except Exception as exc:  # UnpicklingError, RuntimeError, EOFError, ...
                    raise tree.load_error(
                        exc, f"tpde.load_checkpoint({path!r})", trusted,
                        "neither a tpde checkpoint entry nor a file torch.load can read; if "
                        "TPDECheckpointIO wrote it, the entry is damaged: load another "
                        "checkpoint of the run (tpde ls on its folder lists them)") from None
        step = step if step is not None else chain.latest()
    elif step == PENDING_STEP:
        raise StepPendingError("this checkpoint entry was written when its save began, and "
                               "the save had not committed; load the file again once it has, "
                               "or another checkpoint of the run", run=path)
    else:
        chain = Chain(path, storage_options)
        check(chain, step, blob, f"tpde.load_checkpoint({path!r}, {step})")
    state, _ = chain.load(step, map_location=map_location, trusted=trusted, keep_words=False)
    return state


# Entries pickle the call under the name users know, so torch's weights-only refusal names it.
load_checkpoint.__module__ = "tpde"


def normalize(url: str) -> str:
    """One spelling per location, so chains found by different routes compare equal."""
    url = str(url).rstrip("/")
    if "://" not in url or url.startswith("file://"):
        return os.path.realpath(url.removeprefix("file://"))
    return url


def same_chain(path: str, entry: CheckpointEntry | PendingEntry, chain: Chain) -> bool:
    return normalize(beside(path, entry)) == normalize(chain.url)


def is_entry_folder(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a folder of checkpoint entries with a chain beside them."""
    return Chain(f"{str(url).rstrip('/')}/{CHAIN_DIR}", storage_options).store.exists(MARKER)


def holds_folder_entry(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is a checkpoint that is a folder: ``FOLDER_ENTRY`` in it."""
    chain = Chain(str(url).rstrip("/"), storage_options)
    return chain.store.kind("") == "directory" and chain.store.exists(FOLDER_ENTRY)


def resolve(target: str, storage_options: dict[str, Any] | None = None
            ) -> tuple[Chain, int | None, str | None]:
    """What a user may name as a run: a chain, a folder of checkpoints, one entry, or one
    checkpoint that is a folder (``FOLDER_ENTRY`` in it: then its entry).

    Returns the chain, the entry's step (None unless ``target`` is an entry) and the checkpoint
    folder whose entries are the chain's roots (None unless ``target`` is such a folder).
    """
    target = str(target).rstrip("/")
    try:
        folder = is_entry_folder(target, storage_options)
    except StoreError as exc:  # the first request: name what the user typed, not .tpde
        if not store.cannot_connect(exc.__cause__):
            raise
        raise store.unreachable(target, exc.__cause__) from exc.__cause__
    if folder:
        return Chain(f"{target}/{CHAIN_DIR}", storage_options), None, target
    chain = Chain(target, storage_options)
    kind = None if chain.is_run() else chain.store.kind("")
    if kind == "directory" and chain.store.exists(FOLDER_ENTRY):  # a checkpoint that is a folder
        target, kind = f"{target}/{FOLDER_ENTRY}", "file"
    if kind == "file":
        found = read(target, storage_options)
        if found is not None:
            chain = chain_for(target, found, storage_options)
            check(chain, found.step, found.blob, target)
            return chain, found.step, None
    return chain, None, None


def open_step(run: str, step: int | None, storage_options: dict[str, Any] | None
              ) -> tuple[Chain, int]:
    """The chain of ``run`` (a chain, a checkpoint folder or one entry) and the step to read:
    ``step``, else the entry's, else the latest."""
    chain, entry_step, _ = resolve(run, storage_options)
    step = step if step is not None else entry_step
    return chain, step if step is not None else chain.latest()


def load_state_dict(run: str, step: int | None = None, *, model: torch.nn.Module | None = None,
                    map_location: str | torch.device = "cpu",
                    storage_options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The model state dict of ``step``, loaded in full (the dense counterpart of ``mount``).
    Only the model's part is decoded: an optimizer state beside it costs nothing.

    Args:
        run: a run, a checkpoint folder, or a checkpoint entry (then its step is the default).
        step: the step; None for the entry's, or the run's latest.
        model: loaded with the step's weights, as ``model.load_state_dict`` would, and its
            keys are those of the returned dict (the container and key prefix are found as
            ``mount`` finds them). A step that lacks any of its keys (another architecture)
            raises ``TPDEError`` and leaves the model as it was.
        map_location: where the returned tensors are put.
        storage_options: fsspec options for the run's store.

    Returns:
        The state dict: without ``model``, the checkpoint's ``state_dict``/``model`` entry, or
        the checkpoint itself.

    Example:
        >>> net = Net()
        >>> tpde.load_state_dict("runs/exp1", model=net)  # net now holds the latest weights
    """
    chain, step = open_step(run, step, storage_options)
    skeleton = chain.manifest(step).skeleton
    if model is not None:
        tensors = model.state_dict(keep_vars=True)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        ties = keys.tied(tensors)
        _, container, prefix = keys.match_all(skeleton, shapes, run=chain.url, step=step,
                                              ties=ties)
        node, _ = chain.load(step, map_location=map_location, keep_words=False,
                             within=container or None)  # the model's part only
        state = OrderedDict()
        for k in shapes:  # a tied weight saved once is found under one of its names
            name = next(n for n in (k, *ties.get(k, ())) if prefix + n in node)
            state[k] = node[prefix + name]
        model.load_state_dict(state)
        return state
    container = keys.weights_key(skeleton)
    state, _ = chain.load(step, map_location=map_location, keep_words=False, within=container)
    return state
