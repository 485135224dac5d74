"""The committed golden chains must decode bit-exactly forever: format 1 (whole spans) and
format 2 (large spans stored in pieces)."""

from __future__ import annotations

import os
import sys

import pytest

import tpde
from helpers import assert_same

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from states import golden_states  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CHAINS = ("chain-v1", "chain-v2")


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("step", range(5))
def test_golden_steps_decode_bit_exactly(name: str, step: int) -> None:
    assert_same(golden_states()[step], tpde.Checkpointer(os.path.join(GOLDEN, name)).load(step))


@pytest.mark.parametrize("name", CHAINS)
def test_golden_chain_exercises_every_codec_and_residual(name: str) -> None:
    chain = tpde.Checkpointer(os.path.join(GOLDEN, name)).chain
    used = {(r.codec, r.residual) for s in chain.steps() for r in chain.manifest(s).records}
    assert {("key", None), ("same", None), ("sparse", "xor"), ("dense", "sub")} <= used
    assert chain.verify(4) == []

