"""A folder of checkpoint entries as one whole: which steps of a chain its entries name (the
chain's roots), which entries are damaged and what they may still name, and their repair.

A step no entry names is an orphan, hidden and freed once nothing needs it. Damage never
turns into deletion: a damaged entry keeps what it may name until it is repaired or removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from tpde.chain import Chain
from tpde.entries.entry import (CHAIN_DIR, FOLDER_ENTRY, MAX_ENTRY_BYTES, CheckpointEntry,
                                PendingEntry, parse_any, same_chain, store_at, to_bytes)
from tpde.errors import FormatError, TPDEError
from tpde.store.store import Entry, Store

#: In every entry's JSON member, which is stored uncompressed: a file that holds it was one.
MARK = b'"format": "tpde-entry"'

#: Entries already read, by URL and a version that changes with every rewrite (an ETag or
#: generation on object stores, inode and mtime on disk): a writer that collects after every
#: save reads each entry once, not once per save.
Seen = dict[tuple[str, Any], Any]  # what ``_listed`` found


@dataclass(frozen=True)
class Damaged:
    """A file at a checkpoint path that was an entry and cannot be read any more (truncated,
    or bytes changed). Its step may still be named in what is left: an entry holds its step's
    blob name twice (in the pickled call and in the JSON member)."""

    error: str
    data: bytes = field(repr=False)

    def steps(self, chain: Chain) -> list[int]:
        """The visible steps of ``chain`` whose blob name survives in the damaged bytes."""
        return [s for s in chain.steps() if (chain.manifest(s).id or "").encode() in self.data]


@dataclass
class Survey:
    """What a checkpoint folder holds for one chain, by file name: the entries that read, the
    damaged ones (``Damaged``) and the pending first saves (they name no committed step)."""

    entries: dict[str, CheckpointEntry] = field(default_factory=dict)
    damaged: dict[str, Damaged] = field(default_factory=dict)
    pending: dict[str, PendingEntry] = field(default_factory=dict)


def _listed(url: str, storage_options: dict[str, Any] | None) -> Any:
    """The file at ``url`` as ``survey`` sees it: an entry, a pending entry, a damaged entry,
    or None for a file that is no entry."""
    at, name = store_at(url, storage_options)
    data = bytes(at.read(name))
    if len(data) < 4 and b"PK\x03\x04".startswith(data):
        return Damaged(f"cut to {len(data)} bytes", data)  # no checkpoint of any kind is this short
    try:
        found = parse_any(data, where=url)
    except FormatError as exc:
        return Damaged(exc.detail, data)
    if found is None and MARK in data:  # an entry whose archive no longer reads as one
        return Damaged("not a readable archive any more", data)
    return found


def _files(folder_url: str, storage_options: dict[str, Any] | None) -> Iterator[Entry]:
    """The files of a checkpoint folder that may be entries: its own, and the
    ``FOLDER_ENTRY`` of each of its folders (checkpoints that are folders, as Hugging Face's
    ``checkpoint-N/``; a folder whose name starts with a dot, a chain's, is no checkpoint)."""
    store = Store(folder_url, storage_options)
    files, folders = store.contents("")
    yield from files
    for sub in folders:
        if not sub.rsplit("/", 1)[-1].startswith("."):
            yield from (item for item in store.list(sub)
                        if item.path.rsplit("/", 1)[-1] == FOLDER_ENTRY)


def survey(folder_url: str, chain: Chain, storage_options: dict[str, Any] | None = None,
           seen: Seen | None = None) -> Survey:
    """The entries in ``folder_url`` (and in its checkpoints that are folders) that point into
    ``chain``, and those that may: a damaged entry is kept whoever it named, since no one can
    tell it did not name this chain. Entries are named by their path in the folder."""
    seen = {} if seen is None else seen
    out = Survey()
    listed = set()
    for item in _files(folder_url, storage_options):
        if item.size > MAX_ENTRY_BYTES:
            continue
        name = item.path
        url = f"{str(folder_url).rstrip('/')}/{name}"
        key = (url, item.version)
        listed.add(key)
        if key[1] is None or key not in seen:
            try:
                seen[key] = _listed(url, storage_options)
            except FileNotFoundError:
                continue  # removed meanwhile
        found, base = seen[key], name
        if isinstance(found, Damaged):
            out.damaged[base] = found
            continue
        if isinstance(found, PendingEntry):
            if found.previous is None:
                if same_chain(url, found, chain):
                    out.pending[base] = found
                continue
            found = found.previous
        if found is not None and same_chain(url, found, chain):
            out.entries[base] = found
    for gone in seen.keys() - listed:  # replaced or removed: forget, so the cache stays small
        del seen[gone]
    out.entries = dict(sorted(out.entries.items()))
    out.damaged = dict(sorted(out.damaged.items()))
    return out


def listing(folder_url: str, chain: Chain, storage_options: dict[str, Any] | None = None,
            seen: Seen | None = None) -> dict[str, CheckpointEntry]:
    """The readable entries in ``folder_url`` that point into ``chain``, by file name."""
    return survey(folder_url, chain, storage_options, seen).entries


def orphans(chain: Chain, folder_url: str, storage_options: dict[str, Any] | None = None,
            seen: Seen | None = None) -> list[int]:
    """Visible steps of ``chain`` that no entry in ``folder_url`` names: the ones to hide.

    Damage never turns into deletion: a damaged entry keeps the steps whose blob names survive
    in it, and one in which none does keeps every step, until it is repaired or removed."""
    found = survey(folder_url, chain, storage_options, seen)
    live = {e.blob for e in found.entries.values()}
    for damaged in found.damaged.values():
        kept = damaged.steps(chain)
        if not kept:
            return []
        live.update(chain.manifest(s).id for s in kept)
    return [s for s in chain.steps() if chain.manifest(s).id not in live]


def repair(folder_url: str, chain: Chain, storage_options: dict[str, Any] | None = None, *,
           name: str | None = None, step: int | None = None
           ) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Write the damaged entries of ``folder_url`` again, each naming the step whose blob
    name survives in it. The caller holds the run's writer lease.

    Args:
        folder_url: the checkpoint folder (its chain in ``CHAIN_DIR``).
        chain: that chain.
        storage_options: fsspec options for the folder's store.
        name: only this damaged entry (a file name in the folder).
        step: the step ``name`` names, where what is left of it does not tell.

    Returns:
        The entries rewritten (name -> step), and those left as they were with the steps they
        may name (none found, or more than one).

    Example:
        >>> done, left = repair("runs/exp1/checkpoints", chain)  # {"last.ckpt": 10}, {}
    """
    if step is not None and name is None:
        raise TPDEError("a step to repair with needs the entry it is for (--entry NAME)")
    damaged = survey(folder_url, chain, storage_options).damaged
    if name is not None:
        if name not in damaged:
            raise TPDEError(f"{folder_url}/{name} is not a damaged checkpoint entry (damaged: "
                            f"{', '.join(damaged) or 'none'}); nothing was written")
        damaged = {name: damaged[name]}
    if step is not None and step not in chain.steps():
        raise TPDEError(f"{chain.url} has no visible step {step} (`tpde ls` lists them); "
                        "nothing was written")
    done, left = {}, {}
    for file, found in damaged.items():
        named = [step] if step is not None else found.steps(chain)
        if len(named) != 1:
            left[file] = named
            continue
        m = chain.manifest(named[0])
        entry = CheckpointEntry(run="../" * file.count("/") + CHAIN_DIR, run_url=chain.url, step=m.step, blob=m.id or "",
                                raw_bytes=m.raw_bytes, stored_bytes=m.stored_bytes)
        Store(folder_url, storage_options).put_atomic(file, to_bytes(entry))
        done[file] = m.step
    return done, left
