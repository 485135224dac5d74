"""Split a checkpoint into a JSON skeleton and the tensor storage spans it refers to, and back.

The skeleton keeps every non-tensor value as plain JSON with a few tagged forms (tuples,
non-string keys, OrderedDicts, dtypes, ...).  Tensors become references to *spans*: one
stored span per shared storage, so two names that share memory (tied weights, views) are stored
once and come back sharing memory, with their shapes, strides and offsets, as ``torch.save`` does.
Values the skeleton cannot express are kept as ``torch.save`` bytes and read back with
``torch.load(weights_only=True)``: restoring never runs code from the store unless asked to.
"""

from __future__ import annotations

import base64
import io
import math
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tpde.codec import dtypes
from tpde.errors import FormatError, TPDEError, UnsafeContentError, UnsupportedError

MapLocation = str | torch.device | dict[str, str] | Callable[[str], str] | None


@dataclass
class Span:
    """A flat run of one storage's elements that the checkpoint's tensors view."""

    name: str
    tensor: torch.Tensor  # 1-D, the elements in storage order
    device: str
    #: A pack (``pack``): how many small spans it holds end to end (0: one storage).
    parts: int = 0
    #: The other names of tensors that view this storage (tied weights): a span is named by
    #: its first tensor, and error-bound patterns may name it by any of them.
    also: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.also)


@dataclass
class Flat:
    skeleton: Any
    spans: list[Span] = field(default_factory=list)
    #: Each Python object stored as ``torch.save`` bytes: (its path, the base64 bytes).
    pickles: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Leaves:
    """What a walk over a state sets apart from its skeleton."""
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    pickles: list[tuple[str, str]] = field(default_factory=list)


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _storable(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and t.dtype in dtypes.BY_TORCH
    )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) storage elements a strided tensor touches."""
    first, count = t.storage_offset(), t.numel()
    if count == 0:
        return first, first
    if t.is_contiguous():  # most tensors: no walk over the shape in Python
        return first, first + count
    return first, first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def flatten(state: Any) -> Flat:
    """Split ``state`` into a skeleton and spans; raises nothing for unusual values.

    The walks are module functions, not closures: a closure that calls itself is a reference
    cycle, and one that held the state's tensors kept them alive after the call, until
    Python's collector came by (``unflatten`` held a whole restored state so)."""
    leaves = _Leaves()
    skeleton = _walk(state, "", leaves)
    spans, views = _group(leaves.tensors)
    return Flat(_fill(skeleton, views), spans, leaves.pickles)


def _walk(obj: Any, path: str, leaves: _Leaves) -> Any:
    """``obj``'s skeleton; its storable tensors and pickled objects go to ``leaves``."""
    if isinstance(obj, torch.Tensor) and obj.is_nested:
        raise UnsupportedError(f"the nested tensor at {path.lstrip('/') or '<root>'!r} cannot "
                               "be stored; store its .unbind() (a list of tensors) instead")
    if isinstance(obj, torch.Tensor) and _storable(obj):
        leaves.tensors.append((path, obj))
        return {"$t": len(leaves.tensors) - 1}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if type(obj) is int:
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else {"$f": repr(obj)}
    if type(obj) is complex:
        return {"$c": [_walk(obj.real, path, leaves), _walk(obj.imag, path, leaves)]}
    if type(obj) is bytes:
        return {"$b": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype) and obj in dtypes.BY_TORCH:
        return {"$dtype": dtypes.BY_TORCH[obj].name}
    if type(obj) is torch.Size:
        return {"$size": list(obj)}
    if type(obj) is torch.device:
        return {"$device": str(obj)}
    if type(obj) is list:
        return [_walk(v, f"{path}/{i}", leaves) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return {"$tuple": [_walk(v, f"{path}/{i}", leaves) for i, v in enumerate(obj)]}
    if type(obj) in (dict, OrderedDict):
        items = [(k, _walk(v, f"{path}/{_escape(str(k))}", leaves)) for k, v in obj.items()]
        if type(obj) is dict and all(type(k) is str and not k.startswith("$") for k, _ in items):
            return dict(items)
        out: dict[str, Any] = {"$dict": [[_walk(k, path, leaves), v] for k, v in items]}
        if type(obj) is OrderedDict:
            out["ordered"] = True
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                out["meta"] = _walk(meta, f"{path}/_metadata", leaves)
        return out
    pickled = _pickle(obj, path)
    leaves.pickles.append((path.lstrip("/") or "<root>", pickled))
    return {"$pickle": pickled}


def _fill(node: Any, views: dict[int, dict]) -> Any:
    """``node`` with each tensor leaf replaced by its view of a span."""
    if isinstance(node, dict):
        if set(node) == {"$t"}:
            return views[node["$t"]]
        return {k: _fill(v, views) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, views) for v in node]
    return node


