"""Random damage to a committed chain: detected or harmless, never a silently wrong tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpde
from campaigns.corrupt import campaign
from helpers import flip_bit


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_random_damage_is_detected_never_silent(pieces: bool) -> None:
    stats = campaign(trials=150, seed=1, pieces=pieces)
    assert stats["trials"] == 150
    assert stats["detected"] > 75  # most damage breaks some step; campaign() asserts the rest


@settings(max_examples=12)
@given(sizes=st.lists(st.integers(1, 30_000), min_size=1, max_size=7), steps=st.integers(1, 4),
       batch=st.sampled_from([1 << 12, 1 << 16, 1 << 30]), data=st.data())
def test_batches_rebuilt_side_by_side_give_the_step_and_name_a_damaged_record(
        tmp_path_factory, sizes, steps, batch, data) -> None:
    """A step is rebuilt a batch of records at a time, the next batch's records handed to the
    decode threads while the one before finishes (unless they rebuild the same tensors). In
    batches of any size it is the same step; a damaged record is named, alone, and every other
    tensor is still right."""
    url = str(tmp_path_factory.mktemp("run") / "r")
    g = torch.Generator().manual_seed(len(sizes) * 10 + steps)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    with tpde.Checkpointer(url) as ck:
        for step in range(steps):
            ck.save(step, state)
            state = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    chain = tpde.Checkpointer(url).chain
    last = steps - 1
    whole = chain.materialize(last)
    in_batches = chain.materialize(last, batch_bytes=batch)
    assert whole.keys() == in_batches.keys() == {r.name for r in chain.manifest(last).records}
    for name, words in whole.items():
        assert torch.equal(words, in_batches[name]), name

    at = data.draw(st.integers(0, last))
    m = chain.manifest(at)
    rec = data.draw(st.sampled_from([r for r in m.records if "values" in r.sections]))
    flip_bit(url, m, rec)
    found: list = []
    damaged = tpde.Checkpointer(url).chain.materialize(last, problems=found, batch_bytes=batch)
    assert {p.tensor for p in found} <= {rec.name}
    assert all(p.step == at for p in found), found
    for name, words in whole.items():
        if name == rec.name and found:
            assert name not in damaged
        else:
            assert torch.equal(damaged[name], words), name  # never silently wrong
