"""GPU decoding figures: nvCOMP zstd, the Elias-delta position decoder, the Triton kernels, and
whole steps rebuilt on the device against the CPU rebuild plus a copy.

The data is shaped like training: fp32 weights (randn * 0.02) and their byte planes, a sparse
update touching 1% of the positions, a dense drift of every weight. Each figure is the median
of ``--repeats`` timed runs after one warm-up, with the device synchronised around each run.
Rates are bytes of decoded output per second (positions: int64 positions written).

    python benchmarks/gpu_bench.py [--mb 256] [--json benchmarks/results/gpu_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

import tpde
from tpde.codec import elias, frames, transform, unframe
from tpde.kernels import nvcomp
from tpde.kernels import triton_kernels as tk
from tpde.runtime import frame_threads


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="size of the fp32 tensor, in MB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not (torch.cuda.is_available() and nvcomp.available() and tk.available()):
        raise SystemExit("gpu_bench needs a CUDA device, nvidia-nvcomp and triton")
    dev = torch.device("cuda")
    n = args.mb * 1_000_000 // 4
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g) * 0.02
    words = transform.to_words(w, torch.int32)
    planes = transform.shuffle(words)
    rows: list[dict[str, Any]] = []

    def row(what: str, seconds: float, nbytes: int, **extra: Any) -> None:
        rows.append({"what": what, "ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9,
                     **extra})
        more = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{what:44s} {seconds * 1e3:9.2f} ms {nbytes / seconds / 1e9:8.2f} GB/s {more}")

    raw = planes.numel()
    # zstd: frames written by the CPU at level 1, decoded by nvCOMP and by the CPU.
    sec = frames.compress(memoryview(planes.numpy()), level=1, chunk=frames.DEFAULT_CHUNK)
    fr = list(sec.frames)
    ratio = round(raw / sec.stored, 3)
    row("nvCOMP decode (CPU zstd-1 frames)", median_s(
        lambda: nvcomp.decompress(fr, sec.raw, sec.chunk, dev), args.repeats), raw, ratio=ratio)
    cpu_threads = frame_threads.default_threads()
    row(f"CPU zstd decode ({cpu_threads} threads)", median_s(
        lambda: unframe.decompress(fr, sec.raw, sec.chunk), args.repeats), raw)
    row("CPU zstd decode + copy to device", median_s(
        lambda: torch.frombuffer(unframe.decompress(fr, sec.raw, sec.chunk),
                                 dtype=torch.uint8).to(dev), args.repeats), raw)
    # nvCOMP decodes one chunk per thread block: a small batch (a mounted module's weights)
    # leaves most of the GPU idle, and its latency is that of one chunk.
    for mb in (8, args.mb):
        part = memoryview(planes.numpy())[: mb * 1_000_000]
        for chunk in (65536, 131072, frames.DEFAULT_CHUNK):
            s = frames.compress(part, level=1, chunk=chunk)
            f = list(s.frames)
            row(f"nvCOMP decode {mb} MB, {chunk // 1024} KiB chunks", median_s(
                lambda: nvcomp.decompress(f, s.raw, s.chunk, dev), args.repeats), s.raw,
                ratio=round(s.raw / s.stored, 4), chunks=len(f))
    on_dev = planes.to(dev)
    gsec = nvcomp.compress(on_dev, level=1, chunk=frames.DEFAULT_CHUNK)
    row("nvCOMP encode", median_s(
        lambda: nvcomp.compress(on_dev, level=1, chunk=frames.DEFAULT_CHUNK), args.repeats), raw,
        ratio=round(raw / gsec.stored, 3))
    assert unframe.decompress(list(gsec.frames), gsec.raw, gsec.chunk).tobytes() == \
        planes.numpy().tobytes(), "nvCOMP frames differ from the input on the CPU"

    # The Triton kernels.
    row("unshuffle kernel (fp32 planes)", median_s(
        lambda: tk.unshuffle(on_dev, torch.int32), args.repeats), raw)
    ref = transform.to_words(w + 1e-4 * torch.randn(n, generator=g), torch.int32)
    ref_dev, words_dev = ref.to(dev), words.to(dev)
    for how in ("xor", "sub"):
        r = transform.residual(words, ref, how, "float").to(dev)
        target = ref_dev.clone()
        row(f"dense {how} residual kernel", median_s(
            lambda: tk.apply_residual_(target, r, how, "float"), args.repeats), raw)
    count = n // 100
    pos = torch.from_numpy(np.sort(np.random.default_rng(0).choice(n, count, replace=False)))
    stream = elias.encode(pos.numpy(), elias.DEFAULT_BLOCK)
    got = tk.decode_positions(stream, dev, limit=n)
    assert torch.equal(got.cpu(), pos), "GPU positions differ from the CPU decoder"
    t = median_s(lambda: tk.decode_positions(stream, dev, limit=n), args.repeats)
    row(f"Elias-delta decode, GPU ({count} positions)", t, count * 8,
        positions_per_s=f"{count / t:.3g}", stream_bytes=len(stream))
    row(f"Elias-delta decode, CPU ({count} positions)", median_s(
        lambda: elias.decode(stream, limit=n), args.repeats), count * 8)
    vals = (words[pos] ^ ref[pos]).to(dev)
    pos_dev = pos.to(dev)
    row(f"sparse XOR kernel ({count} positions)", median_s(
        lambda: tk.apply_sparse_xor_(words_dev, pos_dev, vals), args.repeats), count * 4)

    # Whole steps: a keyframe, a 1% sparse update, a dense drift.
    state = {f"layer{i}": w[i * (n // 4) : (i + 1) * (n // 4)].clone().reshape(-1, 1000)
             for i in range(4)}
    with tempfile.TemporaryDirectory() as run:
        with tpde.Checkpointer(run) as ckpt:
            ckpt.save(0, state)
            for t in state.values():
                flat = t.view(-1)
                flat[torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)] += 1e-3
            ckpt.save(1, state)
            for t in state.values():
                t.add_(1e-4 * torch.randn(t.shape, generator=g))
            ckpt.save(2, state)
        chain = tpde.Checkpointer(run).chain
        for step, label in ((0, "keyframe"), (1, "sparse 1%"), (2, "dense drift")):
            codecs = sorted({r.codec for r in chain.manifest(step).records})
            on_gpu = chain.materialize(step, on=dev, check=False)
            on_cpu = chain.materialize(step)
            assert all(torch.equal(on_gpu[k].cpu(), on_cpu[k]) for k in on_cpu)
            row(f"step {step} ({label}) rebuilt on GPU", median_s(
                lambda: chain.materialize(step, on=dev, check=False), args.repeats), raw,
                codecs="+".join(codecs))
            row(f"step {step} ({label}) on GPU, hash-checked", median_s(
                lambda: chain.materialize(step, on=dev), args.repeats), raw)
            row(f"step {step} ({label}) on CPU, copied over", median_s(
                lambda: {k: v.to(dev) for k, v in chain.materialize(step).items()},
                args.repeats), raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "mb": args.mb, "machine": {
                "platform": platform.platform(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
                "nvcomp": __import__("nvidia.nvcomp", fromlist=["x"]).__version__}}, f, indent=1)


if __name__ == "__main__":
    main()
