"""The frame stage on its own: zstd compression and decompression of a stream's byte planes
in 256 KiB frames, by ``tpde.codec.frames`` (the process's frame threads, one zstd call per frame)
against zstandard's batch API (``multi_compress_to_buffer`` / ``multi_decompress_to_buffer``,
which start their threads on every call, then a copy of every frame into the result, as tpde
did before). "To words" is what a restore needs: the planes decompressed and put back
together as words, by the batch API and then ``transform.unshuffle`` (before), or by
``transform.stream_words`` (``unframe.unshuffle_into``), which puts each frame in place as it is
decompressed.

Streams: the byte planes of a 64 MiB fp32 weight (a keyframe) and of the residual of a small
dense update of it (a delta), as ``tpde.codec.encoder`` makes them. Rates are raw bytes per second,
medians of 5.

    python benchmarks/frames_bench.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import time
from typing import Callable

import torch
import zstandard

from tpde.codec import encoder, frames, transform, unframe

MB = 1e6


def batch_api_compress(data: memoryview, chunk: int, threads: int) -> list[bytes]:
    cctx = frames.compressor(None, chunk)
    starts = range(0, len(data), chunk)
    segments = struct.pack(f"={2 * len(starts)}Q",
                           *(v for a in starts for v in (a, min(chunk, len(data) - a))))
    out = cctx.multi_compress_to_buffer(zstandard.BufferWithSegments(data, segments),
                                        threads=threads)
    return [seg.tobytes() for seg in out]


def batch_api_decompress(fr: list[bytes], raw: int, chunk: int, threads: int) -> bytearray:
    sizes = frames.raw_sizes(raw, chunk)
    whole, at = bytearray(raw), 0
    view = memoryview(whole)
    for i in range(0, len(fr), 32):
        group = sizes[i : i + 32]
        parts = zstandard.ZstdDecompressor().multi_decompress_to_buffer(
            fr[i : i + 32], threads=threads,
            decompressed_sizes=struct.pack(f"={len(group)}Q", *group))
        for part, n in zip(parts, group):
            view[at : at + n] = part
            at += n
    return whole


def rate(fn: Callable[[], object], raw: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return raw / statistics.median(times) / MB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16 << 20, generator=g) * 0.02
    moved = w + 1e-4 * torch.randn(w.shape, generator=g) * 0.02
    streams = {
        "keyframe": transform.shuffle(w.view(torch.int32)),
        "delta": transform.shuffle(transform.residual(moved.view(torch.int32), w.view(torch.int32),
                                              "sub", "float")),
    }
    rows = []
    for name, planes in streams.items():
        data = memoryview(planes.numpy()).cast("B")
        chunk = encoder.plane_chunk(w.numel(), frames.DEFAULT_CHUNK)
        sec = frames.compress(data, chunk=chunk)
        fr = list(sec.frames)
        assert bytes(batch_api_decompress(fr, sec.raw, chunk, 1)) == data.tobytes()
        assert unframe.decompress(fr, sec.raw, chunk).tobytes() == data.tobytes()
        assert torch.equal(transform.stream_words(unframe.Frames(fr, sec.raw, chunk), torch.int32),
                           transform.unshuffle(planes, torch.int32))
        for threads in (1, 2):
            row = {"stream": name, "threads": threads, "ratio": round(sec.raw / sec.stored, 3),
                   "compress_batch_api_MBps": rate(
                       lambda: batch_api_compress(data, chunk, threads), sec.raw),
                   "compress_tpde_MBps": rate(
                       lambda: frames.compress(data, chunk=chunk, threads=threads), sec.raw),
                   "decompress_batch_api_MBps": rate(
                       lambda: batch_api_decompress(fr, sec.raw, chunk, threads), sec.raw),
                   "decompress_tpde_MBps": rate(
                       lambda: unframe.decompress(fr, sec.raw, chunk, threads=threads), sec.raw),
                   "words_batch_api_MBps": rate(lambda: transform.unshuffle(torch.frombuffer(
                       batch_api_decompress(fr, sec.raw, chunk, threads), dtype=torch.uint8),
                       torch.int32), sec.raw),
                   "words_tpde_MBps": rate(
                       lambda: transform.stream_words(unframe.Frames(fr, sec.raw, chunk),
                                                      torch.int32, threads=threads), sec.raw)}
            rows.append({k: round(v) if isinstance(v, float) and k.endswith("MBps") else v
                         for k, v in row.items()})
    stages = ("compress", "decompress", "words")
    print("| stream | threads | ratio | " + " | ".join(
        f"{st}: {who}" for st in stages for who in ("batch API", "tpde")) + " |")
    print("|---|---|---|" + "---|" * 2 * len(stages))
    for r in rows:
        print(f"| {r['stream']} | {r['threads']} | {r['ratio']} | " + " | ".join(
            f"{r[f'{st}_{who}_MBps']} MB/s" for st in stages for who in ("batch_api", "tpde"))
            + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "torch": torch.__version__,
                                   "zstandard": zstandard.__version__},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
