"""Triton kernels for decoding on the GPU: byte-plane unshuffle, residual application, and the
Elias-delta position decoder (one program per block of codes, started from its sync point).

Each kernel has its CPU reference in ``tpde.codec``, and the tests compare them;
without a GPU the tests run these kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors. Triton ships with the CUDA builds of torch; ``available()`` says whether it imports.
``tpde.kernels.backend`` puts them together with nvCOMP as the decoder that
``Chain.materialize(on=device)`` and a mount on a CUDA device use.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from tpde.codec import elias
from tpde.errors import FormatError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


@functools.cache
def available() -> bool:
    return triton is not None


BLOCK = 1024

if triton is not None:

    @triton.jit
    def _unshuffle_kernel(planes, out, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        for k in tl.static_range(WIDTH):
            tl.store(out + i * WIDTH + k, tl.load(planes + k * n + i, mask=m), mask=m)

    @triton.jit
    def _xor_kernel(ref, r, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(ref + i, tl.load(ref + i, mask=m) ^ tl.load(r + i, mask=m), mask=m)

    @triton.jit
    def _sub_kernel(ref, r, n, LOW: tl.constexpr, FLOAT: tl.constexpr, BITS: tl.constexpr,
                    BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        z = tl.load(r + i, mask=m)
        d = ((z >> 1) & LOW) ^ (-(z & 1))  # zigzag back to a signed difference
        w = tl.load(ref + i, mask=m)
        if FLOAT:  # order-preserving integer image of the float bits, and back
            w = w ^ ((w >> (BITS - 1)) & LOW)
            w = w + d
            w = w ^ ((w >> (BITS - 1)) & LOW)
        else:
            w = w + d
        tl.store(ref + i, w, mask=m)

    @triton.jit
    def _sparse_xor_kernel(ref, pos, r, count, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < count
        p = tl.load(pos + i, mask=m, other=0)
        tl.store(ref + p, tl.load(ref + p, mask=m) ^ tl.load(r + i, mask=m), mask=m)

    @triton.jit
    def _bit(codes, b):
        return (tl.load(codes + (b >> 3)).to(tl.int64) >> (7 - (b & 7))) & 1

    @triton.jit
    def _elias_kernel(codes, offsets, ends, bases, sizes, out, errors, block):
        """One program per block: decode its codes in order from its sync point."""
        k = tl.program_id(0)
        at = tl.load(offsets + k)
        end = tl.load(ends + k)
        position = tl.load(bases + k) - 1
        size = tl.load(sizes + k)
        zero = at * 0  # loop-carried scalars keep one type (int64) in compiled code
        bad = zero
        for j in range(0, size):
            ell = zero
            while (at < end) & (_bit(codes, at) == 0) & (ell < 7):
                ell += 1
                at += 1
            value = zero
            for _ in range(0, ell + 1):  # N + 1 in L + 1 bits, the first being the 1
                value = (value << 1) | tl.where(at < end, _bit(codes, at), zero)
                at += 1
            n = value - 1
            gap = zero + 1
            for _ in range(0, n):
                gap = (gap << 1) | tl.where(at < end, _bit(codes, at), zero)
                at += 1
            bad = bad | (ell > 6) | (n > 56) | (at > end)
            position += gap
            tl.store(out + k * block + j, position)
        bad = bad | (at != end)
        tl.store(errors + k, bad.to(tl.int32))


def _grid(n: int) -> tuple[int]:
    return (max(1, -(-n // BLOCK)),)


_interpreting = threading.Lock()


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel``; under Triton's interpreter launches queue (it is not thread-safe)."""
    if type(kernel).__name__ == "InterpretedFunction":  # decorated with TRITON_INTERPRET=1
        with _interpreting:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def unshuffle(planes: torch.Tensor, word_dtype: torch.dtype) -> torch.Tensor:
    """``tpde.codec.transform.unshuffle`` on the device of ``planes``."""
    width = torch.empty(0, dtype=word_dtype).element_size()
    if planes.numel() % width:
        raise FormatError("byte planes do not hold a whole number of words")
    n = planes.numel() // width
    out = torch.empty(planes.numel(), dtype=torch.uint8, device=planes.device)
    if n:
        _launch(_unshuffle_kernel, _grid(n), planes, out, n, WIDTH=width, BLOCK=BLOCK)
    return out.view(word_dtype)


def apply_residual_(ref: torch.Tensor, r: torch.Tensor, how: str, kind: str) -> torch.Tensor:
    """``tpde.codec.transform.apply_residual(..., inplace=True)`` on the device: ``ref`` becomes the new
    words."""
    n = ref.numel()
    if r.numel() != n:
        raise FormatError(f"dense residual holds {r.numel()} words where {n} are expected")
    if n == 0:
        return ref
    if how == "xor":
        _launch(_xor_kernel, _grid(n), ref, r, n, BLOCK=BLOCK)
        return ref
    if how != "sub" or kind == "raw":
        raise FormatError(f"unknown residual {how!r} for {kind} words")
    bits = ref.element_size() * 8
    _launch(_sub_kernel, _grid(n), ref, r, n, LOW=(1 << (bits - 1)) - 1, FLOAT=kind == "float",
                          BITS=bits, BLOCK=BLOCK)
    return ref


def apply_sparse_xor_(ref: torch.Tensor, positions: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``ref[positions] ^= r`` (positions distinct and in range, as the decoder guarantees)."""
    if positions.numel() != r.numel():
        raise FormatError("sparse record has a different number of positions and values")
    if r.numel():
        _launch(_sparse_xor_kernel, _grid(r.numel()), ref, positions, r, r.numel(), BLOCK=BLOCK)
    return ref


def decode_positions(stream: bytes | memoryview, device: torch.device, *,
                     limit: int | None = None) -> torch.Tensor:
    """``tpde.codec.elias.decode`` with the blocks decoded in parallel on ``device``.

    The header and sync table are checked on the host exactly as the CPU decoder checks them;
    the kernel flags any block whose codes do not end at the next sync point.
    """
    count, block, nbits, sync, codes = elias._parse(stream, limit)
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    nsync = sync.shape[0]
    offsets = sync[:, 0].astype(np.int64)
    ends = np.append(offsets[1:], nbits).astype(np.int64)
    sizes = np.minimum(block, count - np.arange(nsync) * block).astype(np.int64)
    as_dev = lambda a: torch.from_numpy(np.array(a)).to(device)  # noqa: E731  (a copy)
    # Eight zero bytes of padding: a read at the very end of the codes stays in bounds.
    code_bytes = as_dev(np.frombuffer(bytes(codes) + bytes(8), dtype=np.uint8))
    out = torch.empty(nsync * block, dtype=torch.int64, device=device)
    errors = torch.zeros(nsync, dtype=torch.int32, device=device)
    _launch(_elias_kernel, (nsync,), code_bytes, as_dev(offsets), as_dev(ends),
                            as_dev(sync[:, 1].astype(np.int64)), as_dev(sizes), out, errors, block)
    if bool(errors.any()):
        raise FormatError("position stream blocks do not end at the next sync point")
    valid = (torch.arange(nsync * block, device=device) % block) < torch.repeat_interleave(
        as_dev(sizes), block)
    p = out[valid]
    if (p < 0).any() or (p[1:] <= p[:-1]).any():
        raise FormatError("position stream decodes to positions that are not increasing")
    if limit is not None and int(p[-1]) >= limit:
        raise FormatError(f"position stream points past the end of a tensor of {limit} elements")
    return p

