"""The dtype table: stable names for every dtype tpde stores and how its bits are treated.

Chains name dtypes with the strings below, never with ``str(dtype)``, so a torch release that
renames or adds dtypes cannot change how an old chain reads.  Each element is handled as one or
more little-endian *words* (the component of a complex number is a word); residuals and the
byte-plane shuffle work on words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpde.errors import FormatError, UnsupportedError

#: How the words of a dtype may be differenced: ``float`` words have an order-preserving integer
#: image, ``int`` words are integers already, ``raw`` words only support XOR.
WordKind = str


@dataclass(frozen=True)
class DType:
    name: str
    torch_dtype: torch.dtype
    word_bytes: int
    words_per_element: int
    kind: WordKind

    @property
    def itemsize(self) -> int:
        return self.word_bytes * self.words_per_element

    @property
    def word_dtype(self) -> torch.dtype:
        return _SIGNED[self.word_bytes]


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_SPECS: list[tuple[str, str, int, int, WordKind]] = [
    ("float64", "float64", 8, 1, "float"),
    ("float32", "float32", 4, 1, "float"),
    ("float16", "float16", 2, 1, "float"),
    ("bfloat16", "bfloat16", 2, 1, "float"),
    ("float8_e4m3fn", "float8_e4m3fn", 1, 1, "float"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz", 1, 1, "float"),
    ("float8_e5m2", "float8_e5m2", 1, 1, "float"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz", 1, 1, "float"),
    ("float8_e8m0fnu", "float8_e8m0fnu", 1, 1, "int"),
    ("float4_e2m1fn_x2", "float4_e2m1fn_x2", 1, 1, "raw"),
    ("complex128", "complex128", 8, 2, "float"),
    ("complex64", "complex64", 4, 2, "float"),
    ("complex32", "complex32", 2, 2, "float"),
    ("int64", "int64", 8, 1, "int"),
    ("int32", "int32", 4, 1, "int"),
    ("int16", "int16", 2, 1, "int"),
    ("int8", "int8", 1, 1, "int"),
    ("uint64", "uint64", 8, 1, "int"),
    ("uint32", "uint32", 4, 1, "int"),
    ("uint16", "uint16", 2, 1, "int"),
    ("uint8", "uint8", 1, 1, "int"),
    ("bool", "bool", 1, 1, "raw"),
    ("bits8", "bits8", 1, 1, "raw"),
    ("bits16", "bits16", 2, 1, "raw"),
    ("bits1x8", "bits1x8", 1, 1, "raw"),
    ("bits2x4", "bits2x4", 1, 1, "raw"),
    ("bits4x2", "bits4x2", 1, 1, "raw"),
    *[(f"int{b}", f"int{b}", 1, 1, "raw") for b in range(1, 8)],
    *[(f"uint{b}", f"uint{b}", 1, 1, "raw") for b in range(1, 8)],
]

BY_NAME: dict[str, DType] = {}
BY_TORCH: dict[torch.dtype, DType] = {}
for _name, _attr, _word, _count, _kind in _SPECS:
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        BY_NAME[_name] = BY_TORCH[_dt] = DType(_name, _dt, _word, _count, _kind)


def of_tensor(t: torch.Tensor, *, name: str | None = None) -> DType:
    """The table entry for ``t``'s dtype, or an error that says the tensor cannot be delta-coded."""
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        raise UnsupportedError(
            f"dtype {t.dtype} has no entry in tpde's dtype table", tensor=name
        ) from None


def by_name(name: str) -> DType:
    """The entry for a stored dtype name; an unknown name means a newer or damaged chain."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise FormatError(
            f"unknown dtype {name!r}: the chain was written by a newer tpde or is damaged"
        ) from None
