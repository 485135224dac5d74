"""The committed golden chain (format 1) must decode bit-exactly forever."""

from __future__ import annotations

import os
import sys

import pytest

import tpde
from helpers import assert_same

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from states import golden_states  # noqa: E402

CHAIN = os.path.join(os.path.dirname(__file__), "golden", "chain-v1")


@pytest.mark.parametrize("step", range(5))
def test_golden_steps_decode_bit_exactly(step: int) -> None:
    assert_same(golden_states()[step], tpde.Checkpointer(CHAIN).load(step))


def test_golden_chain_exercises_every_codec_and_residual() -> None:
    chain = tpde.Checkpointer(CHAIN).chain
    used = {(r.codec, r.residual) for s in chain.steps() for r in chain.manifest(s).records}
    assert {("key", None), ("same", None), ("sparse", "xor"), ("dense", "sub")} <= used
    assert chain.verify(4) == []