def _pickle(obj: Any, path: str) -> str:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as exc:  # pickle raises many types (PicklingError, AttributeError, ...)
        raise UnsupportedError(f"the {type(obj).__name__} at {path.lstrip('/') or '<root>'!r} "
                               f"cannot be stored ({exc}); store plain data instead") from None
    return base64.b64encode(buf.getvalue()).decode()


def _group(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[Span], dict[int, dict]]:
    """Give every tensor leaf a span: one per storage (and dtype) it lives in."""
    groups: dict[tuple, list[int]] = {}
    for i, (_, t) in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr()
        key = (str(t.device), ptr, t.dtype) if ptr else ("alone", i)
        groups.setdefault(key, []).append(i)

    views: dict[int, dict[str, Any]] = {}
    spans: list[Span] = []
    names: set[str] = set()
    for members in groups.values():
        extents = [_extent(tensors[i][1]) for i in members]
        lo = min(a for a, _ in extents)
        hi = max(b for _, b in extents)
        first = tensors[members[0]][1].detach()
        span = first.as_strided((hi - lo,), (1,), lo)
        name = tensors[members[0]][0].lstrip("/") or "<root>"
        while name in names:  # keys 1 and "1" share a path; names must stay unique
            name += "'"
        names.add(name)
        also = tuple(dict.fromkeys(p.lstrip("/") for p, _ in (tensors[i] for i in members[1:])
                                   if p.lstrip("/") != name))
        spans.append(Span(name, span, str(first.device), also=also))
        for i in members:
            t = tensors[i][1]
            views[i] = {
                "$t": len(spans) - 1,
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "offset": t.storage_offset() - lo,
                # (``_storable`` let in exactly these two types; the metaclass's isinstance
                # took a large share of a flatten of many small tensors.)
                "param": type(t) is torch.nn.Parameter,
                "grad": bool(t.requires_grad),
            }
    return spans, views


#: What packs hold: the dtypes ``torch.cat`` joins on every device.
PACKABLE = frozenset((torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                      torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))


def pack(flat: Flat, below: int, most: int, apart: Callable[[Span], bool] | None = None) -> Flat:
    """``flat`` with its spans of fewer than ``below`` bytes joined end to end into packs of at
    most ``most`` bytes, by top-level key, device and dtype: each a span of its own, named
    ``<key>/<pack dtype>``, which the skeleton's tensors view by their ``part`` (where their
    own span starts in it, and its elements). By top-level key, so that loading a model's
    weights alone decodes none of its optimizer's state.

    A checkpoint holds many tiny tensors (biases, norms, their optimizer moments, Adam's step
    counts: most of a Lightning model's), and a save spends about as much on each as on a
    tensor of 64 KiB; packed, saves and removals of such states take markedly less time.
    ``apart`` keeps spans out (those saved
    under an error bound); a span that is a pack already stays as it is."""
    groups: dict[tuple[str, str, torch.dtype], list[list[int]]] = {}
    filled: dict[tuple[str, str, torch.dtype], int] = {}  # bytes in each group's last pack
    for i, s in enumerate(flat.spans):
        t = s.tensor
        size = t.numel() * t.element_size()
        if s.parts or t.dtype not in PACKABLE or not 0 < size < below \
                or (apart is not None and apart(s)):
            continue
        key = (s.name.split("/", 1)[0] if "/" in s.name else "", s.device, t.dtype)
        runs = groups.setdefault(key, [])
        if not runs or filled[key] + size > most:
            runs.append([])
            filled[key] = 0
        runs[-1].append(i)
        filled[key] += size
    packs = [(key, k, run) for key, runs in groups.items() for k, run in enumerate(runs)
             if len(run) > 1]
    if not packs:
        return flat
    packed = {i for *_, run in packs for i in run}
    spans = [s for i, s in enumerate(flat.spans) if i not in packed]
    where = {i: k for k, i in enumerate(i for i in range(len(flat.spans)) if i not in packed)}
    parts: dict[int, tuple[int, int, int]] = {}
    names = {s.name for s in spans}
    for (top, _, dtype), k, run in packs:
        members = [flat.spans[i] for i in run]
        name = f"{top}/" if top else ""
        name += f"<pack {dtypes.BY_TORCH[dtype].name}{f' {k}' if k else ''}>"
        while name in names:  # a pack is a span: its name is unique among them
            name += "'"
        names.add(name)
        at = 0
        for i, s in zip(run, members):
            parts[i] = (len(spans), at, s.tensor.numel())
            at += s.tensor.numel()
        spans.append(Span(name, torch.cat([s.tensor.detach() for s in members]),
                          members[0].device, parts=len(run)))
    return Flat(_repoint(flat.skeleton, where, parts), spans, flat.pickles)


