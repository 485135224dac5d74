"""Sharded steps (format 5, written through ``torch.distributed.checkpoint``) rebuilt in one
process: each tensor whole from the chunks its ranks saved, each byte item unpickled, in the
nested layout the save planner flattened, so that every front end (``Checkpointer.load``, the
CLI's ``restore``, ``load_state_dict``, ``mount``) reads them as it reads any step."""

from __future__ import annotations

import io
from typing import Any

import torch

from tpde.codec import dtypes
from tpde.errors import FormatError
from tpde.manifest import Manifest
from tpde.state import tree


def item_records(m: Manifest, fqn: str) -> list[str]:
    """The records of one DCP item: every chunk's, in the order the step lists them."""
    d = m.dcp or {}
    if fqn in d.get("tensors", {}):
        return [n for c in d["tensors"][fqn]["chunks"] for n in c["records"]]
    if fqn in d.get("bytes", {}):
        return list(d["bytes"][fqn]["records"])
    raise FormatError(f"the step's DCP metadata has no item {fqn!r}", step=m.step)


def assemble(m: Manifest, fqn: str, words: dict[str, torch.Tensor],
             device: torch.device | None = None) -> torch.Tensor:
    """Tensor ``fqn`` whole, from its chunks' words (taken out of ``words``)."""
    t = m.dcp["tensors"][fqn]
    dtype = dtypes.by_name(t["dtype"]).torch_dtype
    whole = torch.empty(t["size"], dtype=dtype, device=device)
    covered = 0
    for c in t["chunks"]:
        parts = [words.pop(n) for n in c["records"]]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        try:
            chunk = flat.view(torch.uint8).view(dtype).reshape(c["sizes"])
            target = whole
            for dim, (start, size) in enumerate(zip(c["offsets"], c["sizes"])):
                target = target.narrow(dim, start, size)
            target.copy_(chunk)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise FormatError(f"chunk at {c['offsets']} does not fit the tensor ({exc})",
                              step=m.step, tensor=fqn) from None
        covered += chunk.numel()
    if covered != whole.numel():
        raise FormatError(f"the chunks cover {covered} of {whole.numel()} elements",
                          step=m.step, tensor=fqn)
    return whole


def unpickled(m: Manifest, fqn: str, words: dict[str, torch.Tensor], trusted: bool) -> Any:
    """A DCP byte item (a ``torch.save`` stream) as the object it holds."""
    raw = b"".join(words.pop(n).view(torch.uint8).numpy().tobytes()
                   for n in item_records(m, fqn))
    try:
        return torch.load(io.BytesIO(raw), weights_only=not trusted, map_location="cpu")
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... here
        raise tree.load_error(exc, "", trusted, "a stored Python object cannot be read "
                              "(damaged?)").located(step=m.step, tensor=fqn) from None


def values(m: Manifest, fqns: list[str], words: dict[str, torch.Tensor],
           map_location: tree.MapLocation, trusted: bool) -> dict[str, Any]:
    """Every item of ``fqns`` rebuilt: tensors whole (where ``map_location`` puts a CPU
    tensor), byte items unpickled."""
    device = tree.resolve_device("cpu", map_location)
    out = {}
    for fqn in fqns:
        if fqn in m.dcp["tensors"]:
            out[fqn] = assemble(m, fqn, words, device)
        else:
            out[fqn] = unpickled(m, fqn, words, trusted)
    return out
