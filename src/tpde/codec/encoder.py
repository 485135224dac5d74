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
Nothing here touches a store.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from tpde.codec import elias, frames, quant
from tpde.codec.transform import native_rows, residual, residual_kinds, residual_mode, shuffle

if sys.byteorder != "little":  # pragma: no cover - torch supports little-endian hosts only
    raise ImportError("tpde needs a little-endian host")

CODECS = ("same", "sparse", "dense", "key", "quant")
#: Above this many raw bytes the choice between codecs is made on a sample, not the whole tensor.
EXACT_CHOICE_BYTES = 256 * 1024
#: The sample: evenly spaced windows, together about 1/SAMPLE_FRACTION of the tensor, each
#: between the two window sizes: a fixed sample would cost a mid-size tensor more than its
#: own encode (figures: ``benchmarks/README.md``).
SAMPLE_WINDOWS, SAMPLE_FRACTION = 16, 8
MIN_WINDOW_WORDS, MAX_WINDOW_WORDS = 512, 8192
#: A sparse and a dense option whose estimated sizes are closer than this are both coded in
#: full, up to CLOSE_CALL_BYTES: samples mis-rank options that close on mid-size bf16
#: projections, while larger tensors have larger samples and coding them both ways costs
#: their save more than it gains.
CLOSE_CALL, CLOSE_CALL_BYTES = 1.1, 4 << 20
#: Host tensors up to this many words are sampled and compared with numpy, not torch, whose
#: intra-op threads start on every call (``_changes``).
NUMPY_WORDS = 1 << 20
#: A tensor's coding, once chosen in full, is coded straight away at its next saves (most
#: tensors keep their choice from delta to delta); the full choice is made again after
#: REVALIDATE saves that used it,
#: and as soon as it stores more than DRIFT times the bytes per word it did when chosen, the
#: share of changed words moves by more than a factor DRIFT towards the other kind of coding
#: (a sparse coding's size follows it: without this, bf16 projections kept a dense choice
#: larger than sparse), or it comes within the key margin of the keyframe's size then.
#: Fewer changed words only favour a sparse choice more, and more of them a dense one, so
#: only a move towards the other kind calls for a new choice.
REVALIDATE, DRIFT = 8, 1.1

#: The largest tensor ``encode_many`` codes with others. Larger ones are coded alone, their
#: planes gathered frame by frame into the cache (``frames.compress_planes``): made whole, as
#: a batch makes them, a large embedding's pieces would fault in fresh pages for every
#: plane.
MANY_BYTES = 1 << 20


@dataclass
class Settings:
    """Encoder knobs; every field has a measured default."""

    level: int | None = frames.DEFAULT_LEVEL
    chunk: int = frames.DEFAULT_CHUNK
    threads: int | None = None
    #: A delta is used only when it is smaller than this fraction of the keyframe encoding:
    #: lower keeps keyframes a delta beats, 1.0 makes chains deep enough that forced re-keys
    #: cost more (measured over ``benchmarks/compare.py``'s chains).
    key_margin: float = 0.95
    block: int = elias.DEFAULT_BLOCK


@dataclass(frozen=True)
class Choice:
    """A tensor's delta coding as last chosen in full, carried to its next saves."""

    option: tuple[str, str | None]
    per_word: float  # stored bytes per word when chosen
    key_per_word: float  # the keyframe coding's (estimated) bytes per word then
    changed: float  # the share of words that had changed
    uses: int = 0  # saves coded with it since


@dataclass
class Encoding:
    codec: str
    residual: str | None = None
    count: int = 0
    sections: dict[str, frames.Section] = field(default_factory=dict)
    #: ``quant`` only: the grid and its scale.
    grid: str | None = None
    scale: float | None = None
    #: Under a bound: the words a reader rebuilds when they differ from the saved ones (the next
    #: step's reference), and the largest absolute and relative errors.
    words: torch.Tensor | None = None
    error: tuple[float, float] | None = None
    #: Whether the words are coded against the reference (``quant`` may code without one).
    against: bool = True
    #: The delta coding to try first at the tensor's next save (None: choose in full).
    choice: Choice | None = None

    @property
    def keyed(self) -> bool:
        """A keyframe record: no reference."""
        return self.codec == "key" or (self.codec == "quant" and not self.against)

    @property
    def stored(self) -> int:
        return sum(s.stored for s in self.sections.values())


