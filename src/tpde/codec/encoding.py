"""What a coding is, and the compressor every coding of a record shares: the codec's settings,
the carried choice, the encoding a record is stored as, and byte-plane compression on the host
or, where the GPU side registered one, on a device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tpde.codec import elias, frames
from tpde.codec.transform import shuffle

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


def compress(words: torch.Tensor, s: Settings, *, against: np.ndarray | None = None,
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


def compress_positions(at: torch.Tensor, s: Settings) -> frames.Section:
    """Changed positions, Elias-delta coded and compressed (a sparse coding's ``positions``)."""
    return frames.compress(elias.encode(at.cpu().numpy(), s.block), level=1, chunk=s.chunk,
                           threads=s.threads)
