"""Random damage to a committed chain: detected or harmless, never a silently wrong tensor."""

from __future__ import annotations

from campaigns.corrupt import campaign


def test_random_damage_is_detected_never_silent() -> None:
    stats = campaign(trials=150, seed=1)
    assert stats["trials"] == 150
    assert stats["detected"] > 75  # most damage breaks some step; campaign() asserts the rest
