"""SIGKILL at every I/O operation of a save and of remove + gc: nothing committed is lost."""

from __future__ import annotations

import uuid

import pytest

from campaigns.crash import campaign


def test_every_kill_point_on_local_disk(tmp_path) -> None:
    tried = campaign(lambda: (str(tmp_path / uuid.uuid4().hex[:10]), None))
    assert tried >= 20  # blob writes, fsyncs, renames, manifest, tombstones, gc deletes


@pytest.mark.s3
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
