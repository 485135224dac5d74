"""The benchmark's contenders round-trip real checkpoints, and its checks catch what they must."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import tpde
from helpers import assert_same, decode_depths, training_state

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import compare  # noqa: E402
import contenders  # noqa: E402


def chain(steps: int = 4) -> list[dict]:
    """A tied-weight model trained with AdamW: fp32, bf16 and int tensors plus plain values."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        loss = model(torch.randint(0, 50, (8,))).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = copy.deepcopy(training_state(model, opt, step))
        state["bf16"] = emb.weight.detach().bfloat16().clone()
        state["counts"] = torch.arange(step + 3)
        state["note"] = ("epoch", step, 0.5)
        out.append(state)
    return out


CONTENDERS = range(len(contenders.all_contenders(compare.BEST_LEVEL)))


def replay(index: int, folder: str, removed_after: dict[int, int]
           ) -> tuple[contenders.Contender, contenders.Contender, list[dict]]:
    """Save ``chain()`` with contender ``index``, removing step ``removed_after[s]`` after saving
    step ``s``; the writer, a fresh reader, and the states."""
    make = contenders.all_contenders(compare.BEST_LEVEL)[index]
    c = make()
    if c.needs:
        pytest.importorskip(c.needs, reason=f"{c.name} needs {c.needs}: pip install 'tpde[dev]'")
    states = chain()
    for step, state in enumerate(states):
        c.save(folder, step, state)
        if step in removed_after:
            c.remove(folder, removed_after[step])
    c.close(folder)
    return c, make() if not isinstance(c, contenders.DCP) else c, states  # DCP: known structure


@pytest.mark.parametrize("index", CONTENDERS)
def test_every_contender_restores_every_step_bit_exactly(index: int, tmp_path) -> None:
    c, reader, states = replay(index, str(tmp_path), {})
    for step in reversed(range(len(states))):
        assert_same(reader.load(str(tmp_path), step), states[step])
    assert c.worst_step(str(tmp_path), list(range(len(states)))) in range(len(states))


@pytest.mark.parametrize("index", CONTENDERS)
def test_every_contender_keeps_what_a_retention_policy_keeps(index: int, tmp_path) -> None:
    """What workload G replays: after a removal the kept steps restore bit-exactly."""
    c, reader, states = replay(index, str(tmp_path), {2: 1})
    for step in (3, 2, 0):
        assert_same(reader.load(str(tmp_path), step), states[step])
    assert c.worst_step(str(tmp_path), [0, 2, 3]) in (0, 2, 3)
    if isinstance(c, contenders.TPDE):  # re-based away: nothing holds step 1 any more
        assert 1 not in tpde.Checkpointer(os.path.join(str(tmp_path), "run")).chain.committed()
    elif not isinstance(c, contenders.ZipNNDelta):  # its later deltas read step 1: it stays
        assert not any(f"{1:06d}" in name for name in os.listdir(tmp_path))


def test_tpde_worst_step_is_the_deepest_delta(tmp_path) -> None:
    c = contenders.TPDE(keyframe_every=3)
    for step, state in enumerate(chain(6)):
        c.save(str(tmp_path), step, state)
    c.close(str(tmp_path))
    run = tpde.Checkpointer(os.path.join(str(tmp_path), "run")).chain
    deepest = max(range(6), key=lambda s: (max(decode_depths(run, s).values()), s))
    assert c.worst_step(str(tmp_path), list(range(6))) == deepest
    assert c.details(str(tmp_path))["keyframes"] == [s for s in range(6) if all(
        r.ref is None for r in run.manifest(s).records)]


def test_the_round_trip_check_names_what_differs() -> None:
    """compare.py judges contenders with the tests' own comparison; each kind of difference a
    restore could have is named."""
    a = chain(1)[0]
    b = {**a, "bf16": a["bf16"].clone()}
    b["bf16"].view(torch.int16)[3] ^= 1
    assert compare.difference(b, a) == "/bf16: different bits"
    assert "float32" in compare.difference({**a, "bf16": a["bf16"].float()}, a)
    assert compare.difference({**a, "note": list(a["note"])}, a) == "/note: list instead of tuple"
    assert compare.difference({**a, "model": dict(a["model"])}, a) == \
        "/model: dict instead of OrderedDict"
    meta = type(a["model"])(a["model"])  # an OrderedDict without the state dict's _metadata
    assert compare.difference({**a, "model": meta}, a) == "/model: _metadata differs"
    assert "strides" in compare.difference({**a, "bf16": a["bf16"].t().contiguous().t()}, a)
    assert "requires_grad" in compare.difference(
        {**a, "bf16": a["bf16"].clone().requires_grad_()}, a)
    untied = copy.deepcopy(a)
    untied["model"]["1.weight"] = untied["model"]["1.weight"].clone()  # the tied head
    assert "shares storage with /model/0.weight instead of nothing" in compare.difference(a, untied)
    assert compare.difference(a, chain(1)[0]) is None


def test_a_contender_that_is_not_exact_gets_no_ratio_or_speed() -> None:
    measured = {"name": "x", "status": "ok", "save_s": [2.0], "restore_latest_s": [1.0],
                "restore_worst_s": [1.0], "raw_bytes": [100, 100], "kept": [0, 1],
                "stored_bytes": 50, "worst_step": 0}
    assert compare.summarize(measured)["ratio"] == 4.0
    wrong = compare.summarize({**measured, "status": "not exact at step 0: /w: different bits"})
    assert not {"ratio", "save_mb_s", "restore_latest_mb_s"} & set(wrong)


def test_entropy_estimate_prices_unchanged_and_random_tensors() -> None:
    same = torch.randn(4096)
    assert compare.residual_bits(same, same.clone()) == 0
    noise = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32)
    bits = compare.residual_bits(noise, torch.zeros_like(noise))
    assert 30 * 4096 < bits <= 33 * 4096  # random words cannot be coded below their size
