"""A real full disk (a small tmpfs in a private namespace) at many fill levels."""

from __future__ import annotations

import pytest

from campaigns.full_disk import available, campaign


def test_a_full_disk_fails_cleanly_and_the_chain_continues() -> None:
    if not available():
        pytest.skip("this machine cannot mount a tmpfs in a user namespace (unshare -rm)")
    results = campaign(levels=12)
    assert [r["problems"] for r in results] == [[]] * 12
    full = [r for r in results if r["failed_step"] is not None]
    assert len(full) == 12  # every level runs out of space before the chain is complete
    assert {"blob", "manifest"} <= {r["where"] for r in full}
    assert any(r["committed"] > 0 for r in full)
