"""Words, byte planes and residuals: the reversible transforms between a tensor and the bytes
zstd sees, shared by the encoder (``codec``) and the decoder (``decoder``), and mirrored on a
GPU by ``tpde.kernels``.

A tensor is a flat array of little-endian words (see ``dtypes``). A residual against the
reference's words is their XOR, or the zigzagged difference of their order-preserving integer
images; either is byte-plane shuffled (all first bytes, then all second bytes, ...) because the
high bytes of nearby floats repeat and the low bytes are noise. Nothing here touches a store.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from tpde.codec import frames, unframe
from tpde.errors import FormatError
from tpde.runtime import heap

RESIDUALS = ("xor", "sub")
#: Words a residual is computed or applied at a time: with torch (on a device) and with
#: numpy (on the host, where a slice that stays in cache is the faster one).
RESIDUAL_SLICE, HOST_SLICE = 1 << 20, 1 << 18


def to_words(t: torch.Tensor, word_dtype: torch.dtype) -> torch.Tensor:
    """The tensor's bits as a flat contiguous array of signed words (a copy only if needed)."""
    if t.element_size() == word_dtype.itemsize and t.is_contiguous():
        # One view, not four: a save of many small tensors spends a share of its time here.
        return t.view(-1).view(word_dtype)
    return t.contiguous().reshape(-1).view(torch.uint8).view(word_dtype)


def native_rows(*words: torch.Tensor) -> list[np.ndarray] | None:
    """The host words' bytes, one row per word, where ``tpde.codec._planes``' word loops take every
    one of them (``frames.native_layout``: contiguous, aligned, all of one size); None where
    numpy's path must do the work. Asked of the tensors: numpy's address of an array took a
    microsecond, six times per tensor of a save."""
    n, width = words[0].numel(), words[0].element_size()
    if all(w.is_cpu and w.numel() == n and w.element_size() == width
           and frames.native_layout(w.is_contiguous(), width, w.data_ptr()) for w in words):
        return [w.numpy().view(np.uint8).reshape(n, width) for w in words]
    return None


def shuffle(words: torch.Tensor) -> torch.Tensor:
    """Byte planes: all first bytes of the words, then all second bytes, and so on."""
    width = words.element_size()
    raw = words.view(torch.uint8)
    if width == 1:
        return raw
    # One strided copy per plane: far faster than a transposing .contiguous() on the CPU.
    planes = torch.empty((width, words.numel()), dtype=torch.uint8, device=words.device)
    by_word = raw.reshape(-1, width)
    for k in range(width):
        planes[k].copy_(by_word[:, k])
    return planes.reshape(-1)


def _holds(out: torch.Tensor | None, nbytes: int, word_dtype: torch.dtype) -> bool:
    """Whether a caller's buffer ``out`` takes ``nbytes`` of words of ``word_dtype``."""
    return out is not None and out.dtype == word_dtype \
        and out.numel() * out.element_size() == nbytes


