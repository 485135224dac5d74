"""Shared pieces of the reliability campaigns: deterministic chains and bit-exact checks."""

from __future__ import annotations

from typing import Any

import torch

import tpde


def state_at(step: int) -> dict[str, Any]:
    """A small training-like state: bf16 weights with sparse updates, fp32 drift, a frozen part."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(128, 128, generator=g).bfloat16()
    f = torch.randn(4000, generator=g)
    for s in range(1, step + 1):
        g.manual_seed(s)
        w.view(-1)[torch.randint(0, w.numel(), (200,), generator=g)] += 1
        f = f + 1e-3 * torch.randn(4000, generator=g)
    return {"w": w, "f": f, "frozen": torch.ones(1000), "meta": {"step": step}}


def build(url: str, options: dict | None, steps: int, *, keyframe_every: int = 3,
          pieces: bool = False) -> dict[int, dict]:
    """Commit ``steps`` steps to a new run; returns what each step must restore to. With
    ``pieces`` the two large tensors are stored in 8 kB pieces (6 records)."""
    ck = tpde.Checkpointer(url, storage_options=options, keyframe_every=keyframe_every,
                           chunk_bytes=4096, max_inflight_bytes=16384 if pieces else 256 << 20)
    expected = {}
    with ck:
        for step in range(steps):
            expected[step] = state_at(step)
            ck.save(step, expected[step])
    return expected
