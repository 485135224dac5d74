"""The error-bounded mode: every restored element within its bound at every step of a chain,
checked here in numpy's float64 against the saved values (never with tpde's own check), and
the method without error feedback shown to break the same bound."""

from __future__ import annotations

import json
import math
import os
import subprocess
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tpde
from forked import run_module
from tpde.codec import decoder, encoder, transform, unframe

DTYPES = {"float32": (torch.float32, torch.int32), "bfloat16": (torch.bfloat16, torch.int16),
          "float16": (torch.float16, torch.int16)}


def holds(saved: torch.Tensor, got: torch.Tensor, bound: tpde.Bound) -> np.ndarray:
    """Which elements of ``got`` hold ``bound`` against ``saved`` (numpy, float64)."""
    x = saved.float().double().numpy().reshape(-1)
    y = got.float().double().numpy().reshape(-1)
    bits_equal = (saved.reshape(-1).view(torch.uint8).reshape(x.size, -1)
                  == got.reshape(-1).view(torch.uint8).reshape(x.size, -1)).all(1).numpy()
    err = np.abs(y - x)
    ok = np.isfinite(x) & np.isfinite(y)
    if bound.abs is not None:
        ok &= err <= bound.abs
    if bound.rel is not None:
        ok &= (err <= bound.rel * np.abs(x)) & (np.signbit(x) == np.signbit(y))
    return np.where(np.isfinite(x), ok, bits_equal)


def roundtrip(words: torch.Tensor, ref: torch.Tensor | None, dtype: str,
              bound: tpde.Bound) -> tuple[encoder.Encoding, torch.Tensor]:
    enc = encoder.encode(words, ref, "float", encoder.Settings(chunk=4096), bound=bound, dtype=dtype)
    secs = {k: unframe.decompress(s.frames, s.raw, s.chunk) for k, s in enc.sections.items()}
    if enc.codec == "same":
        return enc, ref.clone()
    out = decoder.decode(enc.codec, enc.residual, secs, None if enc.keyed else ref.clone(),
                       words.numel(), words.dtype, "float",
                       grid=(enc.grid, enc.scale, dtype) if enc.codec == "quant" else None)
    return enc, out


