"""Error-bounded coding: the opt-in lossy mode's quantizer, pure like ``codec``.

A bounded tensor's words are coded as integer **codes** on a grid, taken against the words a
reader will rebuild for the reference (error feedback), never against the true previous
values: the restored value at a step then depends only on that step's codes and the restored
reference, so errors cannot add up along a chain. Two grids:

* ``ulp``: the order-preserving integer images of the floats (``_order``), rounded to
  multiples of ``2k + 1`` units in the last place. ``k`` units are at most ``k * 2**-m`` of a
  value (``m`` mantissa bits), which makes this the grid of a relative bound. Integer
  arithmetic only, so every device rebuilds the same bits.
* ``abs``: the values themselves on a grid of ``scale``, rebuilt as ``ref + code * scale`` in
  float64, rounded to float32 and then to the tensor's dtype (float64 tensors: not rounded),
  which IEEE arithmetic makes the same on every device.

Every rebuilt element is then checked against the bound; one that misses it (rounding at the
edge of the grid, a code that does not fit a word, NaN and Inf, a relative bound's zero or
subnormal) gets code 0 and is stored exactly as a **fix**: its position and the XOR of its
word with the word code 0 rebuilds. The guarantee therefore rests on the check, not on the
grid's arithmetic.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from tpde.errors import TPDEError

#: Elements handled at once, so the float64 temporaries stay a few MB whatever the tensor.
BLOCK = 1 << 20


class BoundError(TPDEError, ValueError):
    """An error bound or its patterns cannot be used as given."""


@dataclass(frozen=True)
class Bound:
    """A pointwise error bound: ``|restored - saved| <= abs`` and/or ``<= rel * |saved|``.

    Both set means both hold for every element. A relative bound keeps every value's sign and
    zero exact. NaN and Inf are always stored exactly.
    """

    abs: float | None = None
    rel: float | None = None

    def __post_init__(self) -> None:
        if self.abs is None and self.rel is None:
            raise BoundError("a bound needs an absolute or a relative part")
        for kind, v, hi in (("Abs", self.abs, math.inf), ("Rel", self.rel, 1.0)):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not (0.0 < float(v) < hi):
                raise BoundError(f"{kind}({v!r}): the bound must be a number above 0"
                                 + (" and below 1 (a relative error of 1 could flip signs)"
                                    if kind == "Rel" else " and finite"))
            object.__setattr__(self, kind.lower(), float(v))

    def __and__(self, other: "Bound") -> "Bound":
        """Both bounds at once (the tighter of each part)."""
        pick = lambda a, b: b if a is None else a if b is None else min(a, b)  # noqa: E731
        return Bound(pick(self.abs, other.abs), pick(self.rel, other.rel))

    def __str__(self) -> str:
        parts = [f"Abs({self.abs:g})" if self.abs is not None else "",
                 f"Rel({self.rel:g})" if self.rel is not None else ""]
        return " & ".join(p for p in parts if p)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("abs", self.abs), ("rel", self.rel)) if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> "Bound":
        if not isinstance(d, dict) or set(d) - {"abs", "rel"}:
            raise ValueError(f"not a bound: {d!r}")
        return cls(d.get("abs"), d.get("rel"))


def Abs(a: float) -> Bound:  # noqa: N802 - reads as a unit in user code: tpde.Abs(1e-6)
    """Every restored element within ``a`` of the saved one."""
    return Bound(abs=a)


def Rel(r: float) -> Bound:  # noqa: N802
    """Every restored element within ``r`` times the saved one's magnitude (0 < r < 1)."""
    return Bound(rel=r)


