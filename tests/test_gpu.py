"""GPU path (nvCOMP): frames written on either side read on the other, bit for bit.

Skipped without a CUDA device and the `gpu` extra; CI has neither.
"""

from __future__ import annotations

import pytest
import torch

import tpde
from helpers import assert_same
from tpde import frames

nvcomp = pytest.importorskip("tpde.kernels.nvcomp")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nvcomp.available(), reason="needs a CUDA device and nvidia-nvcomp"),
]


@pytest.mark.parametrize("size", [0, 1000, 4096, 1_000_003])
def test_gpu_frames_decode_on_cpu_and_back(size: int) -> None:
    data = torch.randint(0, 8, (size,), dtype=torch.uint8, device="cuda")
    sec = nvcomp.compress(data, level=3, chunk=65536)
    assert frames.decompress(list(sec.frames), sec.raw, sec.chunk) == data.cpu().numpy().tobytes()
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
