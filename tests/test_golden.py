"""The committed golden chains must decode bit-exactly forever: format 1 (whole spans), format 2
(large spans stored in pieces) and format 3 (steps re-based into new blobs)."""

from __future__ import annotations

import os
import sys

import pytest

import tpde
from helpers import assert_same

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from states import golden_states  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CHAINS = ("chain-v1", "chain-v2", "chain-v3")
#: Where each chain stores golden state i (chain-v3 kept the odd steps of its run).
STEP = {"chain-v1": lambda i: i, "chain-v2": lambda i: i, "chain-v3": lambda i: 2 * i + 1}


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("i", range(5))
def test_golden_steps_decode_bit_exactly(name: str, i: int) -> None:
    ck = tpde.Checkpointer(os.path.join(GOLDEN, name))
    assert_same(golden_states()[i], ck.load(STEP[name](i)))


@pytest.mark.parametrize("name", CHAINS)
def test_golden_chain_exercises_every_codec_and_residual(name: str) -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, name)).chain
    used = {(r.codec, r.residual) for s in chain.steps() for r in chain.manifest(s).records}
    assert {("key", None), ("same", None), ("sparse", "xor"), ("dense", "sub")} <= used
    assert chain.verify(STEP[name](4)) == []


def test_golden_v3_is_rebased_and_keeps_its_first_names() -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, "chain-v3")).chain
    assert chain.committed() == [1, 3, 5, 7, 9]
    for step in chain.steps():
        m = chain.manifest(step)
        assert m.format == 3 and m.origin is not None and m.origin != m.blob
        assert all(r.ref is None or r.ref in chain.steps() for r in m.records)

