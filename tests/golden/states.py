"""The states of the golden chain: exact arithmetic only, so any torch version rebuilds them."""

from __future__ import annotations

from collections import OrderedDict

import torch


def golden_states() -> list[dict]:
    i = torch.arange(4096)
    w = ((torch.arange(65536) * 37 % 512 - 256) / 8).to(torch.bfloat16).reshape(256, 256)
    f = ((i - 2048) / 64.0).to(torch.float32)
    counts = torch.arange(100, dtype=torch.int64)
    frozen = (i[:1000] % 7).to(torch.float16)
    states = []
    for step in range(5):
        if step:
            w = w.clone()
            k = torch.arange(100)
            w.view(-1)[(k * k * 7919 + step * 104729) % 65536] += 1  # sparse, scattered
            f = f + 2.0**-10  # dense, small differences
        sd = OrderedDict(w=w, tied=w, f=f, frozen=frozen)
        sd._metadata = OrderedDict({"": {"version": 1}})
        states.append({
            "model": sd, "counts": counts, "t8": (torch.ones(3) * step).to(torch.float8_e4m3fn),
            "b": torch.tensor([True, False, step % 2 == 0]), "c": torch.tensor([1 + 2j, step * 1j]),
            "meta": {"step": step, "lr": 0.5**step, "names": ("a", "b"), 3: None, "s": {1, 2}},
        })
    return states


def detour(state: dict) -> dict:
    """A state one step away from ``state``: the steps of chain-v3 that are removed, so that the
    kept ones are re-based. Exact arithmetic on the bf16 and fp32 tensors; the rest as it is."""
    sd = OrderedDict(state["model"])
    sd._metadata = state["model"]._metadata
    w = sd["w"].clone()
    w.view(-1)[::97] += 2
    sd["w"] = sd["tied"] = w
    sd["f"] = sd["f"] - 2.0**-9
    return {**state, "model": sd}


def lossy_states() -> list[dict]:
    """The golden states plus a tensor of edge values (NaN, Inf, zeros of both signs,
    subnormals), for chain-v4: error-bounded records."""
    out = []
    for step, state in enumerate(golden_states()):
        edge = (torch.arange(4096) % 509 - 254).to(torch.float32) / 16
        edge[::401] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                    -3e-39, 1.5, -2.25, 1000.0, 7.0])
        edge = edge * (1 + step / 8)  # subnormals change: they can only be stored exactly
        out.append({**state, "edge": edge})
    return out


#: chain-v4's bounds: relative on bf16 and fp32, absolute on fp32, one on integers (kept exact).
LOSSY_BOUNDS = {"model/w": ("rel", 1e-2), "model/f": ("abs", 2.0**-12), "edge": ("rel", 1e-3),
                "counts": ("rel", 1e-3)}


def sharded_states() -> list[dict]:
    """The states of chain-v5, saved by two ranks through torch.distributed.checkpoint: a
    tensor sharded by rows (dense fp32 changes), one by columns (sparse bf16 changes), a
    replicated one (unchanged) and plain values."""
    rows = ((torch.arange(64 * 48) * 37 % 512 - 256) / 8).reshape(64, 48).float()
    cols = ((torch.arange(40 * 30) * 11 % 256 - 128) / 4).reshape(40, 30).bfloat16()
    rep = torch.arange(16, dtype=torch.float32)
    states = []
    for step in range(4):
        if step:
            rows = rows + 2.0**-10
            cols = cols.clone()
            k = torch.arange(40)
            cols.view(-1)[(k * k * 7919 + step * 104729) % 1200] += 1
        states.append({"model": {"rows": rows, "cols": cols, "rep": rep},
                       "meta": {"step": step, "lr": 0.5**step}})
    return states


def packed_states() -> list[dict]:
    """The golden states plus a model's worth of small tensors, for chain-v7 (packs): fp32
    biases of which some change at each step, a Parameter, two views of one storage, and int64
    step counts that change every other step."""
    shared = torch.arange(48, dtype=torch.float32) / 4
    out = []
    for step, state in enumerate(golden_states()):
        biases = [(torch.arange(16 + 8 * k, dtype=torch.float32) - k) / 16 + (step if k % 3 == 0
                                                                              else 0)
                  for k in range(12)]
        counts = [torch.tensor(step // 2 * 10 + k, dtype=torch.int64) for k in range(4)]
        head = torch.nn.Parameter(torch.arange(32, dtype=torch.float32) / 8 + step / 2)
        out.append({**state, "small": {"biases": biases, "counts": counts, "head": head,
                                       "a": shared[:20], "b": shared[10:40]}})
    return out