def stream_words(stream: unframe.Frames | unframe.Framed, word_dtype: torch.dtype,
                 threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The words of a shuffled stream, each slice's words joined in cache from its part of
    every plane, with no copy of the planes beside them (``unframe.unshuffle_into``): frames
    held in memory (the restore path's keyframe values and small dense residuals) on the frame
    threads; a ``unframe.Framed`` (a memory-first decode) into the heap (``heap.in_heap``), on
    the frame threads where it is large (``unframe.FRAMED_SPREAD_BYTES``). ``out`` (host words
    of the right size) receives them instead of a new buffer."""
    width = torch.empty(0, dtype=word_dtype).element_size()
    if stream.raw % width:
        raise FormatError("byte planes do not hold a whole number of words")
    if not stream.raw:
        return torch.empty(0, dtype=word_dtype)
    words = out if _holds(out, stream.raw, word_dtype) else \
        torch.from_numpy(heap.in_heap(stream.raw)).view(word_dtype) \
        if isinstance(stream, unframe.Framed) else \
        torch.empty(stream.raw // width, dtype=word_dtype)
    unframe.unshuffle_into(stream, words.view(torch.uint8).numpy().reshape(-1, width),
                           threads=threads)
    return words


def apply_streamed(ref: torch.Tensor, stream: unframe.Framed | unframe.Frames, how: str,
                   kind: str, threads: int | None = None, *, undo: bool = False
                   ) -> torch.Tensor:
    """``apply_residual`` in place with the residual read from its frames a slice at a time:
    beside ``ref`` a decode holds one slice and the few frames under it, per thread.

    ``unframe.Frames`` (held in memory) are shared out in runs of slices over ``threads`` frame
    threads, each reading them through a ``unframe.Framed`` of its own. That is how a restore
    applies a dense delta: no residual as large as the tensor is allocated and filled first
    (fresh pages cost as much as the decode here), and every pass runs in cache (a 64 MiB
    fp32 delta: ``benchmarks/README.md``). With ``tpde.codec._planes`` a slice's residual words are
    joined from their planes and applied in the same pass, which shortens a deep chain's
    restore. ``undo``: as ``apply_residual``'s.
    """
    n, width = ref.numel(), ref.element_size()
    if stream.raw != n * width:
        raise FormatError(f"dense residual holds {stream.raw} bytes where {n * width} are "
                          f"expected")
    mode = residual_mode(how, kind, undo=undo)
    fused = native_rows(ref)  # ref's words, where a slice is joined and applied in C
    if isinstance(stream, unframe.Frames) and stream.raw <= unframe.WHOLE_BYTES:
        parts = unframe.whole(stream)
        if fused:
            unframe.join_whole(parts, fused[0], mode)
        else:
            r = torch.empty_like(ref)
            unframe.join_whole(parts, r.view(torch.uint8).numpy().reshape(n, width))
            apply_residual(ref, r, how, kind, inplace=True, undo=undo)
        return ref
    per = stream.chunk  # words per slice: each plane's part spans at most two frames

    def work(framed: unframe.Framed, starts: Iterable[int]) -> None:
        # Without _planes, no allocation per slice: the residual's planes, its words and the
        # temporaries reuse three buffers.
        scratch = None if fused else heap.in_heap(3 * min(per, n) * width)
        for lo in starts:
            m = min(per, n - lo)
            if fused:  # joined from the frames and applied in one pass, in cache
                framed.join_into(n, lo, fused[0][lo : lo + m], mode)
                continue
            planes = scratch[: m * width].reshape(width, m)
            framed.planes_into(n, lo, planes)
            r, tmp = (torch.from_numpy(scratch[b * m * width : (b + 1) * m * width])
                      .view(ref.dtype) for b in (1, 2))
            unframe.join(planes, r.view(torch.uint8).numpy().reshape(m, width))
            apply_residual(ref[lo : lo + m], r, how, kind, inplace=True, tmp=tmp, undo=undo)

    unframe.by_slices(stream, n, work, threads=threads)
    return ref


def unshuffle(planes: torch.Tensor, word_dtype: torch.dtype) -> torch.Tensor:
    """Host words from their byte planes (a device's are put together by ``tpde.kernels``):
    joined by ``tpde.codec._planes`` where it is built, else as little-endian words built from the
    top plane down, a shift and an OR per plane, which beat a strided byte copy per plane
    (both measured in ``benchmarks/sparse_bench.py``)."""
    width = torch.empty(0, dtype=word_dtype).element_size()
    if planes.numel() % width:
        raise FormatError("byte planes do not hold a whole number of words")
    if width == 1:
        return planes.view(word_dtype)
    p = planes.reshape(width, -1).numpy()
    out = np.empty(p.shape[1], dtype=f"<u{width}")
    rows = out.view(np.uint8).reshape(-1, width)
    if frames.native_words(rows):
        frames.native.join(p, width, rows, 0)
        return torch.from_numpy(rows.reshape(-1)).view(word_dtype)
    np.copyto(out, p[width - 1])
    for k in range(width - 2, -1, -1):
        np.left_shift(out, 8, out=out)
        np.bitwise_or(out, p[k], out=out)
    return torch.from_numpy(out.view(np.uint8)).view(word_dtype)


def residual(new: torch.Tensor, ref: torch.Tensor, how: str, kind: str) -> torch.Tensor:
    """XOR, or the zigzagged difference of the words' (order-preserving) integer images.

    Host words are worked on in one pass by ``tpde.codec._planes`` where it is built. Without it,
    with numpy, as in ``apply_residual`` (faster on one core than torch on two), a ``sub``
    residual is computed a slice at a time into its result, with one slice-sized temporary:
    every pass runs in cache, and a large tensor costs its result and nothing else, several
    times less than whole-tensor passes.
    """
    if how == "xor":
        if new.device.type == "cpu":
            return torch.from_numpy(np.bitwise_xor(new.numpy(), ref.numpy()))
        return new ^ ref
    bits, n = new.element_size() * 8, new.numel()
    out = torch.empty(n, dtype=new.dtype, device=new.device)
    if new.device.type == "cpu":
        rows = native_rows(new, ref, out)
        if rows:  # one pass in C, without the GIL
            frames.native.diff(rows[0], rows[1], new.element_size(), rows[2],
                               residual_mode(how, kind))
        else:
            _residual_host(new.numpy(), ref.numpy(), kind, out.numpy())
        return out
    tmp = torch.empty(min(RESIDUAL_SLICE, n), dtype=new.dtype, device=new.device)
    mask = (1 << (bits - 1)) - 1
    for lo in range(0, n, RESIDUAL_SLICE):
        hi = min(lo + RESIDUAL_SLICE, n)
        d, t, a, b = out[lo:hi], tmp[: hi - lo], new[lo:hi], ref[lo:hi]
        if kind == "float":  # the order-preserving images: x ^ ((x >> (bits - 1)) & mask)
            torch.bitwise_right_shift(a, bits - 1, out=d).bitwise_and_(mask).bitwise_xor_(a)
            torch.bitwise_right_shift(b, bits - 1, out=t).bitwise_and_(mask).bitwise_xor_(b)
            d.sub_(t)
        else:
            torch.sub(a, b, out=d)
        torch.bitwise_right_shift(d, bits - 1, out=t)
        d.bitwise_left_shift_(1).bitwise_xor_(t)
    return out


def _residual_host(new: np.ndarray, ref: np.ndarray, kind: str, out: np.ndarray) -> None:
    """``residual``'s ``sub`` on host words, ``HOST_SLICE`` words at a time."""
    n = len(new)
    tmp = np.empty(min(HOST_SLICE, n), dtype=new.dtype)
    for lo in range(0, n, HOST_SLICE):
        hi = min(lo + HOST_SLICE, n)
        d, t, a, b = out[lo:hi], tmp[: hi - lo], new[lo:hi], ref[lo:hi]
        if kind == "float":
            _order_host(a, d, out=d)
            _order_host(b, t, out=t)
            np.subtract(d, t, out=d)
        else:
            np.subtract(a, b, out=d)
        np.right_shift(d, new.itemsize * 8 - 1, out=t)
        np.left_shift(d, 1, out=d)
        np.bitwise_xor(d, t, out=d)


def apply_residual(ref: torch.Tensor, r: torch.Tensor, how: str, kind: str, *,
                   inplace: bool = False, tmp: torch.Tensor | None = None, undo: bool = False
                   ) -> torch.Tensor:
    """Inverse of ``residual``, on host words (a device's are rebuilt by ``tpde.kernels``).
    With ``inplace`` both ``ref`` and ``r`` are overwritten; ``tmp`` (words shaped as ``r``) is
    used for the temporaries instead of a new tensor. With ``undo`` it is ``residual``'s
    reference that is rebuilt, from the words the residual was taken of (``ref`` here): XOR
    undoes itself, and a difference is taken off instead of added.

    In one pass by ``tpde.codec._planes`` where it is built, otherwise with numpy; not torch: a
    restore applies residuals on its frame threads, where torch's own intra-op threads would
    oversubscribe the cores (a delta step restored faster with numpy than with torch).
    """
    mode = residual_mode(how, kind, undo=undo)
    out = ref if inplace else ref.clone()
    rows = native_rows(out, r)
    if rows:  # one pass in C, without the GIL
        frames.native.apply(rows[1], out.element_size(), rows[0], mode)
        return out
    words = out.numpy()
    d = (r if inplace or how == "xor" else r.clone()).numpy()
    if how == "xor":
        np.bitwise_xor(words, d, out=words)
        return out
    t = (tmp if tmp is not None else torch.empty_like(r)).numpy()
    unsigned = np.dtype(f"u{d.itemsize}")
    np.bitwise_and(d, 1, out=t)
    np.negative(t, out=t)
    np.right_shift(d.view(unsigned), 1, out=d.view(unsigned))  # the zigzag undone
    np.bitwise_xor(d, t, out=d)
    if kind == "float":
        _order_host(words, t)
    (np.subtract if undo else np.add)(words, d, out=words)  # wraps, as the difference did
    if kind == "float":
        _order_host(words, t)
    return out


def residual_mode(how: str, kind: str, *, undo: bool = False) -> int:
    """A residual as ``_planes`` names it (``_planes.c``: 1 XOR, 2 and 3 differences; 4 and 5
    those differences undone)."""
    if how not in ("xor", "sub") or (how == "sub" and kind == "raw"):
        raise FormatError(f"unknown residual {how!r} for {kind} words")
    return 1 if how == "xor" else (2 if kind == "float" else 3) + (2 if undo else 0)


def _order_host(words: np.ndarray, tmp: np.ndarray, out: np.ndarray | None = None) -> None:
    """The order-preserving integer image of float bits (an involution) into ``out``
    (default: in place; ``tmp`` may be ``out``): the sign, spread by an arithmetic shift, then
    shifted once logically, is the mask that the image XORs with."""
    unsigned = np.dtype(f"u{words.itemsize}")
    np.right_shift(words, words.itemsize * 8 - 1, out=tmp)
    np.right_shift(tmp.view(unsigned), 1, out=tmp.view(unsigned))
    np.bitwise_xor(words, tmp, out=words if out is None else out)


def residual_kinds(kind: str) -> tuple[str, ...]:
    return ("xor",) if kind == "raw" else RESIDUALS
