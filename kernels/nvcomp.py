"""nvCOMP glue: batched zstd on the GPU in RAW mode, producing and reading standard zstd frames.

Frames are cut exactly as ``tpde.frames`` cuts them on the CPU, so a chain written on a GPU
restores on a CPU-only machine and the reverse.  Without a CUDA device or the ``gpu`` extra,
``available()`` is False and callers take the CPU path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tpde.errors import FormatError
from tpde.frames import Section, raw_sizes


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _codec(device: int, chunk: int) -> Any:
    """One codec per device and chunk size, built once: nvCOMP's setup is not free."""
    from nvidia import nvcomp

    return nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                        device_id=device, uncomp_chunk_size=chunk)


def compress(planes: torch.Tensor, *, level: int, chunk: int) -> Section:
    """Compress CUDA bytes chunk by chunk; only the compressed frames reach host memory.

    nvCOMP's zstd has no level setting; ``level`` is accepted so callers need not care.
    """
    from nvidia import nvcomp

    del level
    flat = planes.reshape(-1)
    codec = _codec(flat.device.index or 0, chunk)
    pieces = [flat[i : i + chunk] for i in range(0, flat.numel(), chunk)]
    encoded = codec.encode([nvcomp.as_array(p) for p in pieces]) if pieces else []
    frames = tuple(torch.from_dlpack(e).cpu().numpy().tobytes() for e in encoded)
    return Section(flat.numel(), chunk, frames)


def decompress(frames: list[bytes], raw: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Decode frames (written by either side) into one CUDA byte tensor of ``raw`` bytes."""
    from nvidia import nvcomp

    codec = _codec(device.index or 0, chunk)
    arrays = [nvcomp.as_array(torch.frombuffer(bytearray(f), dtype=torch.uint8).to(device))
              for f in frames]
    out = [torch.from_dlpack(d) for d in codec.decode(arrays)] if arrays else []
    if [o.numel() for o in out] != raw_sizes(raw, chunk):
        raise FormatError("nvCOMP decoded a frame to the wrong number of bytes")
    return torch.cat([o.view(torch.uint8).reshape(-1) for o in out]) if out else \
        torch.empty(0, dtype=torch.uint8, device=device)