def _repoint(node: Any, where: dict[int, int], parts: dict[int, tuple[int, int, int]]) -> Any:
    """``node`` with each tensor leaf viewing its span's new place (``pack``); new dicts, since
    a skeleton may be a manifest's own."""
    if isinstance(node, list):
        return [_repoint(v, where, parts) for v in node]
    if not isinstance(node, dict):
        return node
    i = node.get("$t")
    if isinstance(i, int):
        if i in parts:
            p, at, n = parts[i]
            return {**node, "$t": p, "part": [at, n]}
        return {**node, "$t": where[i]}
    return {k: _repoint(v, where, parts) for k, v in node.items()}


def part_range(part: Any, size: int) -> tuple[int, int]:
    """A tensor leaf's ``part`` of a pack of ``size`` elements, as (start, count), checked."""
    if type(part) is not list or len(part) != 2 or not all(type(v) is int for v in part) \
            or part[0] < 0 or part[1] < 0 or part[0] + part[1] > size:
        raise FormatError(f"skeleton part {part!r} does not fit its pack of {size} elements")
    return part[0], part[1]


def resolve_device(device: str, map_location: MapLocation) -> torch.device:
    if map_location is None:
        return torch.device(device)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(device, device))
    return torch.device(map_location(device))


def unflatten(skeleton: Any, spans: list[torch.Tensor], *, trusted: bool = False,
              sharded: dict[str, Any] | None = None) -> Any:
    """Rebuild the checkpoint from its skeleton and restored span tensors (and, for a sharded
    step, the values of its ``$dcp`` items by name)."""
    return _Builder(spans, trusted, sharded).build(skeleton)


