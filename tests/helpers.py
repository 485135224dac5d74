"""Structural, bit-exact comparison of checkpoints (types, key order, strides, ties), and the
chains and decode paths several test files share."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tpde.codec import unframe

#: A test run with frames decompressed by ``tpde.codec._zframes`` and by zstandard.
ZSTD = pytest.mark.parametrize("z", [True, False], ids=["zframes", "zstandard"])


def zstd_path(mp: pytest.MonkeyPatch, z: bool) -> None:
    """Frames decompressed by ``tpde.codec._zframes`` (the system's libzstd, outside the GIL) or,
    as where it found none, by zstandard."""
    if z and unframe.zframes is None:
        pytest.skip("no zstd library was found for tpde.codec._zframes")
    if not z:
        mp.setattr(unframe, "zframes", None)


#: A mount whose modules are rebuilt by ``tpde.codec._rebuild`` in one call, and by the Python path.
NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "python"])


def native_path(mp: pytest.MonkeyPatch, on: bool) -> None:
    """Mounts made from here on rebuild their modules natively (``tpde.chain.native``) or, as
    where ``tpde.codec._rebuild`` is not built, through ``Chain.materialize``."""
    from tpde.chain import native

    if on and not native.available():
        pytest.skip("tpde.codec._rebuild not built, or no libzstd found")
    if not on:
        mp.setattr(native, "available", lambda: False)


def flip_bit(run: str, m: Any, rec: Any, at: int | None = None) -> None:
    """Damage ``rec`` (a record of manifest ``m`` in local run ``run``) in place: one bit of
    its values section, ``at`` bytes into it (its middle by default)."""
    s = rec.sections["values"]
    with open(os.path.join(run, m.blob_of(rec)), "r+b") as f:
        f.seek(s.offset + (s.length // 2 if at is None else at))
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    found = difference(a, b, path)
    assert found is None, found


def difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ, or None: types (exactly), key order and ``_metadata``,
    tensors' dtype, shape, strides, ``requires_grad`` and every bit, and which tensors share
    storage (tied weights) on either side."""
    return _difference(a, b, path, ({}, {}))


def _difference(a: Any, b: Any, path: str, ties: tuple[dict, dict]) -> str | None:
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} instead of {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return f"{path}: {a.dtype}{list(a.shape)} instead of {b.dtype}{list(b.shape)}"
        if a.stride() != b.stride():
            return f"{path}: strides {a.stride()} instead of {b.stride()}"
        if a.requires_grad != b.requires_grad:
            return f"{path}: requires_grad {a.requires_grad} instead of {b.requires_grad}"
        if not torch.equal(_bits(a), _bits(b)):
            return f"{path}: different bits"
        shared = [_tie(t, path, seen) for t, seen in zip((a, b), ties)]
        if shared[0] != shared[1]:
            return (f"{path}: shares storage with {shared[0] or 'nothing'} instead of "
                    f"{shared[1] or 'nothing'}")
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} instead of {list(b)}"
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return f"{path}: _metadata differs"
        return next((d for k in a if (d := _difference(a[k], b[k], f"{path}/{k}", ties))),
                    None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {type(a).__name__} of {len(a)} instead of {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := _difference(x, y, f"{path}/{i}", ties))), None)
    if isinstance(a, float) and a != a:
        return None if b != b else f"{path}: nan instead of {b!r}"
    return None if a == b else f"{path}: {a!r} instead of {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tie(t: torch.Tensor, path: str, seen: dict[int, str]) -> str | None:
    """The first path seen with ``t``'s storage (None: its own), recording ``t``'s. A tensor
    of no elements reads and writes nothing of any storage: two empty views of one are
    restored as views of an empty span."""
    storage = t.untyped_storage()
    if t.numel() == 0 or storage.nbytes() == 0 or t.device.type == "meta":
        return None
    key = storage.data_ptr()
    if key in seen:
        return seen[key]
    seen[key] = path
    return None


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
            states[step] = {"w": w.clone(), "e": e.clone(), "frozen": torch.arange(1000),
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
