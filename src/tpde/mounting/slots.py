"""Which stored records each module of a mounted model needs, and how its tensors view them.

Made once, when a model is mounted, from the step's manifest and the model's state dict: for
every unit (a module whose weights are decoded together) the tensors it owns, each as a
``Slot``. ``tpde.mount`` decides when a unit's records are decoded and when they are released;
nothing here decodes or holds weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tpde.chain import Chain, sharded, span_places
from tpde.codec import dtypes
from tpde.errors import TPDEError
from tpde.manifest import Manifest
from tpde.runtime import heap
from tpde.state import keys, tree


@dataclass(frozen=True)
class Slot:
    """One stored tensor of the model: which records hold its span (one, or the span's pieces)
    and how it views that span."""

    key: str
    records: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    #: A sharded step's tensor: its DCP item, put together from its chunks' records.
    dcp: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.BY_TORCH[self.dtype].itemsize


#: A tensor a unit owns: the module that holds it, its attribute there, whether it is a
#: parameter (else a buffer), and its slot.
Owned = tuple[str, str, bool, Slot]


@dataclass
class Layout:
    """A mounted model's tensors, by unit. ``packs`` are the records that hold several small
    tensors (``tree.pack``), ``stored`` the model's state-dict keys the step holds."""

    units: dict[str, list[Owned]]
    packs: set[str]
    stored: set[str]


#: Modules whose forward reads their children's weights directly (not through the children's
#: forward): their whole subtree is decoded as one unit.
UNITS: tuple[type, ...] = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                           torch.nn.TransformerDecoderLayer)


def layout(chain: Chain, step: int, model: torch.nn.Module, units: tuple[type, ...]) -> Layout:
    """Every state-dict tensor of ``model`` matched to the step's stored tensor of the same
    name (under a prefix or container) and shape, grouped by the unit that decodes it."""
    units = UNITS + tuple(units)
    m = chain.manifest(step)
    tensors = model.state_dict(keep_vars=True)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    found, _, _ = keys.match_all(m.skeleton, shapes, run=chain.url, step=step,
                                 ties=keys.tied(tensors))
    spans = m.spans()
    out: dict[str, list[Owned]] = {}
    for key, node in found.items():
        if "$dcp" in node:
            slot = _sharded_slot(chain, step, m, key, node["$dcp"])
        else:
            i = node["$t"]
            if not isinstance(i, int) or not 0 <= i < len(spans):
                raise TPDEError(f"skeleton refers to span {i!r}", run=chain.url, step=step)
            recs = spans[i]
            # A tensor of a pack views its part of the pack's words (``tree.pack``).
            try:
                start = 0 if "part" not in node else \
                    tree.part_range(node["part"], sum(r.numel for r in recs))[0]
            except TPDEError as exc:
                raise exc.located(run=chain.url, step=step, tensor=key) from None
            slot = Slot(key, tuple(r.name for r in recs),
                        dtypes.by_name(recs[0].dtype).torch_dtype, tuple(node["shape"]),
                        tuple(node["stride"]), start + int(node["offset"]))
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner)
        out.setdefault(_unit(model, owner, units), []).append(
            (owner, attr, attr in module._parameters, slot))
    return Layout(out, {r.name for r in m.records if r.parts}, set(found))


def span_buffers(chain: Chain, step: int, owned: list[Owned],
                 alloc: Callable[[int, torch.dtype], torch.Tensor]
                 ) -> tuple[dict[tuple[str, ...], torch.Tensor], dict[str, torch.Tensor]]:
    """One host buffer per span of ``owned`` stored in pieces (``alloc(words, word dtype)``),
    and each piece's place in it:
    the pieces are rebuilt there, not put together after in fresh pages, which made a
    forward at budget 0 markedly slower for a large embedding in pieces."""
    whole: dict[tuple[str, ...], torch.Tensor] = {}
    into: dict[str, torch.Tensor] = {}
    m = chain.manifest(step)
    for *_, s in owned:
        if len(s.records) > 1 and s.dcp is None and s.records not in whole:
            whole[s.records], places = span_places([m.record(n) for n in s.records], alloc)
            into.update(places)
    return whole, into


def in_heap(count: int, word_dtype: torch.dtype) -> torch.Tensor:
    """``count`` words from the heap (``heap.in_heap``)."""
    return torch.from_numpy(heap.in_heap(count * word_dtype.itemsize)).view(word_dtype)


def in_arena(arena: heap.Arena) -> Callable[[int, torch.dtype], torch.Tensor]:
    """Words from ``arena``, back there once the last tensor viewing them is freed."""
    return lambda count, word_dtype: \
        torch.from_numpy(arena.take(count * word_dtype.itemsize)).view(word_dtype)


def _unit(model: torch.nn.Module, owner: str, units: tuple[type, ...]) -> str:
    """The outermost ancestor of ``owner`` (itself included) that is a unit, else ``owner``."""
    parts = owner.split(".") if owner else []
    for depth in range(len(parts) + 1):
        name = ".".join(parts[:depth])
        if isinstance(model.get_submodule(name), units):
            return name
    return owner


def _sharded_slot(chain: Chain, step: int, m: Manifest, key: str, fqn: str) -> Slot:
    t = (m.dcp or {}).get("tensors", {}).get(fqn)
    if t is None:
        raise TPDEError(f"the step's DCP metadata has no tensor {fqn!r}",
                        run=chain.url, step=step, tensor=fqn)
    shape = tuple(t["size"])
    stride = tuple(torch.empty(shape, device="meta").stride())
    return Slot(key, tuple(sharded.item_records(m, fqn)),
                dtypes.by_name(t["dtype"]).torch_dtype, shape, stride, 0, dcp=fqn)