class Bounds:
    """Which bound each tensor is saved under: the first ``fnmatch`` pattern (over the names
    ``tpde info`` prints, e.g. ``model/fc.weight``, and for tied tensors any of their names)
    that matches it; None where none does."""

    def __init__(self, patterns: Mapping[str, Bound]) -> None:
        if not isinstance(patterns, Mapping) or not patterns:
            raise BoundError("error_bound must be a dict of name patterns to tpde.Abs(...) / "
                             "tpde.Rel(...) bounds, e.g. {'model/*': tpde.Rel(1e-3)}")
        for pattern, bound in patterns.items():
            if not isinstance(pattern, str) or not isinstance(bound, Bound):
                raise BoundError(f"error_bound[{pattern!r}] = {bound!r}: keys are name "
                                 "patterns, values tpde.Abs(...) or tpde.Rel(...)")
        self.patterns = dict(patterns)
        self._cache: dict[tuple[str, ...], Bound | None] = {}

    def __call__(self, name: str, *also: str) -> Bound | None:
        """The bound of the tensor ``name`` (``also``: the names of tensors tied to it)."""
        key = (name, *also)
        if key not in self._cache:
            self._cache[key] = next((b for p, b in self.patterns.items()
                                     if any(fnmatch.fnmatchcase(n, p) for n in key)), None)
        return self._cache[key]

    def check(self, names: Iterable[str]) -> None:
        """Refuse patterns that would not mean what they say on ``names``: one that matches
        none (a typo would silently save exactly), and one whose every tensor an earlier
        pattern takes (the first match wins, so it would silently change nothing)."""
        names = list(names)
        taken: dict[str, str] = {}  # tensor -> the pattern that takes it
        for pattern in self.patterns:
            mine = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not mine:
                near = difflib.get_close_matches(pattern, names, n=5, cutoff=0.3) or names[:5]
                raise BoundError(f"error_bound pattern {pattern!r} matches no tensor of this "
                                 f"checkpoint; names look like {near}; fix the pattern (a * "
                                 "matches any characters, / included)")
            if all(n in taken for n in mine):
                by = sorted({taken[n] for n in mine})
                raise BoundError(
                    f"error_bound pattern {pattern!r} applies to no tensor: every tensor it "
                    f"matches ({mine[:3]}{' ...' if len(mine) > 3 else ''}) is taken by the "
                    f"earlier pattern {' and '.join(map(repr, by))}, and the first matching "
                    f"pattern wins; put {pattern!r} first")
            for n in mine:
                taken.setdefault(n, pattern)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{p!r}: {b}" for p, b in self.patterns.items()) + "}"


#: The floating-point dtypes a bound applies to: the float dtype of one word, mantissa bits.
#: Complex numbers are bounded per component. Everything else is stored exactly.
FLOATS: dict[str, tuple[torch.dtype, int]] = {
    "float64": (torch.float64, 52), "float32": (torch.float32, 23),
    "float16": (torch.float16, 10), "bfloat16": (torch.bfloat16, 7),
    "complex128": (torch.float64, 52), "complex64": (torch.float32, 23),
    "complex32": (torch.float16, 10),
}


#: The grids a ``quant`` record's codes may lie on: steps of the dtype's own units in the last
#: place (a relative bound), or of a fixed size (an absolute one); see ``grids``.
GRIDS = ("ulp", "abs")


def applies(dtype: str) -> bool:
    return dtype in FLOATS


