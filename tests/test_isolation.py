"""Global state a test changes is put back before the next one (conftest's autouse fixture),
and tpde works under the settings training code switches on."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

import tpde
from helpers import assert_same

CHANGED = {"PL_GLOBAL_SEED": "7", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HF_HUB_OFFLINE": "1",
           "TRITON_INTERPRET": "1"}
BEFORE: dict = {}


def test_a_test_that_changes_global_state() -> None:
    BEFORE.update(env={k: os.environ.get(k) for k in CHANGED},
                  rng=(random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()))
    torch.use_deterministic_algorithms(True)
    os.environ.update(CHANGED)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)


def test_the_next_test_starts_from_the_state_before() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    assert {k: os.environ.get(k) for k in CHANGED} == BEFORE["env"]
    python, numpy, torch_rng = BEFORE["rng"]
    assert random.getstate() == python
    assert np.array_equal(np.random.get_state()[1], numpy)
    assert torch.equal(torch.get_rng_state(), torch_rng)


def test_deterministic_mode_left_on_by_training_code(tmp_path) -> None:
    """``Trainer(deterministic=True)`` leaves torch's deterministic algorithms on, under which
    torch cannot even allocate some dtypes (``torch.empty`` of int3): tpde still saves and
    restores every dtype, whole and in pieces."""
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g)
    state = {"int3": raw[:1000].clone().view(torch.int3), "bool": raw[1000:2000] & 1 == 1,
             "bf16": raw.clone().view(torch.bfloat16), "f8": raw.clone().view(torch.float8_e4m3fn)}
    for inflight in (256 << 20, 512):  # whole, then in pieces of at most 256 bytes
        run = str(tmp_path / f"run-{inflight}")
        with tpde.Checkpointer(run, max_inflight_bytes=inflight, reference="store") as ck:
            ck.save(0, state)
            ck.save(1, {**state, "bf16": state["bf16"].view(torch.int16).add(1)
                        .view(torch.bfloat16)})
        assert_same(tpde.Checkpointer(run).load(0), state)
        assert tpde.Checkpointer(run).load(1)["bf16"].view(torch.int16).equal(
            state["bf16"].view(torch.int16).add(1))
