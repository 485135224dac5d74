"""The tensor codec's decode side: words rebuilt from a record's decompressed sections and its
reference words, the inverse of ``codec.encode`` for every coding (``codec.CODECS``).

``CPU`` is where the work is done: on the host here, and on a GPU in ``tpde.kernels.backend``,
which subclasses it; ``decode`` checks every count a record's sections claim against the
words it is to rebuild before anything is applied. Nothing here touches a store.
"""

from __future__ import annotations

import numpy as np
import torch

from tpde.codec import elias, frames, quant, unframe
from tpde.codec.transform import (HOST_SLICE, apply_residual, apply_streamed, native_rows,
                                  stream_words, unshuffle)
from tpde.errors import FormatError


class CPU:
    """Where and how ``decode`` does its work: on the host (error-bounded records with torch,
    on the reference's device; ``tpde.kernels`` subclasses this for a GPU)."""

    def words(self, sections: dict[str, bytes | bytearray], name: str,
              word_dtype: torch.dtype, dest: torch.Tensor | None = None) -> torch.Tensor:
        return _words_from(sections, name, word_dtype, dest)

    def dense(self, ref: torch.Tensor, r: torch.Tensor, how: str, kind: str) -> torch.Tensor:
        # In slices, through one slice-sized temporary: every pass runs in cache.
        tmp = torch.empty(min(HOST_SLICE, ref.numel()), dtype=ref.dtype)
        for lo in range(0, ref.numel(), HOST_SLICE):
            hi = min(lo + HOST_SLICE, ref.numel())
            apply_residual(ref[lo:hi], r[lo:hi], how, kind, inplace=True, tmp=tmp[: hi - lo])
        return ref

    def positions(self, stream: bytes | bytearray, n: int, decoded: np.ndarray | None,
                  device: torch.device) -> torch.Tensor:
        if decoded is None:
            decoded = elias.decode(stream, limit=n)
        return torch.from_numpy(decoded).to(device)

    def sparse(self, ref: torch.Tensor, pos: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        residual, words = native_rows(r), native_rows(ref)
        if residual and words:  # one pass in C, without the GIL
            frames.native.apply_at(residual[0], ref.element_size(), words[0], pos.numpy())
            return ref
        # numpy where the C loops are not built: faster here than torch's indexing
        flat = ref.numpy()
        flat[pos.numpy()] ^= r.numpy()
        return ref

    def quant(self, grid: str, scale: float, dtype: str, n: int, values: torch.Tensor,
              pos: torch.Tensor | None, ref: torch.Tensor | None, fixes: torch.Tensor | None,
              exact: torch.Tensor | None) -> torch.Tensor:
        device = ref.device if ref is not None else values.device
        values = values.to(device)
        codes = quant.codes_of(n, values, pos, ref, dtype)
        out = quant.dequant(grid, scale, codes, ref, quant.FLOATS[dtype][0])
        if fixes is not None:
            out[fixes] = out[fixes] ^ exact.to(device)
        return out


def decode(codec: str, how: str | None, sections: dict[str, bytes | bytearray], ref: torch.Tensor | None,
           n: int, word_dtype: torch.dtype, kind: str,
           positions: np.ndarray | None = None, inplace: bool = False,
           backend: CPU | None = None, grid: tuple[str, float, str] | None = None,
           dest: torch.Tensor | None = None, undo: bool = False) -> torch.Tensor:
    """Rebuild ``n`` words from decompressed sections and the reference words.

    ``positions`` may carry a sparse record's already decoded position stream (callers decode
    a whole step's streams in one batch with ``elias.decode_many``).  With ``inplace`` a delta
    overwrites ``ref`` instead of copying it: for callers that own ``ref``. ``backend`` does the
    work elsewhere (the GPU kernels in ``tpde.kernels``); it always works in place. ``grid``
    is a ``quant`` record's (grid, scale, dtype name).
    ``dest`` is where a keyframe record's words may be decoded (host words, ``n`` of them),
    when its frames allow it; callers check where the words came back.
    With ``undo`` (a delta on the host) ``ref`` holds the words the record rebuilds, and the
    words it was coded against come back: a re-base takes a step's words back from the step
    after it. XOR undoes itself; a difference is taken off.
    """
    if undo and (backend is not None or codec not in ("dense", "sparse")):
        raise ValueError(f"only a host delta can be undone, not a {codec} record")
    do = backend or CPU()
    if codec == "quant":
        return _decode_quant(do, sections, ref, n, word_dtype, grid)
    if codec == "key":
        words = do.words(sections, "values", word_dtype, dest) if backend is None \
            else do.words(sections, "values", word_dtype)
        if words.numel() != n:
            raise FormatError(f"keyframe holds {words.numel()} words where {n} are expected")
        return words
    if ref is None or ref.numel() != n:
        raise FormatError(f"{codec} record has no usable reference")
    if codec == "same":
        return ref
    values = sections.get("values")
    if codec == "dense" and not ref.is_cuda and isinstance(values, (unframe.Framed,
                                                                     unframe.Frames)):
        return apply_streamed(ref if inplace else ref.clone(), sections.pop("values"), how or "",
                              kind, undo=undo)
    r = do.words(sections, "values", word_dtype)
    out = ref if inplace or backend is not None else ref.clone()
    if codec == "dense":
        if r.numel() != n:
            raise FormatError(f"dense residual holds {r.numel()} words where {n} are expected")
        if undo:
            return apply_residual(out, r, how or "", kind, inplace=True, undo=True)
        return do.dense(out, r, how or "", kind)
    if codec == "sparse":
        if how != "xor":
            raise FormatError(f"sparse record with residual {how!r}")
        pos = do.positions(sections.get("positions", b""), n, positions, ref.device)
        if pos.numel() != r.numel():
            raise FormatError("sparse record has a different number of positions and values")
        return do.sparse(out, pos, r)
    raise FormatError(f"unknown codec {codec!r}")


def _decode_quant(do: CPU, sections: dict[str, bytes | bytearray], ref: torch.Tensor | None,
                  n: int, word_dtype: torch.dtype, grid: tuple[str, float, str] | None
                  ) -> torch.Tensor:
    if grid is None or grid[0] not in quant.GRIDS or grid[2] not in quant.FLOATS:
        raise FormatError(f"quant record with grid {grid!r}")
    if ref is not None and ref.numel() != n:
        raise FormatError("quant record has no usable reference")
    values = do.words(sections, "values", word_dtype)
    pos = None
    device = ref.device if ref is not None else values.device
    if "positions" in sections:
        pos = do.positions(sections["positions"], n, None, device)
        if pos.numel() != values.numel():
            raise FormatError("quant record has a different number of positions and codes")
    elif values.numel() != n:
        raise FormatError(f"quant record holds {values.numel()} codes where {n} are expected")
    fixes = exact = None
    if "fixes" in sections:
        fixes = do.positions(sections["fixes"], n, None, device)
        exact = do.words(sections, "exact", word_dtype)
        if fixes.numel() != exact.numel():
            raise FormatError("quant record has a different number of fixes and exact words")
    return do.quant(grid[0], grid[1], grid[2], n, values, pos, ref, fixes, exact)


def _words_from(sections: dict[str, bytes | np.ndarray], name: str,
                word_dtype: torch.dtype, dest: torch.Tensor | None = None) -> torch.Tensor:
    if name not in sections:
        raise FormatError(f"record lacks its {name!r} section")
    # Taken out of the record's sections: the planes are freed once unshuffled, not held
    # while the words are applied to the reference.
    data = sections.pop(name)
    if isinstance(data, (unframe.Framed, unframe.Frames)):
        return stream_words(data, word_dtype, out=dest)
    if not (isinstance(data, np.ndarray) and data.flags.writeable):
        data = np.frombuffer(bytearray(data), dtype=np.uint8)
    return unshuffle(torch.from_numpy(data.view(np.uint8).reshape(-1)), word_dtype)