def _word_range(word: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(word)
    return info.min, info.max


def _order(words: torch.Tensor) -> torch.Tensor:
    """The order-preserving integer image of float words, as int64 (an involution on words)."""
    bits = words.element_size() * 8
    top = (words >> (bits - 1)) & ((1 << (bits - 1)) - 1)
    return (words ^ top).long()


def _unorder(img: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    w = img.to(word)  # wraps outside the word's range; the check turns such elements into fixes
    bits = w.element_size() * 8
    return w ^ ((w >> (bits - 1)) & ((1 << (bits - 1)) - 1))


def dequant(grid: str, scale: float, codes: torch.Tensor, ref: torch.Tensor | None,
            fdt: torch.dtype) -> torch.Tensor:
    """The words ``codes`` rebuild against ``ref``'s words (zero words when None). Code 0
    rebuilds the reference word itself, bit for bit."""
    word = codes.dtype
    base = ref if ref is not None else torch.zeros_like(codes)
    if grid == "ulp":
        out = _unorder(_order(base) + codes.long() * int(scale), word)
    elif grid == "abs":
        v = codes.double().mul_(float(scale)).add_(base.view(fdt).double())
        out = (v if fdt == torch.float64 else v.float().to(fdt)).view(word)
    else:
        raise ValueError(f"unknown grid {grid!r}")
    return torch.where(codes == 0, base, out)


def within(new: torch.Tensor, got: torch.Tensor, fdt: torch.dtype, bound: Bound) -> torch.Tensor:
    """Which elements of ``got`` (words) hold the bound against ``new`` (words), in float64.
    Non-finite values hold it only bit for bit."""
    x, y = new.view(fdt).double(), got.view(fdt).double()
    finite = torch.isfinite(x)
    err = (y - x).abs_()
    ok = finite & torch.isfinite(y)
    if bound.abs is not None:
        ok &= err <= bound.abs
    if bound.rel is not None:
        ok &= (err <= x.abs().mul_(bound.rel)) & (torch.signbit(x) == torch.signbit(y))
    return ok | (~finite & (new == got))


def errors(new: torch.Tensor, got: torch.Tensor, fdt: torch.dtype) -> tuple[float, float]:
    """The largest absolute error, and the largest error relative to a nonzero saved value,
    over finite elements (non-finite ones are exact)."""
    worst_abs = worst_rel = 0.0
    for lo in range(0, new.numel(), BLOCK):
        x = new[lo : lo + BLOCK].view(fdt).double()
        y = got[lo : lo + BLOCK].view(fdt).double()
        fin = torch.isfinite(x) & torch.isfinite(y)
        err = torch.where(fin, (y - x).abs(), 0.0)
        worst_abs = max(worst_abs, float(err.max()) if err.numel() else 0.0)
        nz = fin & (x != 0)
        if bool(nz.any()):
            worst_rel = max(worst_rel, float((err[nz] / x[nz].abs()).max()))
    return worst_abs, worst_rel


@dataclass
class Quantized:
    """One grid's coding of a tensor: codes, the fixes, and the words a reader rebuilds."""

    grid: str
    scale: float
    codes: torch.Tensor  # words; 0 at fixes
    fixes: torch.Tensor  # positions (int64) of exactly stored elements
    rebuilt: torch.Tensor  # words, fixes included


def grids(dtype: str, bound: Bound) -> list[tuple[str, float]]:
    """The grids worth trying for ``bound`` on ``dtype``: none where no grid is coarser than
    the dtype's own precision (the tensor is then stored exactly)."""
    out: list[tuple[str, float]] = []
    _, mant = FLOATS[dtype]
    if bound.rel is not None:
        k = math.floor(bound.rel * 2.0 ** mant)
        if k >= 1:
            out.append(("ulp", float(2 * k + 1)))
    if bound.abs is not None:
        # Slightly inside 2*abs, so that the final rounding to the dtype rarely pushes an
        # element past the bound.
        out.append(("abs", 2.0 * bound.abs * (1.0 - 2.0 ** -8)))
    return out


def quantize(new: torch.Tensor, ref: torch.Tensor | None, dtype: str, bound: Bound,
             grid: str, scale: float) -> Quantized:
    """Code ``new`` (words) against ``ref`` (the reader's words, or None) on one grid."""
    fdt, _ = FLOATS[dtype]
    word = new.dtype
    lo_w, hi_w = _word_range(word)
    codes = torch.empty_like(new)
    rebuilt = torch.empty_like(new)
    fixes: list[torch.Tensor] = []
    for lo in range(0, new.numel(), BLOCK):
        x = new[lo : lo + BLOCK]
        r = ref[lo : lo + BLOCK] if ref is not None else None
        if grid == "ulp":
            base = _order(r) if r is not None else torch.zeros_like(x, dtype=torch.int64)
            half = (int(scale) - 1) // 2
            q = torch.div(_order(x) - base + half, int(scale), rounding_mode="floor")
        else:
            base = r.view(fdt).double() if r is not None else torch.zeros(x.shape, dtype=torch.float64)
            q = torch.round((x.view(fdt).double() - base) / scale).nan_to_num_(0.0, 0.0, 0.0)
        q = q.clamp_(lo_w, hi_w).to(word)
        got = dequant(grid, scale, q, r, fdt)
        bad = ~within(x, got, fdt, bound)
        if bool(bad.any()):
            q[bad] = 0
            got = torch.where(bad, r if r is not None else torch.zeros_like(x), got)
            fixes.append(torch.nonzero(bad).reshape(-1) + lo)
            got = torch.where(bad, x, got)
        codes[lo : lo + BLOCK] = q
        rebuilt[lo : lo + BLOCK] = got
    pos = torch.cat(fixes) if fixes else torch.empty(0, dtype=torch.int64)
    return Quantized(grid, scale, codes, pos, rebuilt)


def zigzag(q: torch.Tensor) -> torch.Tensor:
    bits = q.element_size() * 8
    return (q << 1) ^ (q >> (bits - 1))


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    bits = z.element_size() * 8
    return ((z >> 1) & ((1 << (bits - 1)) - 1)) ^ (-(z & 1))


def order(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    """The order dense codes are stored in against ``ref``: a stable sort of the elements by
    the exponent field of their reference word.

    Codes depend on a value's magnitude (a step of the same size is a larger relative change
    for a smaller value), so grouping them by magnitude lets zstd's entropy coder adapt to
    each group: measured 6.0 -> 5.2 bits per fp32 weight of a fine-tune at Rel(1e-3). The
    reader has the reference, so the order costs no bytes.
    """
    _, mant = FLOATS[dtype]
    bits = ref.element_size() * 8
    key = (ref >> mant) & ((1 << (bits - 1 - mant)) - 1)
    return torch.sort(key, stable=True).indices


def codes_of(n: int, values: torch.Tensor, positions: torch.Tensor | None,
             ref: torch.Tensor | None, dtype: str) -> torch.Tensor:
    """Every element's code from a record's values: zigzagged codes of the nonzero elements at
    ``positions``, or of all elements (in ``order`` when there is a reference)."""
    q = unzigzag(values)
    if positions is not None:
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        out[positions] = q
        return out
    if ref is None:
        return q
    out = torch.empty_like(q)
    out[order(ref, dtype)] = q
    return out
