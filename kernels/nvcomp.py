"""nvCOMP glue: batched zstd on the GPU in RAW mode, producing and reading standard zstd frames.

Frames are cut exactly as ``tpde.codec.frames`` cuts them on the CPU, so a chain written on a GPU
restores on a CPU-only machine and the reverse.  Decoding takes many streams at once: their
compressed bytes travel to the device in one copy and nvCOMP writes every chunk straight into
its place in one device buffer (from torch's caching allocator, as are nvCOMP's own scratch
buffers). Without a CUDA device or the ``gpu`` extra, ``available()`` is False and callers
take the CPU path.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import numpy as np
import torch

from tpde.codec import encoding
from tpde.codec.frames import Section, raw_sizes
from tpde.codec.unframe import check_declared
from tpde.errors import FormatError

#: One stream to decode: its frames, its raw size and its raw chunk size.
Stream = tuple[Sequence[bytes | memoryview], int, int]


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


class _Block:
    """Device memory nvCOMP asked for, taken from torch's caching allocator on nvCOMP's stream."""

    def __init__(self, nbytes: int, stream: Any) -> None:
        device = torch.device("cuda", stream.device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=device)):
            self._tensor = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
        self.ptr = self._tensor.data_ptr()


_setup = threading.Lock()


@functools.cache
def _codec(device: int, stream: int, chunk: int) -> Any:
    """One codec per device, stream and chunk size, built once: nvCOMP's setup is not free.

    The codec works on the caller's torch stream, so what it writes is ordered before the
    kernels that read it, with no synchronisation.
    """
    from nvidia import nvcomp

    with _setup:
        nvcomp.set_device_allocator(_Block)
        return nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                            device_id=device, cuda_stream=stream, uncomp_chunk_size=chunk)


def _current(device: torch.device, chunk: int) -> tuple[Any, int]:
    stream = torch.cuda.current_stream(device).cuda_stream
    return _codec(device.index if device.index is not None else torch.cuda.current_device(),
                  stream, chunk), stream


@functools.lru_cache(maxsize=1024)
def _config(codec: Any, sizes: tuple[int, ...]) -> Any:
    """A decompression config built from the raw chunk sizes alone: no header is read back
    from the device, so decoding never waits for the GPU. Built once per shape of a batch."""
    return codec.decompression_config(codec.compression_config(list(sizes)))


def compress(planes: torch.Tensor, *, level: int | None, chunk: int) -> Section:
    """Compress CUDA bytes chunk by chunk; only the compressed frames reach host memory.

    nvCOMP's zstd has no level setting; ``level`` is accepted so callers need not care.
    """
    from nvidia import nvcomp

    del level
    flat = planes.reshape(-1).contiguous()
    sizes = raw_sizes(flat.numel(), chunk)
    if not sizes:
        return Section(0, chunk, ())
    codec, stream = _current(flat.device, chunk)
    batch = nvcomp.as_arrays(flat, [i * chunk for i in range(len(sizes))], sizes,
                             cuda_stream=stream)
    encoded = codec.encode(batch).cpu()
    return Section(flat.numel(), chunk, tuple(np.asarray(e).tobytes() for e in encoded))


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def decompress_many(streams: Sequence[Stream], device: torch.device) -> list[torch.Tensor]:
    """Decode the frames of many streams (written by either side) with one nvCOMP call.

    Returns one CUDA byte tensor per stream: views of a single buffer, each of its raw size.
    A frame whose header declares another size than its chunk's is refused.
    """
    from nvidia import nvcomp

    sizes = [raw_sizes(raw, chunk) for _, raw, chunk in streams]
    for (fr, _, _), want in zip(streams, sizes):
        if len(fr) != len(want):
            raise FormatError("chunk count does not match the stream's raw size")
        # nvCOMP reports each output's capacity, not what it wrote: the sizes are checked
        # here, from the frame headers, and the words against their hash by the caller.
        check_declared(fr, want)
    codec, stream = _current(device, max((c for *_, c in streams), default=65536))
    # Every frame and every output chunk starts where nvCOMP can read and write it.
    align = max(16, codec.get_required_decompression_alignment())
    in_at, out_at, in_len, out_len, starts = [], [], [], [], []
    put = out_total = 0
    for (fr, raw, _), want in zip(streams, sizes):
        starts.append(out_total)
        at = out_total
        for f, n in zip(fr, want):
            in_at.append(put)
            in_len.append(len(f))
            put = _align(put + len(f), align)
            out_at.append(at)
            out_len.append(n)
            at += n
        out_total = _align(at, align)
    out = torch.empty(max(1, out_total), dtype=torch.uint8, device=device)
    views = [out[s : s + raw] for s, (_, raw, _) in zip(starts, streams)]
    if not in_at:
        return views
    staging = torch.empty(put, dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for f, a, n in zip((f for fr, *_ in streams for f in fr), in_at, in_len):
        host[a : a + n] = np.frombuffer(f, dtype=np.uint8)
    comp = staging.to(device, non_blocking=True)
    try:
        src = nvcomp.as_arrays(comp, in_at, in_len, cuda_stream=stream)
        dst = nvcomp.as_arrays(out, out_at, out_len, cuda_stream=stream)
        codec.decode(src, out=dst, decompression_config=_config(codec, tuple(out_len)))
    except (RuntimeError, ValueError) as exc:
        raise FormatError(f"nvCOMP cannot decode a zstd frame: {exc}") from None
    return views


def decompress(frames: Sequence[bytes | memoryview], raw: int, chunk: int,
               device: torch.device) -> torch.Tensor:
    """Decode one stream's frames into one CUDA byte tensor of ``raw`` bytes."""
    return decompress_many([(frames, raw, chunk)], device)[0]


def _on_device(planes: torch.Tensor, level: int | None, chunk: int) -> Section | None:
    """The codec's compressor of CUDA words (``encoding.DEVICE_COMPRESSORS``): nvCOMP's zstd
    where it is installed, else None (the codec then compresses on the host)."""
    return compress(planes, level=level, chunk=chunk) if available() else None


encoding.DEVICE_COMPRESSORS["cuda"] = _on_device
