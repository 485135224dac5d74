"""What a rebuilt step hands its front ends: each tensor's span put together from the words of
the records it is stored in, and what an error-bounded step says about its bounds."""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from tpde.codec import dtypes, quant
from tpde.errors import LossyWarning
from tpde.manifest import Record


def span_places(recs: list[Record], empty: Callable[[int, torch.dtype], torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One buffer of host words for a span stored in pieces (``empty(count, word dtype)``
    makes it), and each piece's place in it, by record name: ``materialize(into=)`` rebuilds
    the pieces there, not into tensors of their own that are then put together."""
    dt = dtypes.by_name(recs[0].dtype)
    sizes = [r.numel * dt.words_per_element for r in recs]
    whole, places, at = empty(sum(sizes), dt.word_dtype), {}, 0
    for r, k in zip(recs, sizes):
        places[r.name], at = whole[at : at + k], at + k
    return whole, places


def span_words(names: Iterable[str], words: dict[str, torch.Tensor],
               device: torch.device | None = None, *, consume: bool = False) -> torch.Tensor:
    """One span's words from the words of its records (named in ``Manifest.spans`` order), on
    ``device`` (None: where they are); a copy whenever they move or the span has pieces.
    ``consume`` takes the records' words out of ``words`` as they are used, so that pieces are
    freed while the span fills."""
    names = list(names)
    take = words.pop if consume else words.__getitem__
    if len(names) == 1:
        part = take(names[0])
        return part.to(device if device is not None else part.device, copy=device is not None)
    first = words[names[0]]
    whole = torch.empty(sum(words[n].numel() for n in names), dtype=first.dtype,
                        device=device if device is not None else first.device)
    at = 0
    for name in names:
        part = take(name)
        whole[at : at + part.numel()].copy_(part)
        at += part.numel()
    return whole


def lossy_summary(records: Iterable[Record]) -> str | None:
    """What an error-bounded step restores, in a line (None: every record is exact)."""
    lossy: dict[str, Record] = {}
    for r in records:
        if r.error is not None:
            lossy.setdefault(r.span, r)
    if not lossy:
        return None
    worst = max(lossy.values(), key=lambda r: r.error["rel"])
    bounds = sorted({str(quant.Bound.from_dict(r.bound)) for r in lossy.values()})
    return (f"{len(lossy)} tensor{'s' if len(lossy) > 1 else ''} restored within "
            f"{' / '.join(bounds)} of the saved values, not bit-exact (largest relative error "
            f"{worst.error['rel']:.3g}, in {worst.span!r})")


def warn_lossy(run: str, step: int, records: Iterable[Record]) -> None:
    """Said once per step and place: a lossy restore is never silent."""
    said = lossy_summary(records)
    if said is not None:
        warnings.warn(LossyWarning(f"run {run!r}, step {step} was saved with an error bound: "
                                   f"{said}"), stacklevel=3)