# ---------------------------------------------------------------- encoding
#: Compressors of byte planes on a device, by device type: ``(planes, level, chunk)`` to a
#: section of standard zstd frames, or None where the device's library is missing. The GPU
#: side registers its own as it loads (``tpde.kernels.nvcomp``), so that the codec stands on
#: nothing of it; words of a device without one are compressed on the host.
DEVICE_COMPRESSORS: dict[str, Callable[[torch.Tensor, int | None, int], frames.Section | None]] = {}


def plane_chunk(words: int, target: int) -> int:
    """A chunk size near ``target`` that tiles the byte planes of ``words`` words.

    Each plane is ``words`` bytes. Chunks that straddle planes mix the compressible top bytes
    with incompressible mantissa bytes under one Huffman table, which compresses worse than
    chunks of one plane each. Where the plane
    size has no divisor in range, chunks drift by less than one byte per chunk.
    """
    if words <= 0:
        return target
    per_plane = -(-words // target)
    return max(frames.MIN_CHUNK, min(frames.MAX_CHUNK, -(-words // per_plane)))


def _compress(words: torch.Tensor, s: Settings, *, against: np.ndarray | None = None,
              mode: int = 0, rows: np.ndarray | None = None) -> frames.Section:
    """The words' byte planes compressed; with ``against`` (the reference's words as
    ``native_rows`` gives them), those of their residual in ``mode``. ``rows``: the words'
    own, where the caller has them already."""
    chunk = plane_chunk(words.numel(), s.chunk)
    on_device = DEVICE_COMPRESSORS.get(words.device.type)
    if on_device is not None:
        section = on_device(shuffle(words), s.level, chunk)
        if section is not None:
            return section
    # Shuffled frame by frame as they are compressed: no byte planes are made beside the words.
    if rows is None:
        rows = words.contiguous().view(torch.uint8).cpu().numpy().reshape(-1,
                                                                        words.element_size())
    return frames.compress_planes(rows, against=against, mode=mode, level=s.level, chunk=chunk,
                                  threads=s.threads)


def _sample_starts(length: int) -> tuple[list[int], int] | None:
    """Starts of evenly spaced windows of ``length`` elements, and the window size (None when
    a sample would be half the whole or more)."""
    size = min(MAX_WINDOW_WORDS,
               max(MIN_WINDOW_WORDS, length // (SAMPLE_WINDOWS * SAMPLE_FRACTION)))
    if 2 * SAMPLE_WINDOWS * size > length:
        return None
    span = length - size
    return [span * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)], size


def _windows(t: torch.Tensor, sample: tuple[list[int], int]) -> torch.Tensor:
    """The windows of ``t`` at the sample's starts, end to end: slices, not a gather by index
    (the sampling of a mid-size tensor cost as much as its full encode that way); numpy's
    concatenate up to ``NUMPY_WORDS``, which costs less there than torch's."""
    starts, size = sample
    if t.is_cuda or t.numel() > NUMPY_WORDS:
        return torch.cat([t[a : a + size] for a in starts])
    host = t.numpy()
    return torch.from_numpy(np.concatenate([host[a : a + size] for a in starts]))


def _gather(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``t[at]``; on the host with ``np.take``, in half the time of torch's indexing."""
    return t[at] if t.is_cuda else torch.from_numpy(np.take(t.numpy(), at.numpy()))


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
    exact = _encode_exact(new, ref, kind, s, choice)
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
            fixes["fixes"] = _positions(q.fixes, s)
            fixes["exact"] = _compress(new[q.fixes] ^ base, s)
        z = quant.zigzag(q.codes)
        layouts = [{"values": _compress(z[quant.order(ref, dtype)] if ref is not None else z, s)}]
        if count <= new.numel() // 2:
            at = torch.nonzero(nonzero).reshape(-1)
            layouts.append({"values": _compress(z[at], s), "positions": _positions(at, s)})
        for sections in layouts:
            enc = Encoding("quant", None, count, {**sections, **fixes}, grid, scale, q.rebuilt,
                           against=ref is not None)
            if best is None or enc.stored < best.stored:
                best = enc
    return best


def _positions(at: torch.Tensor, s: Settings) -> frames.Section:
    return frames.compress(elias.encode(at.cpu().numpy(), s.block), level=1, chunk=s.chunk,
                           threads=s.threads)


def _changes(new: torch.Tensor, ref: torch.Tensor, rows: list[np.ndarray] | None
             ) -> tuple[int, Callable[..., torch.Tensor] | None]:
    """How many words differ, and (when at most half do: only then is a sparse coding sized) a
    function that finds where, called only when a sparse coding is built: a tensor whose
    carried choice is dense is never searched. The count tells an unchanged tensor too:
    torch.equal reads both in full as well, and takes as long as the mask and its count
    together. With ``rows`` (``native_rows`` of both) that function
    also takes ``planes`` (``count`` bytes per plane), where it puts the changed words' XOR
    residual.

    Host words are counted, and searched, by ``tpde.codec._planes`` without a mask, which
    otherwise takes a large share of a sparse chain's save. Without it, up to ``NUMPY_WORDS``
    host words the mask is numpy's: torch's starts its intra-op threads on every call from the
    encode threads. Larger tensors keep torch's, whose threads pay there: numpy's on a sharded
    save's pieces raised each rank's peak resident set (why numpy's allocations there cost
    more was not pinned down).
    """
    n = new.numel()
    if rows:
        count = frames.native.changed(*rows, new.element_size())

        def where(planes: np.ndarray | None = None) -> torch.Tensor:
            at = np.empty(count, dtype=np.int64)
            frames.native.changed(*rows, new.element_size(), at, planes)
            return torch.from_numpy(at)
    elif new.is_cuda or n > NUMPY_WORDS:
        changed = new != ref
        count = int(torch.count_nonzero(changed))  # far faster than a bool sum()
        # numpy's is faster than torch.nonzero on the CPU; the same int64 positions
        where = (lambda: torch.nonzero(changed).reshape(-1)) if changed.is_cuda \
            else (lambda: torch.from_numpy(np.flatnonzero(changed.numpy())))
    else:
        mask = np.not_equal(new.numpy(), ref.numpy())
        count = int(np.count_nonzero(mask))
        where = lambda: torch.from_numpy(np.flatnonzero(mask))  # noqa: E731
    return count, where if 0 < count <= n // 2 else None


class _Options:
    """The codings weighed for one tensor's delta, each built (compressed) at most once: the
    keyframe, a dense residual of each kind, and the sparse XOR of the changed words."""

    def __init__(self, new: torch.Tensor, ref: torch.Tensor, kind: str, s: Settings,
                 rows: Any, count: int, where: Callable[..., torch.Tensor] | None) -> None:
        self.new, self.ref, self.kind, self.s, self.rows = new, ref, kind, s, rows
        self.count, self.where, self.n = count, where, new.numel()
        self.options: list[tuple[str, str | None]] = [("key", None)]
        self.options += [("dense", how) for how in residual_kinds(kind)]
        if where is not None:
            self.options.append(("sparse", "xor"))
        # The changed words' positions: searched once, when first asked for, or found with
        # the values of a full sparse coding (its XOR residual's planes, made in one pass).
        self.found: list[torch.Tensor] = []
        self.built: dict[tuple[str, str | None], frames.Section] = {}
        self.coded_positions: frames.Section | None = None  # coded already, in full
        self.sizes: dict[tuple[str, str | None], float] = {}

    def positions(self) -> torch.Tensor:
        if not self.found:
            assert self.where is not None  # asked for only where a sparse coding is an option
            self.found.append(self.where())
        return self.found[0]

    def build(self, option: tuple[str, str | None],
              sample: tuple[list[int], int] | None = None) -> frames.Section:
        """An option compressed: the words of every element, or of the changed ones (sparse);
        of the sample's windows only, when given. Host residuals are split into planes as they
        are compressed (``frames.compress_planes``), never made whole."""
        name, how = option
        new, ref, s, rows = self.new, self.ref, self.s, self.rows
        if name == "sparse" and sample is None and rows and not self.found:
            assert self.where is not None
            planes = np.empty(self.count * new.element_size(), dtype=np.uint8)
            self.found.append(self.where(planes))
            return frames.compress(planes, level=s.level, chunk=plane_chunk(self.count, s.chunk),
                                   threads=s.threads)
        if name == "sparse":
            at = self.positions() if sample is None else _windows(self.positions(), sample)
            a, b, how = _gather(new, at), _gather(ref, at), "xor"
        else:
            a, b = (new, ref) if sample is None else (_windows(new, sample), _windows(ref, sample))
        whole = sample is None and name != "sparse"  # new and ref themselves
        if name == "key":
            return _compress(a, s, rows=rows[0] if whole and rows else None)
        ab = rows if whole else native_rows(a, b)
        if ab:
            return _compress(a, s, against=ab[1], mode=residual_mode(how, self.kind), rows=ab[0])
        return _compress(residual(a, b, how, self.kind), s)

    def whole(self, option: tuple[str, str | None]) -> frames.Section:
        """An option built in full (kept, should it win)."""
        if option not in self.built:
            self.built[option] = self.build(option)
        return self.built[option]

    def coded(self, option: tuple[str, str | None], values: frames.Section) -> Encoding:
        enc = Encoding(option[0], option[1], self.count if option[0] != "key" else 0,
                       {"values": values})
        if option[0] == "sparse":
            if self.coded_positions is None:
                self.coded_positions = _positions(self.positions(), self.s)
            enc.sections["positions"] = self.coded_positions
        return enc

    def position_bytes(self) -> float:
        if self.coded_positions is not None:
            return self.coded_positions.stored
        return elias.encoded_bits(self.positions().cpu().numpy()) / 8 \
            + 16 * (self.count // self.s.block + 1)

    def reuse(self, choice: Choice | None) -> Encoding | None:
        """The coding chosen at the tensor's last save, where the share of changed words has
        not drifted and its bytes still hold: nothing else is weighed."""
        if choice is None or choice.uses >= REVALIDATE or choice.option not in self.options:
            return None
        share = self.count / self.n
        if not (share <= choice.changed * DRIFT if choice.option[0] == "sparse"
                else share >= choice.changed / DRIFT):
            return None
        enc = self.coded(choice.option, self.whole(choice.option))
        if enc.stored <= DRIFT * choice.per_word * self.n \
                and enc.stored < self.s.key_margin * choice.key_per_word * self.n:
            enc.choice = dataclasses.replace(choice, uses=choice.uses + 1)
            return enc
        return None

    def weigh(self) -> None:
        """Every option's stored bytes: in full where the tensor is small, else estimated
        from samples of its words."""
        sizes = self.sizes
        exact = self.n * self.new.element_size() <= EXACT_CHOICE_BYTES
        for option in self.options:
            if option not in self.built:
                length = self.count if option[0] == "sparse" else self.n
                sample = None if exact else _sample_starts(length)
                coded_as = self.build(option, sample)
                if sample is None:  # the whole of it: kept, should it win
                    self.built[option] = coded_as
                else:
                    sizes[option] = coded_as.stored * length / (SAMPLE_WINDOWS * sample[1])
            if option in self.built:
                sizes[option] = self.built[option].stored
            # The positions are sized only where the values alone would beat every dense one.
            if option[0] == "sparse" and sizes[option] < min(sizes[o] for o in sizes
                                                              if o[0] == "dense"):
                sizes[option] += self.position_bytes()

    def best(self) -> tuple[str, str | None]:
        """The smallest option as weighed, a close call between sparse and dense settled by
        coding both in full, and the keyframe unless a delta beats it by the key margin."""
        sizes = self.sizes
        ranked = sorted((o for o in sizes if o[0] != "key"), key=sizes.__getitem__)
        best = ranked[0]
        if len(ranked) > 1 and ("sparse", "xor") in ranked[:2] \
                and sizes[ranked[1]] <= CLOSE_CALL * sizes[best] \
                and self.n * self.new.element_size() <= CLOSE_CALL_BYTES:
            # Too close to call on the Elias estimate (its block headers make it high) or on
            # samples: both are coded in full, positions too, and the smaller kept. (Between
            # dense residuals samples rank well enough: settling those too slowed fp32 saves
            # markedly for next to no bytes.)
            for option in ranked[:2]:
                sizes[option] = self.whole(option).stored
                if option[0] == "sparse":
                    sizes[option] += self.coded(option, self.whole(option)) \
                        .sections["positions"].stored
            best = min(ranked[:2], key=sizes.__getitem__)
        if sizes[best] >= self.s.key_margin * sizes[("key", None)]:
            best = ("key", None)
        return best


def _encode_exact(new: torch.Tensor, ref: torch.Tensor | None, kind: str, s: Settings,
                  choice: Choice | None) -> Encoding:
    if ref is None or ref.shape != new.shape or ref.dtype != new.dtype:
        # A re-key keeps the tensor's delta choice for the deltas after it.
        return Encoding("key", sections={"values": _compress(new, s)}, choice=choice)
    ref = ref.to(new.device, non_blocking=True)
    # The host words' rows, asked for once (an encode asked four times, under the GIL that
    # every encode thread needs).
    rows = native_rows(new, ref)
    count, where = _changes(new, ref, rows)
    if count == 0:
        return Encoding("same", choice=choice)
    options = _Options(new, ref, kind, s, rows, count, where)
    enc = options.reuse(choice)
    if enc is not None:
        return enc
    options.weigh()
    best = options.best()
    if best[0] != "sparse":
        options.found.clear()  # not needed any more: freed, with any mask, before the full encode
        options.where = None
    enc = options.coded(best, options.built.get(best) or options.build(best))
    if best[0] != "key":
        enc.choice = Choice(best, enc.stored / options.n, options.sizes[("key", None)]
                            / options.n, count / options.n)
    return enc
