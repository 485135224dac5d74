"""Choosing a delta's exact coding: every option weighed (in full for a small tensor, on
samples of a large one), the smallest kept, a close call settled by coding both finalists, and
a tensor's last choice carried to its next saves while it holds."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from tpde.codec import elias, frames
from tpde.codec.encoding import (Choice, Encoding, Settings, compress, compress_positions,
                                 plane_chunk)
from tpde.codec.transform import native_rows, residual, residual_kinds, residual_mode

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


def sample_starts(length: int) -> tuple[list[int], int] | None:
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
            return compress(a, s, rows=rows[0] if whole and rows else None)
        ab = rows if whole else native_rows(a, b)
        if ab:
            return compress(a, s, against=ab[1], mode=residual_mode(how, self.kind), rows=ab[0])
        return compress(residual(a, b, how, self.kind), s)

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
                self.coded_positions = compress_positions(self.positions(), self.s)
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
                sample = None if exact else sample_starts(length)
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


def encode_exact(new: torch.Tensor, ref: torch.Tensor | None, kind: str, s: Settings,
                  choice: Choice | None) -> Encoding:
    if ref is None or ref.shape != new.shape or ref.dtype != new.dtype:
        # A re-key keeps the tensor's delta choice for the deltas after it.
        return Encoding("key", sections={"values": compress(new, s)}, choice=choice)
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
