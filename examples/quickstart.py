"""Train a small GPT-style model on real text and checkpoint it with tpde.

Two chains are written into ``runs/quickstart`` (a local folder; pass another path or URL as the
first argument): the full training state (fp32 weights + AdamW moments) every 10 steps, and the
weights alone in bf16 every 2 steps. Each is compared with ``torch.save`` of the same states,
restored bit-exactly, verified, and listed with the CLI.

    python examples/quickstart.py [RUN_ROOT]
"""

from __future__ import annotations

import copy
import inspect
import io
import json
import os
import shutil
import sys

import torch

import tpde
from tpde.cli import main as tpde_cli

STEPS, FULL_EVERY, BF16_EVERY = 60, 10, 2


def corpus() -> torch.Tensor:
    """Real text that ships with every Python: the standard library's own sources."""
    text = "".join(inspect.getsource(m) for m in (json, inspect, io, shutil))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()


class TinyGPT(torch.nn.Module):
    def __init__(self, dim: int = 128, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.zeros(context, dim))
        block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor,
               g: torch.Generator) -> torch.Tensor:
    """One optimizer step on 32 random 64-byte windows of ``data``; returns the loss."""
    at = torch.randint(0, data.numel() - 65, (32,), generator=g)
    batch = torch.stack([data[a : a + 65] for a in at.tolist()])
    loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, 256),
                                             batch[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def torch_save_bytes(state: dict) -> int:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def main(root: str) -> None:
    torch.manual_seed(0)
    shutil.rmtree(root, ignore_errors=True) if "://" not in root else None
    data = corpus()
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    full = tpde.Checkpointer(f"{root}/full")
    weights = tpde.Checkpointer(f"{root}/bf16-weights")
    kept: dict[str, dict[int, dict]] = {"full": {}, "bf16-weights": {}}
    totals = {name: {"torch": 0, "raw": 0, "tpde": 0, "seconds": 0.0} for name in kept}
    params = sum(p.numel() for p in model.parameters())
    print(f"training a {params / 1e6:.2f}M-parameter model on {data.numel() / 1e6:.2f} MB of text")

    g = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        loss = train_step(model, opt, data, g)
        saves = []
        if step % FULL_EVERY == 0:
            saves.append(("full", full, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                         "step": step}))
        if step % BF16_EVERY == 0:
            saves.append(("bf16-weights", weights,
                          {k: v.bfloat16() for k, v in model.state_dict().items()}))
        for name, ckpt, state in saves:
            info = ckpt.save(step, state)
            kept[name][step] = copy.deepcopy(state)
            t = totals[name]
            t["torch"] += torch_save_bytes(state)
            t["raw"] += info.raw_bytes
            t["tpde"] += info.stored_bytes
            t["seconds"] += info.seconds
            if name == "full":
                print(f"step {step:3d}  loss {loss.item():.3f}  full state: {info.raw_bytes / 1e6:.2f} MB"
                      f" -> {info.stored_bytes / 1e6:.2f} MB ({info.ratio:.2f}x) "
                      f"{'keyframe' if info.keyframe else 'delta'} {info.codecs}")

    full.close()  # release the runs' writer leases: other jobs may now write them
    weights.close()
    print()
    for name, t in totals.items():
        chain = tpde.Checkpointer(f"{root}/{name}")
        for step, state in kept[name].items():
            _assert_bit_exact(state, chain.load(step))
        problems = chain.verify()
        print(f"{name:13s} {len(kept[name]):2d} checkpoints in {os.path.abspath(chain.chain.url)}")
        print(f"{'':13s} torch.save {t['torch'] / 1e6:7.2f} MB, "
              f"tpde {t['tpde'] / 1e6:6.2f} MB -> {t['torch'] / t['tpde']:.2f}x smaller; "
              f"encode {t['raw'] / 1e6 / t['seconds']:.0f} MB/s; every step restores bit-exactly; "
              f"verify: {'ok' if not problems else problems}")
    print(f"\n$ tpde ls {root}/full")
    tpde_cli(["ls", f"{root}/full"])


def _assert_bit_exact(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_bit_exact(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            _assert_bit_exact(x, y)
    else:
        assert a == b


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("runs", "quickstart"))
