"""GPU path: nvCOMP frames read on either side bit for bit, steps rebuilt on the device by
nvCOMP and the compiled Triton kernels, and mounts on a GPU equal to the dense model.

Skipped without a CUDA device and the `gpu` extra; CI has neither.
"""

from __future__ import annotations

import pytest
import torch

import tpde
from helpers import assert_same, mixed_codec_chain
from tpde.codec import frames, unframe
from tpde.errors import FormatError, TPDEError

nvcomp = pytest.importorskip("tpde.kernels.nvcomp", reason="tpde.kernels.nvcomp does not import here")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvcomp.available(), reason="needs a CUDA device and nvidia-nvcomp"),
]


@pytest.mark.parametrize("size", [0, 1000, 4096, 1_000_003])
def test_gpu_frames_decode_on_cpu_and_back(size: int) -> None:
    data = torch.randint(0, 8, (size,), dtype=torch.uint8, device="cuda")
    sec = nvcomp.compress(data, level=3, chunk=65536)
    assert unframe.decompress(list(sec.frames), sec.raw, sec.chunk).tobytes() == \
        data.cpu().numpy().tobytes()
    cpu = frames.compress(data.cpu().numpy().tobytes(), chunk=65536)
    back = nvcomp.decompress(list(cpu.frames), cpu.raw, cpu.chunk, data.device)
    assert torch.equal(back, data)


def test_cuda_state_saved_on_gpu_restores_on_cpu(tmp_path) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(512, 512, device="cuda", generator=g)
    ck = tpde.Checkpointer(str(tmp_path / "run"))
    ck.save(0, {"w": w, "b": w.bfloat16()})
    w2 = w + 1e-4 * torch.randn(512, 512, device="cuda", generator=g)
    ck.save(1, {"w": w2, "b": w2.bfloat16()})
    for step, ww in ((0, w), (1, w2)):
        out = tpde.Checkpointer(str(tmp_path / "run")).load(step, map_location="cpu")
        assert_same({"w": ww.cpu(), "b": ww.bfloat16().cpu()}, out)
    restored = tpde.Checkpointer(str(tmp_path / "run")).load(1)
    assert restored["w"].is_cuda


def test_batched_decode_puts_every_stream_in_place() -> None:
    g = torch.Generator().manual_seed(1)
    datas = [torch.randint(0, 4, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
             for n in (0, 100, 4096, 70_001, 300_000)]
    secs = [frames.compress(d, chunk=c) for d, c in zip(datas, (4096, 4096, 4096, 8192, 65536))]
    got = nvcomp.decompress_many([(list(s.frames), s.raw, s.chunk) for s in secs],
                                 torch.device("cuda"))
    assert [bytes(t.cpu().numpy()) for t in got] == datas


def test_frames_of_another_size_or_no_frames_are_refused() -> None:
    short = frames.compress(bytes(range(256)) * 4, chunk=4096)  # one 1024-byte frame
    with pytest.raises(FormatError):
        nvcomp.decompress(list(short.frames), 4096, 4096, torch.device("cuda"))
    with pytest.raises(FormatError):
        nvcomp.decompress([b"not a zstd frame at all"], 4096, 4096, torch.device("cuda"))


@pytest.mark.parametrize("inflight", [256 << 20, 1 << 20], ids=["whole", "pieces"])
def test_steps_rebuilt_on_the_gpu_by_nvcomp_equal_the_cpu_rebuild(tmp_path, monkeypatch,
                                                                  inflight: int) -> None:
    run = str(tmp_path / "run")
    states = mixed_codec_chain(run, inflight)
    calls = []
    real = nvcomp.decompress_many
    monkeypatch.setattr(nvcomp, "decompress_many", lambda *a: calls.append(1) or real(*a))
    chain = tpde.Checkpointer(run).chain
    assert {"key", "sparse", "dense", "same"} <= {r.codec for s in states
                                                   for r in chain.manifest(s).records}
    for step, state in states.items():
        words = chain.materialize(step, on=torch.device("cuda"))
        assert all(w.is_cuda for w in words.values())
        cpu = chain.materialize(step)
        assert all(torch.equal(words[k].cpu(), cpu[k]) for k in cpu), step
        assert_same(state, tpde.Checkpointer(run).load(step, map_location="cpu"))
    assert calls, "nvCOMP was not used"


def test_a_damaged_blob_is_an_error_on_the_gpu_never_a_wrong_tensor(tmp_path) -> None:
    run = tmp_path / "run"
    mixed_codec_chain(str(run))
    blob = sorted(p for p in run.rglob("*") if p.is_file() and p.stat().st_size > 100_000)[0]
    good = blob.read_bytes()
    rng = torch.Generator().manual_seed(2)
    for at in torch.randint(0, len(good), (12,), generator=rng).tolist():
        damaged = bytearray(good)
        damaged[at] ^= 0x5A
        blob.write_bytes(bytes(damaged))
        with pytest.raises(TPDEError):
            tpde.Checkpointer(str(run)).chain.materialize(4, on=torch.device("cuda"))
    blob.write_bytes(good)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            for _ in range(4))
        self.head = torch.nn.Linear(64, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("budget", [None, 0, "third"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_mounted_on_the_gpu_equals_dense(tmp_path, budget, prefetch: int) -> None:
    torch.manual_seed(0)
    net = Net().eval()
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ckpt:
        for step in range(3):  # a keyframe, then fine-tuning-shaped deltas
            ckpt.save(step, net.state_dict())
            with torch.no_grad():
                net.embed.weight[torch.randint(0, 1000, (20,))] += 0.01
                for p in net.blocks.parameters():
                    p.add_(1e-4 * torch.randn_like(p))
    total = sum(v.numel() * v.element_size() for v in net.state_dict().values())
    limit = total // 3 if budget == "third" else budget
    x = torch.randint(0, 1000, (2, 16), device="cuda")
    for step in (0, 2):
        dense = Net().cuda().eval()
        dense.load_state_dict(tpde.load_state_dict(run, step, model=dense))
        mounted = tpde.mount(run, step, Net(), device="cuda", budget=limit, prefetch=prefetch)
        with torch.no_grad():
            want = dense(x)
            for _ in range(3):
                assert torch.equal(mounted(x), want), (step, budget, prefetch)
        stats = mounted.tpde_mount.stats
        if limit is not None:
            assert stats.resident_bytes <= limit + stats.largest_module_bytes
        mounted.tpde_mount.close()
