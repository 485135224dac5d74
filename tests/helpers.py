"""Structural, bit-exact comparison of checkpoints (types, key order, strides, ties)."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), path
        assert a.requires_grad == b.requires_grad, path
        assert torch.equal(_bits(a), _bits(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def mixed_codec_chain(run: str, max_inflight_bytes: int = 256 << 20
                      ) -> dict[int, dict[str, torch.Tensor]]:
    """Five steps whose records use every codec (key, sparse, dense, same); the states by step.

    With ``max_inflight_bytes`` below 5 MB the 2.5 MB tensor ``e`` is stored in pieces."""
    import tpde

    g = torch.Generator().manual_seed(0)
    w, e = torch.randn(300, 40, generator=g), torch.randn(20000, 64, generator=g).bfloat16()
    states = {}
    with tpde.Checkpointer(run, keyframe_every=8, max_inflight_bytes=max_inflight_bytes) as ckpt:
        for step in range(5):  # a few scattered changes, dense drift, frozen tensors
            e.view(-1)[torch.randint(0, e.numel(), (50,), generator=g)] += 1
            w.mul_(1.0001)
            states[step] = {"w": w.clone(), "e": e.clone(), "frozen": torch.arange(100),
                            "i": torch.tensor(step)}
            ckpt.save(step, states[step])
    return states


def decode_depths(chain, step: int) -> dict[str, int]:
    """Deltas decoded per tensor to rebuild ``step``, walked from the manifests here."""
    out = {}
    for rec in chain.manifest(step).records:
        n, r = 0, rec
        while r.codec != "key":
            n += r.codec != "same"
            r = chain.manifest(r.ref).record(r.name)
        out[rec.name] = n
    return out
