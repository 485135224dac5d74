"""Small tensors saved in packs: one record for many biases, norms and step counts, each tensor
restored as the storage it was, the damage of a pack named, bounded tensors left out."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil

import pytest
import torch

import tpde
from helpers import assert_same, flip_bit, training_state
from tpde.errors import CorruptionError, FormatError


def model_states(steps: int) -> list[dict]:
    """A small network trained with Adam: its biases, norms, moments and step counts are under
    4 KiB, its weights above."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        model(torch.randn(16, 48, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out.append(copy.deepcopy(training_state(model, opt, s)))
    return out


def packs(m) -> list:
    return [r for r in m.records if r.parts]


def test_small_tensors_are_saved_in_packs_and_restored_apart(tmp_path) -> None:
    states = model_states(4)
    small = [s.name for s in tpde.state.tree.flatten(states[-1]).spans
             if s.tensor.numel() * s.tensor.element_size() < 4096
             and s.tensor.dtype == torch.float32]
    model = [n for n in small if n.startswith("model/")]
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        for step, state in enumerate(states):
            ck.save(step, state)
    chain = tpde.Checkpointer(run).chain
    for step, state in enumerate(states):
        m = chain.manifest(step)
        assert m.format == 7 and sorted((r.name, r.parts) for r in packs(m)) == [
            ("model/<pack float32>", len(model)),
            ("optimizer/<pack float32>", len(small) - len(model))]
        got = tpde.Checkpointer(run).load(step)
        assert_same(state, got)  # storages too: each bias its own, as it was saved
    assert {r.codec for s in (1, 2, 3) for r in packs(chain.manifest(s))} & {"dense", "sparse"}
    assert tpde.Checkpointer(run).verify() == []


def test_tensors_under_an_error_bound_stay_out_of_packs(tmp_path) -> None:
    states = model_states(2)
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run, error_bound={"model/1.bias": tpde.Abs(1e-3)}) as ck:
        for step, state in enumerate(states):
            ck.save(step, state)
    m = tpde.Checkpointer(run).chain.manifest(1)
    alone = m.record("model/1.bias")
    assert alone is not None and alone.bound is not None and alone.parts is None
    assert all(r.bound is None for r in packs(m))
    with pytest.warns(tpde.LossyWarning):
        got = tpde.Checkpointer(run).load(1)
    assert_same(states[1]["optimizer"], got["optimizer"])


def test_a_damaged_pack_is_an_error_that_names_it(tmp_path) -> None:
    states = model_states(2)
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        for step, state in enumerate(states):
            ck.save(step, state)
    chain = tpde.Checkpointer(run).chain
    m = chain.manifest(0)
    flip_bit(run, m, packs(m)[0])
    for step in (0, 1):
        with pytest.raises(CorruptionError, match="model/<pack float32>") as caught:
            tpde.Checkpointer(run).load(step)
        assert caught.value.step == 0  # traced back to the step whose data is damaged
    problems = tpde.Checkpointer(run).verify()
    assert {(p.step, p.tensor) for p in problems} == {(0, "model/<pack float32>")}


def test_a_chain_of_format_6_goes_on_with_packs(tmp_path) -> None:
    """An older chain takes new steps in packs; its own steps read and verify as before, and a
    re-base of a format 6 step keeps it in format 6."""
    from test_golden import GOLDEN
    from golden.states import golden_states

    run = str(tmp_path / "v6")
    shutil.copytree(os.path.join(GOLDEN, "chain-v6"), run)
    states = model_states(2)
    with tpde.Checkpointer(run) as ck:
        last = ck.steps()[-1]
        ck.save(last + 1, states[0])
        ck.save(last + 2, states[1])
        ck.remove(last - 1)
        assert ck.chain.manifest(last).format == 6
        assert ck.chain.manifest(last + 2).format == 7
        assert_same(golden_states()[last], ck.load(last))
        assert_same(states[1], ck.load(last + 2))
        assert ck.verify() == []


def test_a_pack_in_an_older_format_is_refused(tmp_path) -> None:
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        ck.save(0, model_states(1)[0])
    chain = tpde.Checkpointer(run).chain
    m = chain.manifest(0)
    from tpde import manifest

    older = dataclasses.replace(m, records=list(m.records), format=6)
    with pytest.raises(FormatError, match="holds a pack"):
        manifest.parse(older.to_bytes(), step=0)


def test_info_lists_a_pack_as_one_row(tmp_path) -> None:
    import json
    import subprocess
    import sys

    states = model_states(1)
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        ck.save(0, states[0])
    small = [s.name for s in tpde.state.tree.flatten(states[0]).spans if s.name.startswith("model/")
             and s.tensor.numel() * s.tensor.element_size() < 4096]

    def info(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tpde.cli", "info", run, *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    rows = {t["name"]: t for t in json.loads(info("--json"))["tensors"]}
    assert rows["model/<pack float32>"]["parts"] == len(small)
    assert rows["model/0.weight"]["parts"] is None
    assert not set(small) & set(rows)
    assert f"model/<pack float32> ({len(small)} tensors)" in " ".join(info().split())


def test_every_packable_dtype_round_trips_as_deltas(tmp_path) -> None:
    state = {"m": {f"t{i}_{d}": (torch.arange(5 + i) % 2).to(d) for i in range(3)
                   for d in tpde.state.tree.PACKABLE}}
    changed = {"m": {k: ~v if v.dtype == torch.bool else v + 1 for k, v in state["m"].items()}}
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ck:
        ck.save(0, state)
        ck.save(1, changed)
    reader = tpde.Checkpointer(run)
    assert_same(state, reader.load(0))
    assert_same(changed, reader.load(1))
    records = reader.chain.manifest(1).records
    assert len(records) == len(tpde.state.tree.PACKABLE) and all(r.parts == 3 for r in records)