class _Builder:
    """What ``unflatten`` builds with: methods, not closures that call themselves, whose cycle
    kept the restored tensors alive until Python's collector came by (``flatten``)."""

    def __init__(self, spans: list[torch.Tensor], trusted: bool,
                 sharded: dict[str, Any] | None) -> None:
        self.spans, self.trusted, self.sharded = spans, trusted, sharded
        self.made: dict[tuple, torch.Tensor] = {}
        self.parts: dict[tuple[int, int, int], torch.Tensor] = {}

    def base(self, i: int, part: Any) -> torch.Tensor:
        """What a tensor leaf views: its span, or its part of a pack, copied into a storage of
        its own as it was saved (a restored bias does not keep its whole pack alive)."""
        span = self.spans[i]
        if part is None:
            return span
        start, count = part_range(part, span.numel())
        key = (i, start, count)
        if key not in self.parts:
            self.parts[key] = span[start : start + count].clone()
        return self.parts[key]

    def view(self, node: dict[str, Any]) -> torch.Tensor:
        i = node["$t"]
        if not isinstance(i, int) or not 0 <= i < len(self.spans):
            raise FormatError(f"skeleton refers to span {i!r} of {len(self.spans)}")
        part = node.get("part")
        key = (i, tuple(node["shape"]), tuple(node["stride"]), node["offset"],
               bool(node.get("param")), bool(node.get("grad")), repr(part))
        if key in self.made:
            return self.made[key]
        base = self.base(i, part)
        try:
            t = base.as_strided(node["shape"], node["stride"], node["offset"])
            if _extent(t)[1] > base.numel() or node["offset"] < 0:
                raise ValueError
        except (RuntimeError, ValueError, TypeError):
            raise FormatError(f"skeleton view {key[1:4]} does not fit its span") from None
        if node.get("param"):
            t = torch.nn.Parameter(t, requires_grad=bool(node.get("grad")))
        elif node.get("grad") and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        self.made[key] = t
        return t

    def build(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.build(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$t" in node:
            return self.view(node)
        if "$dcp" in node:
            if self.sharded is None or node["$dcp"] not in self.sharded:
                raise FormatError(f"skeleton names DCP item {node['$dcp']!r}, which the step "
                                  "does not hold")
            return self.sharded[node["$dcp"]]
        if "$f" in node:
            return float(node["$f"])
        if "$c" in node:
            return complex(*node["$c"])
        if "$b" in node:
            return base64.b64decode(node["$b"])
        if "$dtype" in node:
            return dtypes.by_name(node["$dtype"]).torch_dtype
        if "$size" in node:
            return torch.Size(node["$size"])
        if "$device" in node:
            return torch.device(node["$device"])
        if "$tuple" in node:
            return tuple(self.build(v) for v in node["$tuple"])
        if "$dict" in node:
            pairs = [(_hashable(self.build(k)), self.build(v)) for k, v in node["$dict"]]
            if not node.get("ordered"):
                return dict(pairs)
            od = OrderedDict(pairs)
            if "meta" in node:
                od._metadata = self.build(node["meta"])  # type: ignore[attr-defined]
            return od
        if "$pickle" in node:
            return _unpickle(node["$pickle"], self.trusted)
        return {k: self.build(v) for k, v in node.items()}


def keys(skeleton: Any) -> list[Any]:
    """The top-level keys of a stored checkpoint that is a dict (none otherwise)."""
    if isinstance(skeleton, dict) and "$dict" in skeleton:
        return [k for k, _ in skeleton["$dict"] if not isinstance(k, (dict, list))]
    if isinstance(skeleton, dict) and not any(str(k).startswith("$") for k in skeleton):
        return list(skeleton)
    return []


def part(skeleton: Any, key: str) -> Any:
    """The skeleton of ``checkpoint[key]`` (None when the checkpoint has no such key)."""
    if isinstance(skeleton, dict) and "$dict" in skeleton:
        return next((v for k, v in skeleton["$dict"] if k == key), None)
    if isinstance(skeleton, dict) and not any(str(k).startswith("$") for k in skeleton):
        return skeleton.get(key)
    return None


def span_indices(skeleton: Any) -> set[int]:
    """The spans a skeleton's tensors view: what decoding it needs."""
    out: set[int] = set()
    todo = [skeleton]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("$t"), int):
                out.add(node["$t"])
            else:
                todo.extend(node.values())
    return out


def sharded_items(skeleton: Any) -> list[str]:
    """The DCP items (``$dcp`` leaves) a sharded step's skeleton holds, in order."""
    out: list[str] = []
    todo = [skeleton]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(reversed(node))
        elif isinstance(node, dict):
            if isinstance(node.get("$dcp"), str):
                out.append(node["$dcp"])
            else:
                todo.extend(reversed(list(node.values())))
    return out


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


def _unpickle(data: str, trusted: bool) -> Any:
    try:
        return torch.load(io.BytesIO(base64.b64decode(data)), weights_only=not trusted,
                          map_location="cpu")
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... here
        raise load_error(exc, "", trusted, "a stored Python object cannot be read "
                         "(damaged?)") from None


def refused_pickles(pickles: list[tuple[str, str]], known: dict[int, str | None]
                    ) -> Iterator[tuple[str, str]]:
    """Each of ``pickles`` (a ``Flat``'s) that torch's weights-only unpickler refuses, as (its
    path, the global it refuses). ``known``: what each object (by the hash of its bytes) was
    found to need, so that a run saving the same objects at every step unpickles each once."""
    for where, pickled in pickles:
        key = hash(pickled)
        if key not in known:
            known[key] = None
            try:
                torch.load(io.BytesIO(base64.b64decode(pickled)), weights_only=True,
                           map_location="cpu")
            except Exception as exc:  # the same many types as _unpickle's
                blocked = _BLOCKED.search(_ANSI.sub("", str(exc)))
                known[key] = blocked[1] if blocked else type(exc).__name__
        if known[key] is not None:
            yield where, known[key]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BLOCKED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_NOT_FOUND = re.compile(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'")


def load_error(exc: BaseException, where: str, trusted: bool, damaged: str) -> TPDEError:
    """The error to raise for a ``torch.load`` that failed: a type the weights-only unpickler
    blocks, a class that cannot be imported, or (anything else) ``damaged``."""
    text = _ANSI.sub("", str(exc))  # torch bolds parts of its explanation with escape codes
    at = f"{where}: " if where else ""
    blocked = _BLOCKED.search(text)
    if blocked and not trusted:
        return UnsafeContentError(
            f"{at}restoring needs to unpickle {blocked[1]}, which is outside torch's "
            "weights-only allowlist. If you trust where it came from, pass trusted=True "
            "(CLI: --trusted), or allowlist the type with "
            f"torch.serialization.add_safe_globals([{blocked[1]}])")
    missing = _NOT_FOUND.search(text)
    if missing or isinstance(exc, ModuleNotFoundError):
        cls, module = missing.groups() if missing else ("a class", getattr(exc, "name", "?"))
        main = sys.modules.get("__main__")
        if module == getattr(getattr(main, "__spec__", None), "name", None):
            module = "__main__"  # a program run with -m: its __main__ is named by its spec
        hint = (" A class defined in a training script lives in '__main__' only while that "
                "script runs: move it into a module, or load from within the script."
                if module == "__main__" else "")
        return UnsupportedError(
            f"{at}the stored object is of class {cls} from module '{module}', which must "
            f"be importable to restore it.{hint}")
    detail = text.split("WeightsUnpickler error:")[-1].strip()  # past torch's general advice
    first = (detail.splitlines() or [type(exc).__name__])[0][:200]
    return FormatError(f"{at}{damaged}: {first}")
