"""Where a model's state dict sits in a stored checkpoint: the usual containers (Lightning's
``state_dict``, ``{"model": ...}``, the checkpoint itself) and key prefixes, matched by name
and shape against a model. ``mount``, ``load_state_dict`` and the CLI's safetensors output
share it."""

from __future__ import annotations

from typing import Any, Iterator

from tpde.errors import TPDEError

#: Containers a model's state dict is commonly saved under (Lightning, ``attach``, plain).
CONTAINERS = ("state_dict", "model", "module", "")


def items(node: Any) -> Iterator[tuple[Any, Any]]:
    """Key/value pairs of a skeleton dict, plain or tagged (``$dict``)."""
    if isinstance(node, dict) and "$dict" in node:
        for k, v in node["$dict"]:
            yield k, v
    elif isinstance(node, dict) and not any(str(k).startswith("$") for k in node):
        yield from node.items()


def tensor_leaves(node: Any) -> dict[str, dict[str, Any]]:
    """Stored tensors by key: views of spans, or a sharded step's items (with their shape)."""
    return {str(k): v for k, v in items(node)
            if isinstance(v, dict) and ("$t" in v or ("$dcp" in v and "shape" in v))}


def match(skeleton: Any, shapes: dict[str, tuple[int, ...]]
          ) -> tuple[dict[str, dict[str, Any]], str, str]:
    """The stored tensors of the model's keys (of the same shapes): searched in the usual
    containers, with a key prefix. Returns (key -> view node, container, prefix), best first.
    """
    keys = list(shapes)
    best: tuple[int, dict[str, dict[str, Any]], str, str] = (-1, {}, "", "")
    top = dict(items(skeleton))
    for name in CONTAINERS:
        node = skeleton if name == "" else top.get(name)
        stored = tensor_leaves(node)
        if not stored:
            continue
        prefixes = {""} | {s[: -len(k)] for s in stored for k in keys[:50] if s.endswith("." + k)}
        for prefix in prefixes:
            found = {k: stored[prefix + k] for k in keys if prefix + k in stored
                     and tuple(stored[prefix + k].get("shape", ())) == shapes[k]}
            if len(found) > best[0]:
                best = (len(found), found, name, prefix)
    return best[1], best[2], best[3]


def tied(tensors: dict[str, Any]) -> dict[str, list[str]]:
    """Each state-dict key's other names for the same tensor (tied weights, such as a language
    model's output layer and its embedding): a save may have written it under one of them."""
    names: dict[int, list[str]] = {}
    for k, v in tensors.items():
        names.setdefault(id(v), []).append(k)
    return {k: [o for o in group if o != k] for group in names.values() if len(group) > 1
            for k in group}


def match_all(skeleton: Any, shapes: dict[str, tuple[int, ...]], *, run: str, step: int,
              ties: dict[str, list[str]] | None = None
              ) -> tuple[dict[str, dict[str, Any]], str, str]:
    """``match``, where every one of the model's keys must be found (or, for a tied weight,
    one of its other names, ``tied``): a model of another architecture is an error, not a
    partial (or empty) state dict."""
    found, container, prefix = match(skeleton, shapes)
    for k, others in (ties or {}).items():
        alias = next((o for o in others if o in found), None)
        if k not in found and alias is not None:
            found[k] = found[alias]
    missing = [k for k in shapes if k not in found]
    if missing:
        raise TPDEError(f"the step has no stored tensor for {len(missing)} of the model's "
                        f"{len(shapes)} state-dict keys of the same shape (first: "
                        f"{missing[:3]}); build the model whose checkpoint this is",
                        run=run, step=step)
    return found, container, prefix


def weights_key(skeleton: Any) -> str | None:
    """The top-level key holding a model's state dict in the usual layouts (Lightning's
    ``state_dict``, ``{"model": ...}``), or None when the checkpoint is a state dict itself."""
    top = dict(items(skeleton))
    return next((name for name in CONTAINERS[:-1] if tensor_leaves(top.get(name))), None)
