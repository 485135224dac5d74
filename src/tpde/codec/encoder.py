"""The tensor codec: pure functions from words (and a reference) to compressed sections;
``decoder`` holds the way back.

A tensor is handled as a flat array of little-endian words (see ``dtypes``).  Against the
reference words of the previous step the encoder picks the smallest of:

* ``same``   — bit-identical: nothing is stored;
* ``sparse`` — Elias-delta coded positions of the changed words plus their XOR residuals;
* ``dense``  — a residual of every word (XOR, or the zigzagged difference of the
  order-preserving integer images, whichever compresses better);
* ``key``    — the words themselves, no reference.

A tensor saved under an error bound (opt-in) may also be coded ``quant``: integer codes on a
grid, with or without a reference (``quant`` holds the quantizer), when that is smaller than
every exact coding.

Residuals and words are byte-plane shuffled before zstd, because the high bytes of nearby
floats repeat and the low bytes are noise: grouping them lets zstd find the repetition.
Nothing here touches a store. ``weigh`` chooses a delta's exact coding; ``encoding`` holds
what a coding is and the compressor they share.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from tpde.codec import frames, quant
from tpde.codec.encoding import (DEVICE_COMPRESSORS, Choice, Encoding, Settings, compress,
                                 compress_positions, plane_chunk)
from tpde.codec.transform import native_rows, residual_kinds, residual_mode
from tpde.codec.weigh import DRIFT, EXACT_CHOICE_BYTES, REVALIDATE, encode_exact

if sys.byteorder != "little":  # pragma: no cover - torch supports little-endian hosts only
    raise ImportError("tpde needs a little-endian host")

__all__ = ["CODECS", "Choice", "DEVICE_COMPRESSORS", "DRIFT", "EXACT_CHOICE_BYTES", "Encoding",
           "MANY_BYTES", "REVALIDATE", "Settings", "encode", "encode_many", "plane_chunk"]

CODECS = ("same", "sparse", "dense", "key", "quant")
#: The largest tensor ``encode_many`` codes with others. Larger ones are coded alone, their
#: planes gathered frame by frame into the cache (``frames.compress_planes``): made whole, as
#: a batch makes them, a large embedding's pieces would fault in fresh pages for every
#: plane.
MANY_BYTES = 1 << 20


def encode(new: torch.Tensor, ref: torch.Tensor | None, kind: str,
           settings: Settings | None = None, *, bound: quant.Bound | None = None,
           dtype: str | None = None, choice: Choice | None = None) -> Encoding:
    """Encode ``new`` words against ``ref`` words (or as a keyframe when ``ref`` is None).

    Small tensors are encoded every way and the smallest kept; for large ones the choice is made
    on evenly spaced samples and only the winner is encoded in full (both finalists, when a
    sparse and a dense coding of a mid-size tensor come too close to call). ``choice`` (the
    previous save's ``Encoding.choice`` of this tensor) skips that while it still holds: see
    ``REVALIDATE``. With a ``bound`` on a floating-point ``dtype`` the best exact coding
    competes with the error-bounded ones.
    """
    s = settings or Settings()
    exact = encode_exact(new, ref, kind, s, choice)
    if bound is None or dtype is None or not quant.applies(dtype) or exact.codec == "same":
        return exact
    lossy = _encode_quant(new, ref, dtype, bound, s)
    if lossy is None or lossy.stored >= exact.stored:
        return exact
    lossy.error = quant.errors(new, lossy.words, quant.FLOATS[dtype][0])
    lossy.choice = exact.choice
    return lossy


def encode_many(jobs: list[tuple[torch.Tensor, torch.Tensor | None, str, Choice | None]],
                settings: Settings | None = None) -> list[Encoding | None]:
    """``encode`` of each job (new words, reference words, kind, carried choice) of up to
    ``MANY_BYTES`` that needs no sparse coding weighed: a keyframe (no reference of the same
    shape); a delta whose carried dense choice still holds (``encode``'s checks); and, up to
    ``EXACT_CHOICE_BYTES`` with more than half its words changed, a delta with its options
    weighed in full, each of them coded, as ``encode`` weighs them. Their byte planes are split
    in C and all compressed together (``frames.compress_many``) rather than a few frames at a
    time between a tensor's Python under the GIL. None for every other job, and for a delta
    that no longer stores what its choice promised: ``encode`` codes those one by one."""
    s = settings or Settings()
    out: list[Encoding | None] = [None] * len(jobs)
    if frames.native is None:
        return out
    streams: list[tuple[np.ndarray, int]] = []
    # job, words, changed words (-1: a keyframe), and its options with their streams' indices
    planned: list[tuple[int, int, int, list[tuple[tuple[str, str | None], int]]]] = []
    for i, (new, ref, kind, choice) in enumerate(jobs):
        if ref is not None and (ref.shape != new.shape or ref.dtype != new.dtype):
            ref = None  # coded as a keyframe, as ``encode`` codes it
        nbytes = new.numel() * new.element_size()
        if not 0 < nbytes <= MANY_BYTES:
            continue
        rows = native_rows(new) if ref is None else native_rows(new, ref.to(new.device))
        if rows is None:
            continue
        n, width = rows[0].shape
        count = -1
        options: list[tuple[str, str | None]] = [("key", None)]
        if ref is not None:
            due = choice is None or choice.uses >= REVALIDATE
            carried = not due and choice.option[0] == "dense" \
                and choice.option[1] in residual_kinds(kind)
            if not carried and (nbytes > EXACT_CHOICE_BYTES or not due):
                continue  # (a carried sparse choice: ``encode`` counts the changed words)
            count = frames.native.changed(*rows, width)
            if count == 0:
                out[i] = Encoding("same", choice=choice)
                continue
            if carried and count / n >= choice.changed / DRIFT:
                options = [choice.option]
            elif count <= n // 2 or nbytes > EXACT_CHOICE_BYTES:
                continue  # a sparse coding to weigh, or samples to weigh on: ``encode``'s
            else:
                options += [("dense", how) for how in residual_kinds(kind)]
        chunk = plane_chunk(n, s.chunk)
        coded_as = []
        for option in options:
            planes = np.empty(n * width, dtype=np.uint8)
            mode = 0 if option[0] == "key" else residual_mode(option[1] or "", kind)
            frames.native.diff(rows[0], rows[-1], width, planes, mode, n)
            coded_as.append((option, len(streams)))
            streams.append((planes, chunk))
        planned.append((i, n, count, coded_as))
    coded = frames.compress_many(streams, level=s.level, threads=s.threads)
    for i, n, count, coded_as in planned:
        choice = jobs[i][3]
        built = {option: coded[k] for option, k in coded_as}
        if count < 0:
            out[i] = Encoding("key", sections={"values": built[("key", None)]}, choice=choice)
        elif len(built) == 1:  # the carried choice, kept while it stores what it promised
            assert choice is not None
            enc = Encoding("dense", choice.option[1], count, {"values": built[choice.option]})
            if enc.stored <= DRIFT * choice.per_word * n \
                    and enc.stored < s.key_margin * choice.key_per_word * n:
                enc.choice = dataclasses.replace(choice, uses=choice.uses + 1)
                out[i] = enc
        else:  # weighed as ``encode`` weighs a small tensor's dense options against its keyframe
            key = built.pop(("key", None))
            best = min(built, key=lambda o: built[o].stored)  # the first of equals, as ranked
            if built[best].stored >= s.key_margin * key.stored:
                out[i] = Encoding("key", sections={"values": key})
            else:
                enc = out[i] = Encoding("dense", best[1], count, {"values": built[best]})
                enc.choice = Choice(best, enc.stored / n, key.stored / n, count / n)
    return out


def _encode_quant(new: torch.Tensor, ref: torch.Tensor | None, dtype: str, bound: quant.Bound,
                  s: Settings) -> Encoding | None:
    """The smallest error-bounded coding of ``new`` (None: no grid is coarser than the dtype).

    Each grid is tried with its codes stored densely (in ``quant.order``) and, where at most
    half are nonzero, sparsely: the Elias-delta positions of the nonzero codes and their
    values. Measured per tensor, because fine-tunes give dense codes and sparse updates sparse
    ones.
    """
    if ref is not None and (ref.shape != new.shape or ref.dtype != new.dtype):
        ref = None
    if ref is not None:
        ref = ref.to(new.device)
    best: Encoding | None = None
    for grid, scale in quant.grids(dtype, bound):
        q = quant.quantize(new, ref, dtype, bound, grid, scale)
        nonzero = q.codes != 0
        count = int(nonzero.sum())
        if ref is not None and count == 0 and q.fixes.numel() == 0:
            return Encoding("same", words=ref)  # every element within the bound of its reference
        fixes: dict[str, frames.Section] = {}
        if q.fixes.numel():
            base = ref[q.fixes] if ref is not None else torch.zeros_like(new[q.fixes])
            fixes["fixes"] = compress_positions(q.fixes, s)
            fixes["exact"] = compress(new[q.fixes] ^ base, s)
        z = quant.zigzag(q.codes)
        layouts = [{"values": compress(z[quant.order(ref, dtype)] if ref is not None else z, s)}]
        if count <= new.numel() // 2:
            at = torch.nonzero(nonzero).reshape(-1)
            layouts.append({"values": compress(z[at], s), "positions": compress_positions(at, s)})
        for sections in layouts:
            enc = Encoding("quant", None, count, {**sections, **fixes}, grid, scale, q.rebuilt,
                           against=ref is not None)
            if best is None or enc.stored < best.stored:
                best = enc
    return best
