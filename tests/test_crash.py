"""SIGKILL at every I/O operation of a save and of remove + gc: nothing committed is lost."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import tpde
from campaigns.crash import campaign


def test_every_kill_point_on_local_disk(tmp_path) -> None:
    tried = campaign(lambda: (str(tmp_path / uuid.uuid4().hex[:10]), None))
    assert tried >= 20  # blob writes, fsyncs, renames, manifest, tombstones, gc deletes


@pytest.mark.s3
@pytest.mark.slow
def test_kill_points_on_s3(s3_server) -> None:
    """Each third kill point: the local test tries them all; the S3 store's own operations
    (puts, deletes, listings) are among those tried. ``python tests/campaigns/crash.py --s3``
    tries every one."""
    tried = campaign(lambda: (f"s3://tpde/crash-{uuid.uuid4().hex[:10]}", s3_server["options"]),
                     every=3)
    assert tried >= 4


@pytest.mark.slow
def test_kill_points_in_a_lightning_run(tmp_path) -> None:
    pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")
    from campaigns.lightning_crash import campaign

    stats = campaign(str(tmp_path), points=6)
    # Saves, entry writes, removals and gc, first to last; some kills cut a save short. The
    # last point, at the dry run's last operation, may lie past a run whose teardown had
    # less to free.
    assert stats["kills"] >= 5 and stats["operations"] > 20 and stats["inside_a_save"] >= 2


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names file descriptors by /proc")
def test_a_save_makes_its_blob_durable_before_its_manifest_names_it(tmp_path, monkeypatch) -> None:
    """The durability barriers of a save on local disk, in order: the blob's bytes, the blob's
    name in its folder, the manifest's bytes, the manifest's name (an exclusive link), and the
    steps folder. A SIGKILL keeps the page cache, so only the order of these calls can show
    that a power loss would leave no manifest naming a missing or partial blob."""
    run = tmp_path / "run"
    with tpde.Checkpointer(str(run)) as ck:
        ck.save(0, {"w": torch.ones(1000)})
        events: list[tuple[str, str]] = []
        fsync, link = os.fsync, os.link

        def recorded_fsync(fd: int) -> None:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            fsync(fd)

        def recorded_link(src: str, dst: str, *args, **kwargs) -> None:
            link(src, dst, *args, **kwargs)
            events.append(("link", os.path.realpath(dst)))

        monkeypatch.setattr(os, "fsync", recorded_fsync)
        monkeypatch.setattr(os, "link", recorded_link)
        ck.save(1, {"w": torch.zeros(1000)})
        monkeypatch.undo()
        blob = os.path.realpath(run / ck.chain.manifest(1).blob)
    manifest = os.path.realpath(run / "steps" / f"{1:020d}.json")
    data, steps = os.path.realpath(run / "data"), os.path.realpath(run / "steps")

    def first(kind: str, path: str, after: int = -1) -> int:
        for i, (k, p) in enumerate(events):
            if i > after and k == kind and (p == path or (kind == "fsync" and path == "tmp"
                                                         and p.startswith(manifest + "."))):
                return i
        raise AssertionError(f"no {kind} of {path} after event {after}: {events}")

    a = first("fsync", blob)
    b = first("fsync", data, a)
    c = first("fsync", "tmp", b)  # the manifest's temporary file, before it is linked
    d = first("link", manifest, c)
    first("fsync", steps, d)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names file descriptors by /proc")
def test_a_replaced_object_is_durable_before_and_after_its_rename(tmp_path, monkeypatch) -> None:
    """``put_atomic`` (tombstones, re-based manifests, the lease, the marker, checkpoint
    entries): the temporary file's bytes, then the rename, then its folder."""
    from tpde.store.store import Store

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src: str, dst: str, *args, **kwargs) -> None:
        events.append(("replace-from", os.path.realpath(src)))
        replace(src, dst, *args, **kwargs)
        events.append(("replace", os.path.realpath(dst)))

    store = Store(str(tmp_path / "run"))
    store.put_atomic("removed/x", b"old")
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    store.put_atomic("removed/x", b"new")
    monkeypatch.undo()
    folder = os.path.realpath(tmp_path / "run" / "removed")
    kinds = [k for k, _ in events]
    assert kinds == ["fsync", "replace-from", "replace", "fsync"], events
    assert events[0][1] == events[1][1]  # the bytes synced are the file renamed
    assert events[2][1] == os.path.join(folder, "x") and events[3][1] == folder