def walk(seed: int, n: int, steps: int, dtype: torch.dtype, scale: float) -> list[torch.Tensor]:
    """A random walk with near-zero values, sign changes, subnormals, NaN/Inf, and updates that
    switch between sparse and dense."""
    g = np.random.default_rng(seed)
    x = g.standard_normal(n) * scale
    x[: n // 8] *= 1e-6  # near zero: sign changes and, in fp16, subnormals
    x[n // 8 : n // 8 + 4] = [0.0, -0.0, 1e-41, -1e-42]
    out = []
    for t in range(steps):
        if t % 3 == 0:  # dense
            x = x + g.standard_normal(n) * scale * 10.0 ** g.uniform(-4, -1)
        else:  # sparse
            at = g.choice(n, max(1, n // 50), replace=False)
            x[at] += g.standard_normal(at.size) * scale
        y = torch.from_numpy(x.copy()).to(dtype)
        if t % 7 == 3:
            y[g.integers(0, n, 3)] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        out.append(y)
    return out


BOUNDS = st.sampled_from([tpde.Rel(1e-3), tpde.Rel(1e-2), tpde.Rel(0.2), tpde.Abs(1e-3),
                          tpde.Abs(1e-1), tpde.Abs(1e-4) & tpde.Rel(1e-2)])


@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(sorted(DTYPES)), bound=BOUNDS,
       n=st.integers(16, 3000), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_random_walks_hold_the_bound_at_every_step(seed: int, dtype: str, bound: tpde.Bound,
                                                   n: int, scale: float) -> None:
    fdt, wdt = DTYPES[dtype]
    ref = None
    for t, x in enumerate(walk(seed, n, 50, fdt, scale)):
        words = transform.to_words(x, wdt)
        enc, got = roundtrip(words, ref, dtype, bound)
        assert holds(x, got.view(fdt), bound).all(), f"step {t}: {enc.codec} {enc.grid}"
        if enc.words is not None:  # the writer's next reference is what was decoded here
            assert torch.equal(enc.words, got)
        else:
            assert torch.equal(got, words)
        ref = got


def test_error_bounded_codes_are_taken_and_smaller_than_exact() -> None:
    """The mode is worth having: on a slowly changing fp32 walk it codes most steps on a grid
    and stores fewer bytes than the exact codecs."""
    bound = tpde.Rel(1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g)
    ref = None
    exact = lossy = 0
    used = set()
    for _ in range(10):
        x = x + 1e-3 * torch.randn(x.shape, generator=g)
        words = transform.to_words(x, torch.int32)
        exact += encoder.encode(words, ref, "float").stored
        enc, ref = roundtrip(words, ref, "float32", bound)
        lossy += enc.stored
        used.add((enc.codec, enc.grid))
    assert ("quant", "ulp") in used
    assert lossy * 3 < exact


def original_method(states: list[torch.Tensor], threshold: float) -> list[torch.Tensor]:
    """Thresholding as first proposed: a change is dropped when it is below ``threshold``
    relative to the true previous value, and the reader applies kept changes to what it has."""
    have = states[0].clone()
    out = [have.clone()]
    for prev, x in zip(states, states[1:]):
        keep = (x.double() - prev.double()).abs() > threshold * prev.double().abs()
        have = torch.where(keep, x, have)
        out.append(have.clone())
    return out


def test_without_error_feedback_errors_add_up_and_break_the_bound(tmp_path) -> None:
    """Small steps in one direction: each change is below the threshold, so the original
    method drops all of them and drifts; tpde at the same bound stays within it."""
    rel = 1e-3
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4096, generator=g) + 0.5
    states = [x]
    for _ in range(60):
        x = x * (1 + 4e-4 * torch.rand(x.shape, generator=g))
        states.append(x)
    drift = original_method(states, rel)
    worst_original = max(float(((d.double() - s.double()).abs() / s.double().abs()).max())
                         for d, s in zip(drift, states))
    assert worst_original > 5 * rel

    ck = tpde.Checkpointer(str(tmp_path / "run"), error_bound={"w": tpde.Rel(rel)})
    for step, s in enumerate(states):
        ck.save(step, {"w": s})
    reader = tpde.Checkpointer(str(tmp_path / "run"))
    for step, s in enumerate(states):
        assert holds(s, reader.load(step)["w"], tpde.Rel(rel)).all(), step


@pytest.mark.parametrize("deltas_against", ["previous", "keyframe"])
def test_a_chain_holds_the_bound_through_rekeys_and_removals(tmp_path, deltas_against) -> None:
    """50 saves with per-tensor keyframes every 8 (error-bounded keyframes included); then
    every third step is removed, which re-bases the steps reading from it: what every kept step
    restores is unchanged, bit for bit, and within the bound of what was saved. Coded against
    keyframes, every step stays one delta deep."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g)
    h = torch.randn(1000, generator=g).to(torch.bfloat16)
    bounds = {"model/w": tpde.Rel(1e-3), "model/h": tpde.Rel(2e-2), "model/*": tpde.Abs(1e-5)}
    run = str(tmp_path / "run")
    saved = []
    with tpde.Checkpointer(run, keyframe_every=8, error_bound=bounds,
                           deltas_against=deltas_against) as ck:
        for step in range(50):
            w = w + 1e-3 * torch.randn(w.shape, generator=g)
            h = (h.float() + 0.05 * torch.randn(h.shape, generator=g)).to(torch.bfloat16)
            state = {"model": {"w": w.clone(), "h": h.clone(), "b": torch.randn(7, generator=g),
                               "n": torch.tensor(step)}}
            ck.save(step, state)
            saved.append(state)
        m = ck.chain.manifest(49)
        assert m.format == 6 and m.lossy
        assert {r.name: r.bound for r in m.records} == {
            "model/w": {"rel": 1e-3}, "model/h": {"rel": 2e-2}, "model/b": {"abs": 1e-5},
            "model/n": {"abs": 1e-5}}
        assert m.record("model/n").error is None  # an integer: stored exactly
        keyed = [s for s in range(50) if ck.chain.manifest(s).record("model/w").ref is None]
        assert len(keyed) >= 6 and all(ck.chain.manifest(s).record("model/w").codec == "quant"
                                       for s in keyed)
        before = {s: ck.load(s) for s in range(50)}
        ck.remove(*range(0, 50, 3))
        assert ck.verify() == []
    reader = tpde.Checkpointer(run)
    for step in reader.steps():
        got = reader.load(step)
        for name, bound in (("w", bounds["model/w"]), ("h", bounds["model/h"]),
                            ("b", bounds["model/*"])):
            assert holds(saved[step]["model"][name], got["model"][name], bound).all()
            assert torch.equal(got["model"][name], before[step]["model"][name])
        assert torch.equal(got["model"]["n"], saved[step]["model"]["n"])
        assert deltas_against == "previous" or reader.chain.manifest(step).depth <= 1


def test_lossless_runs_record_no_bound(tmp_path) -> None:
    ck = tpde.Checkpointer(str(tmp_path / "run"))
    ck.save(0, {"w": torch.ones(10)})
    m = ck.chain.manifest(0)
    assert not m.lossy and all(r.bound is None and r.error is None for r in m.records)


@pytest.mark.parametrize("make", [lambda: tpde.Rel(0), lambda: tpde.Rel(-1e-3),
                                  lambda: tpde.Rel(math.nan), lambda: tpde.Rel(1.0),
                                  lambda: tpde.Abs(math.inf), lambda: tpde.Abs(0.0),
                                  lambda: tpde.Abs("1e-3"), lambda: tpde.Bound()])
def test_bad_bounds_fail_at_construction(make) -> None:
    with pytest.raises(tpde.BoundError):
        make()


def test_bad_patterns_fail_at_construction_and_first_save(tmp_path) -> None:
    with pytest.raises(tpde.BoundError, match="keys are name patterns"):
        tpde.Checkpointer(str(tmp_path / "a"), error_bound={"model/*": 1e-3})
    with pytest.raises(tpde.BoundError, match="dict of name patterns"):
        tpde.Checkpointer(str(tmp_path / "a"), error_bound={})
    ck = tpde.Checkpointer(str(tmp_path / "b"), error_bound={"model/encoder*": tpde.Rel(1e-3)})
    with pytest.raises(tpde.BoundError, match=r"matches no tensor.*model/fc\.weight"):
        ck.save(0, {"model": {"fc.weight": torch.ones(3)}, "step": 1})
    assert not os.path.exists(tmp_path / "b" / "steps")  # nothing was written


def test_a_pattern_that_earlier_ones_shadow_is_refused(tmp_path) -> None:
    """First match wins: ``*.bias`` after ``model/*`` would give every bias Rel(1e-3)."""
    g = torch.Generator().manual_seed(0)
    state = {"model": {"fc.weight": torch.randn(256, generator=g),
                       "fc.bias": 100 + torch.randn(256, generator=g)},
             "step": 0}
    shadowed = tpde.Checkpointer(str(tmp_path / "a"), error_bound={
        "model/*": tpde.Rel(1e-3), "*.bias": tpde.Abs(1e-6)})
    with pytest.raises(tpde.BoundError, match=r"'\*\.bias' applies to no tensor.*"
                                              r"\['model/fc\.bias'\].*'model/\*'.*first"):
        shadowed.save(0, state)
    assert not os.path.exists(tmp_path / "a" / "steps")
    run = str(tmp_path / "b")
    with tpde.Checkpointer(run, error_bound={"*.bias": tpde.Abs(1e-6),
                                             "model/*": tpde.Rel(1e-3)}) as ck:
        ck.save(0, state)
        ck.save(1, {"model": {n: t + 1e-4 for n, t in state["model"].items()}, "step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpde.LossyWarning)
        back = tpde.Checkpointer(run).load(1)
    bias = state["model"]["fc.bias"] + 1e-4
    assert (back["model"]["fc.bias"] - bias).abs().max() <= 1e-6


def test_a_tied_tensor_is_bounded_by_any_of_its_names(tmp_path) -> None:
    """``lm_head.weight`` tied to the embeddings is stored once, under the first name; a
    pattern naming the other still applies, and the two come back tied."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=g)
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run, error_bound={"model/lm_head.weight": tpde.Abs(1e-4)}) as ck:
        for step in range(2):
            embed = embed + 1e-3 * torch.randn(64, 32, generator=g)
            ck.save(step, {"model": {"embed.weight": embed, "lm_head.weight": embed}})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", tpde.LossyWarning)
        back = tpde.Checkpointer(run).load(1)["model"]
    assert said and "within Abs(0.0001)" in str(said[0].message)
    assert back["lm_head.weight"].data_ptr() == back["embed.weight"].data_ptr()
    assert (back["lm_head.weight"] - embed).abs().max() <= 1e-4


def test_lossy_steps_read_through_mounts_and_load_state_dict(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    run = str(tmp_path / "run")
    bound = tpde.Rel(1e-3)
    with tpde.Checkpointer(run, error_bound={"model/*weight": bound}) as ck:
        for step in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3 * torch.randn_like(p))
            ck.save(step, {"model": model.state_dict()})
    sd = tpde.load_state_dict(run)
    for k, v in model.state_dict().items():
        ok = holds(v, sd[k], bound) if k.endswith("weight") else None
        assert ok.all() if ok is not None else torch.equal(v, sd[k])
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    fresh.load_state_dict(sd)
    x = torch.randn(4, 64)
    empty = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mounted = tpde.mount(run, model=empty, budget=0)
    with torch.no_grad():
        assert torch.equal(mounted(x), fresh(x))  # the mount decodes what load_state_dict did


def test_restore_of_a_lossy_step_warns_once(tmp_path) -> None:
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run, error_bound={"w": tpde.Rel(1e-2)}) as ck:
        ck.save(0, {"w": torch.randn(100)})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        reader = tpde.Checkpointer(run)
        reader.load(0)
        reader.load(0)
    lossy = [w for w in seen if issubclass(w.category, tpde.LossyWarning)]
    assert len(lossy) == 1 and "Rel(0.01)" in str(lossy[0].message)


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m tpde.cli ARGS...``, forked from a server that imported tpde once."""
    return run_module("tpde.cli", *args)


def test_every_interface_says_a_step_is_lossy(tmp_path) -> None:
    """ls, info, restore and verify (a subprocess each, as a user runs them) mark what was
    saved under a bound, and ``verify --against`` measures the error against a dense file."""
    run = str(tmp_path / "run")
    g = torch.Generator().manual_seed(3)
    states = []
    with tpde.Checkpointer(run, error_bound={"model/*": tpde.Rel(1e-3)}) as ck:
        w = torch.randn(2000, generator=g)
        for step in range(2):
            w = w + 1e-2 * torch.randn(w.shape, generator=g)
            states.append({"model": {"w": w.clone(), "count": torch.tensor(step)},
                           "opt": torch.randn(10, generator=g)})
            ck.save(step, states[-1])
    ls = json.loads(cli("ls", run, "--json").stdout)
    assert [r["lossy"] for r in ls["steps"]] == [True, True]
    assert "LOSSY" in cli("ls", run).stdout
    info = json.loads(cli("info", run, "--json").stdout)
    by = {t["name"]: t for t in info["tensors"]}
    assert by["model/w"]["bound"] == {"rel": 1e-3} and 0 < by["model/w"]["error"]["rel"] <= 1e-3
    assert by["model/count"]["bound"] == {"rel": 1e-3} and by["model/count"]["error"] is None
    assert by["opt"]["bound"] is None and not by["opt"]["lossy"]
    text = cli("info", run).stdout
    assert "int64 is stored exactly" in text and "LOSSY step" in text

    out = str(tmp_path / "out.pt")
    done = cli("restore", run, "--output", out)
    assert done.returncode == 0 and done.stderr.count("LOSSY") == 1
    restored = torch.load(out)
    assert holds(states[1]["model"]["w"], restored["model"]["w"], tpde.Rel(1e-3)).all()
    assert torch.equal(restored["opt"], states[1]["opt"])

    dense = str(tmp_path / "dense.pt")
    torch.save(states[1], dense)
    done = cli("verify", run, "--against", dense, "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"]
    x, y = states[1]["model"]["w"].double(), restored["model"]["w"].double()
    assert report["max_rel"] == pytest.approx(float(((y - x).abs() / x.abs()).max()))
    wrong = {**states[1], "model": {**states[1]["model"], "w": states[1]["model"]["w"] * 1.01}}
    torch.save(wrong, dense)
    done = cli("verify", run, "--against", dense)
    assert done.returncode == 1 and "model/w" in done.stderr + done.stdout


def test_attach_saves_under_a_bound(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = str(tmp_path / "run")
    handle = tpde.attach(model, opt, run, every_n_steps=1, error_bound={"model/*": tpde.Rel(1e-3)})
    saved = []
    for _ in range(3):
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
    handle.remove()
    reader = tpde.Checkpointer(run)
    assert reader.steps() == [1, 2, 3]
    for step, want in zip(reader.steps(), saved):
        got = reader.load(step)
        for k, v in want.items():
            assert holds(v, got["model"][k], tpde.Rel(1e-3)).all()
        assert reader.chain.manifest(step).lossy
