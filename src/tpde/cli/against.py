"""How far a restored step is from a dense checkpoint of the same state: the check behind
``tpde verify --against FILE``, for error-bounded steps (where hashes prove only that the
stored words are intact, not how close they are to what training had)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tpde.codec import dtypes, quant, transform
from tpde.errors import TPDEError
from tpde.manifest import Manifest
from tpde.state import tree


@dataclass
class Distance:
    """One tensor's distance: largest absolute and relative errors over finite elements,
    elements that differ in any bit, and whether every element holds the recorded bound
    (an exact tensor: whether it is bit-identical)."""

    name: str
    bound: str | None
    max_abs: float
    max_rel: float
    differing: int
    within: bool

    def as_dict(self) -> dict[str, Any]:
        return vars(self).copy()


def distances(m: Manifest, restored: Any, dense: Any) -> list[Distance]:
    """Every tensor of ``dense`` against the same-named tensor of ``restored`` (both as
    ``torch.load`` gives them), with the bound the step recorded for it."""
    ours = {s.name: s.tensor for s in tree.flatten(restored).spans}
    theirs = tree.flatten(dense).spans
    bounds = {r.span: r.bound for r in m.records}
    missing = [s.name for s in theirs if s.name not in ours]
    if missing or len(theirs) != len(ours):
        extra = sorted(set(ours) - {s.name for s in theirs})
        raise TPDEError(f"the file does not hold the same tensors as step {m.step}: "
                        f"only in the file {missing[:5]}, only in the step {extra[:5]}; "
                        "compare with the dense checkpoint of this very step")
    out = []
    for span in theirs:
        x, y = span.tensor, ours[span.name]
        if x.dtype != y.dtype or x.numel() != y.numel():
            raise TPDEError(f"{span.name!r} is {x.dtype} x {x.numel()} in the file but "
                            f"{y.dtype} x {y.numel()} in step {m.step}")
        bound = bounds.get(span.name)
        b = quant.Bound.from_dict(bound) if bound else None
        differing = int((x.view(torch.uint8) != y.view(torch.uint8)).reshape(x.numel(), -1)
                        .any(1).sum()) if x.numel() else 0
        known = dtypes.BY_TORCH.get(x.dtype)
        fdt = quant.FLOATS[known.name][0] if known and quant.applies(known.name) else None
        if fdt is None:
            out.append(Distance(span.name, None, 0.0, 0.0, differing, differing == 0))
            continue
        word = known.word_dtype
        xw, yw = transform.to_words(x, word), transform.to_words(y, word)
        max_abs, max_rel = quant.errors(xw, yw, fdt)
        ok = differing == 0 or (b is not None and all(
            bool(quant.within(xw[i:i + quant.BLOCK], yw[i:i + quant.BLOCK], fdt, b).all())
            for i in range(0, xw.numel(), quant.BLOCK)))
        out.append(Distance(span.name, str(b) if b else None, max_abs, max_rel, differing, ok))
    return out

