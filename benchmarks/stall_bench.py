"""How long a checkpoint blocks a Lightning training loop, for a 1 GB state.

A real ``Trainer`` fits a model whose fp32 weights take a third of the state and AdamW's two
moments the rest; its training step costs a few passes over the weights (every weight gets a
gradient, so every moment changes), so that the loop is mostly checkpointing, the case where a
plugin's stall shows. ``ModelCheckpoint(every_n_train_steps=every, save_top_k=1)`` saves and
replaces the checkpoint; each plugin (``TorchCheckpointIO``, ``AsyncCheckpointIO`` over it,
``TPDECheckpointIO``) trains the same seeded run. "stall" is how long ``save_checkpoint``
blocked ``fit``; "fit" is the wall time of ``fit``, background writing included (Lightning
waits for a plugin's pending saves at the end).

    python benchmarks/stall_bench.py [--gb 1.0] [--steps 12] [--every 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import tpde

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lightning_train import StallMeter  # noqa: E402

TENSOR = 4 << 20  # fp32 elements per weight tensor (16 MiB)


class Wide(L.LightningModule):
    """Weights summing to ``numel`` fp32 elements, each of which gets a gradient every step."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(TENSOR, generator=g) * 0.02)
            for _ in range(max(1, numel // TENSOR)))
        self.g = torch.Generator().manual_seed(1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        # A loss linear in every weight: gradients as dense as a real model's, at the cost of
        # one pass over the weights.
        x = torch.randn(len(self.weights), generator=self.g)
        return sum(w.mean() * x[i] for i, w in enumerate(self.weights))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.zeros(10_000, 1), batch_size=1)


def run(make: Any, numel: int, steps: int, every: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tpde-stall-") as root:
        meter = StallMeter(make(), count_bytes=False)  # sizing 1 GB in memory would add to fit
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            plugins=[meter], callbacks=[ModelCheckpoint(
                                dirpath=root, every_n_train_steps=every, save_top_k=1)])
        model = Wide(numel)
        started = time.perf_counter()
        trainer.fit(model)
        fit = time.perf_counter() - started
        state = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"state_mb": state / 1e6, "checkpoints": len(meter.stalls_ms),
            "stall_ms_median": statistics.median(meter.stalls_ms),
            "stall_ms_max": max(meter.stalls_ms), "fit_s": fit,
            "stalls_ms": [round(x, 1) for x in meter.stalls_ms]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="weights + AdamW moments, in GB")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    numel = int(args.gb * 1e9 / 12)
    plugins = {"TorchCheckpointIO": TorchCheckpointIO,
               "AsyncCheckpointIO(Torch)": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
               "TPDECheckpointIO": tpde.TPDECheckpointIO}
    results = {name: run(make, numel, args.steps, args.every) for name, make in plugins.items()}
    state = next(iter(results.values()))["state_mb"]
    print(f"{state:.0f} MB state (fp32 weights + AdamW moments), {args.steps} steps, a checkpoint "
          f"every {args.every}\n")
    print("| plugin | checkpoints | stall median | stall max | fit |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['checkpoints']} | {r['stall_ms_median']:.0f} ms | "
              f"{r['stall_ms_max']:.0f} ms | {r['fit_s']:.1f} s |")
    print("\nstalls, in order (ms):")
    for name, r in results.items():
        print(f"  {name}: {', '.join(f'{x:.0f}' for x in r['stalls_ms'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__},
                       "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
