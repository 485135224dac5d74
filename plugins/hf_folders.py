"""The ``checkpoint-N/`` folders of a Hugging Face ``Trainer`` on local disk, as ``tpde.hf``
keeps them: which one a resume reads, files shared with the previous checkpoint, and the
folder times the ``Trainer``'s rotation sorts by.

The ``Trainer`` orders its checkpoints by the folders' modification times when it rotates them
(``sort_checkpoints(use_mtime=True)``), and anything that adds, replaces or removes a file in a
folder moves its time. tpde writes into a folder after the ``Trainer`` is done with it (the
committed entry, in the background; links to unchanged files), so it puts the folder's time
back afterwards (``Times``): a save that commits late must not make an older checkpoint look
newer, or rotation would delete the newer one.

Files that are byte for byte those of the previous checkpoint (config, tokenizer, adapter
config, training arguments: most of a LoRA checkpoint's bytes) become hard links to it, as
``rsync --link-dest`` keeps backups, so that a folder holds each such file once however many
checkpoints name it. A folder the ``Trainer`` is about to write again has its links broken
first (``unshare``), so that no write into one checkpoint changes another.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import re
import shutil
from typing import Iterator

from tpde.entries import entry as entries
from tpde.errors import TPDEError

#: The ``Trainer``'s checkpoint folders, and Accelerate's (``save_state`` with automatic naming).
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
ACCELERATE_CHECKPOINT = re.compile(r"^checkpoint_(\d+)$")
#: The file the ``Trainer`` writes last into a checkpoint folder; Accelerate's always-there one.
TRAINER_STATE = "trainer_state.json"
ACCELERATE_STATE = "random_states_0.pkl"
#: The weight files of a plain checkpoint folder, one of which a resume reads.
PLAIN_WEIGHTS = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin"}
#: Where a link is made before it replaces a file (a crash leaves at most this behind; the
#: next link into the folder removes it).
LINKING = ".tpde-linking"


def checkpoints(output_dir: str, pattern: re.Pattern[str] = CHECKPOINT) -> list[str]:
    """The checkpoint folders (names ``pattern`` matches, its group the step) in
    ``output_dir``, newest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [n for n in os.listdir(output_dir)
             if pattern.match(n) and os.path.isdir(os.path.join(output_dir, n))]
    return [os.path.join(output_dir, n)
            for n in sorted(found, key=lambda n: -int(pattern.match(n).group(1)))]


def last_checkpoint(output_dir: str, pattern: re.Pattern[str] = CHECKPOINT,
                    needs: str = TRAINER_STATE) -> str | None:
    """The newest checkpoint folder a resume can read: one with the file ``needs``, and whose
    save committed (a save cut short leaves its folder without a committed entry) or a plain
    one with its weight files."""
    for folder in checkpoints(output_dir, pattern):
        if not os.path.isfile(os.path.join(folder, needs)):
            continue
        path = os.path.join(folder, entries.FOLDER_ENTRY)
        if not os.path.exists(path):
            if PLAIN_WEIGHTS & set(os.listdir(folder)):
                return folder
            continue
        try:
            found = entries.read_any(path)
        except (OSError, TPDEError):
            continue
        if isinstance(found, entries.CheckpointEntry):
            return folder
    return None


def previous(folder: str, pattern: re.Pattern[str] = CHECKPOINT) -> str | None:
    """The checkpoint folder of the highest step below ``folder``'s, beside it (None where
    ``folder``'s name is not a checkpoint's)."""
    match = pattern.match(os.path.basename(folder))
    if match is None:
        return None
    step = int(match.group(1))
    for other in checkpoints(os.path.dirname(folder), pattern):
        if int(pattern.match(os.path.basename(other)).group(1)) < step:
            return other
    return None


def _files(folder: str) -> Iterator[str]:
    """``folder``'s files by relative path, tpde's entry left out."""
    for d, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), folder)
            if rel != entries.FOLDER_ENTRY and name != LINKING:
                yield rel


def link_unchanged(folder: str, before: str) -> int:
    """Replace each file of ``folder`` that is byte for byte the same file of ``before`` by a
    hard link to it; the bytes this frees. Where links cannot be made (another filesystem, one
    without them) the files stay as they are."""
    freed = 0
    for rel in _files(folder):
        new, old = os.path.join(folder, rel), os.path.join(before, rel)
        try:
            a, b = os.stat(new), os.stat(old)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) or a.st_size != b.st_size \
                    or not filecmp.cmp(new, old, shallow=False):
                continue
            tmp = os.path.join(os.path.dirname(new), LINKING)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.link(old, tmp)
            os.replace(tmp, new)
            freed += a.st_size
        except FileNotFoundError:  # rotated away meanwhile
            continue
        except OSError:  # no hard links here
            return freed
    return freed


def unshare(folder: str) -> None:
    """Give every file of ``folder`` that is also another folder's (``link_unchanged``) a copy
    of its own, before something writes into ``folder`` again."""
    if not os.path.isdir(folder):
        return
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        if os.stat(path).st_nlink < 2:
            continue
        tmp = os.path.join(os.path.dirname(path), LINKING)
        shutil.copy2(path, tmp)
        os.replace(tmp, path)


class Times:
    """A folder's access and modification times, taken when the ``Trainer`` is done with it and
    put back after tpde writes into it (``restore``), as the module's docstring explains."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        stat = os.stat(folder)
        self.ns = (stat.st_atime_ns, stat.st_mtime_ns)

    def restore(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
            os.utime(self.folder, ns=self.ns)


def held_bytes(root: str) -> int:
    """The bytes of the files under ``root``, each counted once however many links name it
    (as ``du`` counts; a file deleted while this walks is left out)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for d, _, names in os.walk(root):
        for name in names:
            try:
                stat = os.lstat(os.path.join(d, name))
            except FileNotFoundError:
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total
