"""Random damage to a committed chain: detected or harmless, never a silently wrong tensor."""

from __future__ import annotations

import pytest

from campaigns.corrupt import campaign


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_random_damage_is_detected_never_silent(pieces: bool) -> None:
    stats = campaign(trials=150, seed=1, pieces=pieces)
    assert stats["trials"] == 150
    assert stats["detected"] > 75  # most damage breaks some step; campaign() asserts the rest
