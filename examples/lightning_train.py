"""Train a small GPT with Lightning and checkpoint it with ``TPDECheckpointIO``.

The same seeded run is trained twice with ``ModelCheckpoint(save_top_k=2, save_last=True)``
every few steps: once with Lightning's default ``TorchCheckpointIO``, once with the tpde plugin.
It prints the bytes each wrote and how long the training loop waited per checkpoint, resumes
the tpde run from ``last`` for one more epoch, and turns a checkpoint back into a plain
``.ckpt`` with the ``tpde`` CLI.

    python examples/lightning_train.py [ROOT]      # default: runs/lightning
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import TinyGPT, corpus  # noqa: E402

import tpde  # noqa: E402
from tpde.cli import main as tpde_cli  # noqa: E402

CONTEXT = 64


class CharLM(L.LightningModule):
    """TinyGPT on bytes of text, AdamW, with a validation loss to rank checkpoints by."""

    def __init__(self, dim: int = 128, layers: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(dim, layers, CONTEXT)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], _: int) -> None:
        self.log("val_loss", self._loss(batch[0]))

    def test_step(self, batch: list[torch.Tensor], _: int) -> None:
        self.log("test_loss", self._loss(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def loaders(windows: int = 512, batch: int = 32) -> tuple[Any, Any]:
    """Fixed windows of real text (Python's own sources); shuffling seeded, so runs repeat."""
    data = corpus()
    starts = torch.linspace(0, data.numel() - CONTEXT - 2, windows + 64).long()
    rows = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
    train = torch.utils.data.TensorDataset(rows[:windows])
    val = torch.utils.data.TensorDataset(rows[windows:])
    g = torch.Generator().manual_seed(0)
    return (torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, generator=g),
            torch.utils.data.DataLoader(val, batch_size=batch))


class StallMeter(CheckpointIO):
    """Wraps any CheckpointIO; times how long each save blocks the training loop, and (with
    ``count_bytes``, after each save) sizes what ``torch.save`` would write for it."""

    def __init__(self, inner: CheckpointIO, *, count_bytes: bool = True) -> None:
        self.checkpoint_io = inner
        self.count_bytes = count_bytes
        self.stalls_ms: list[float] = []
        self.torch_bytes = 0  # what torch.save would write for the same checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        started = time.perf_counter()
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.stalls_ms.append((time.perf_counter() - started) * 1e3)
        if self.count_bytes:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            self.torch_bytes += buf.tell()

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(path, map_location=map_location,
                                                  weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.checkpoint_io.remove_checkpoint(path)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()


def train(root: str, io_plugin: CheckpointIO, *, epochs: int, every: int,
          ckpt_path: str | None = None, seed: int = 0, dim: int = 128,
          layers: int = 2) -> tuple[L.Trainer, CharLM]:
    L.seed_everything(seed, verbose=False)
    model = CharLM(dim, layers)
    train_loader, val_loader = loaders()
    callback = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2, save_last=True,
                               every_n_train_steps=every)
    trainer = L.Trainer(max_epochs=epochs, plugins=[io_plugin], callbacks=[callback],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, default_root_dir=root, val_check_interval=every,
                        num_sanity_val_steps=0)
    trainer.fit(model, train_loader, val_loader, ckpt_path=ckpt_path)
    return trainer, model


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
               for f in files if not os.path.islink(os.path.join(d, f)))


def compare(root: str, *, epochs: int = 3, every: int = 4, dim: int = 128,
            layers: int = 2) -> dict[str, dict[str, float]]:
    """Train the same run with each CheckpointIO; bytes written, disk in use and stall."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    contenders = {
        "TorchCheckpointIO": lambda: TorchCheckpointIO(),
        "AsyncCheckpointIO(Torch)": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "TPDECheckpointIO": lambda: tpde.TPDECheckpointIO(),
    }
    out = {}
    for name, make in contenders.items():
        folder = os.path.join(root, name.split("(")[0])
        shutil.rmtree(folder, ignore_errors=True)
        meter = StallMeter(make())
        started = time.perf_counter()
        _, model = train(folder, meter, epochs=epochs, every=every, dim=dim, layers=layers)
        inner = meter.checkpoint_io
        written = (inner.stored_bytes if isinstance(inner, tpde.TPDECheckpointIO)
                   else meter.torch_bytes)
        out[name] = {"checkpoints": len(meter.stalls_ms), "written_bytes": written,
                     "state_bytes": meter.torch_bytes // max(1, len(meter.stalls_ms)),
                     "disk_bytes": disk_bytes(folder),
                     "stall_ms_median": statistics.median(meter.stalls_ms),
                     "stall_ms_max": max(meter.stalls_ms),
                     "fit_seconds": time.perf_counter() - started}
    return out


def main(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    print("training the same seeded run with three CheckpointIO plugins ...")
    figures = compare(root)
    print(f"\n{'plugin':26s} {'ckpts':>5s} {'written':>10s} {'on disk':>10s} "
          f"{'stall median':>13s} {'stall max':>10s}")
    for name, f in figures.items():
        print(f"{name:26s} {f['checkpoints']:5d} {f['written_bytes'] / 1e6:8.2f} MB "
              f"{f['disk_bytes'] / 1e6:8.2f} MB {f['stall_ms_median']:10.1f} ms "
              f"{f['stall_ms_max']:7.1f} ms")
    base, ours = figures["TorchCheckpointIO"], figures["TPDECheckpointIO"]
    print(f"tpde wrote {base['written_bytes'] / ours['written_bytes']:.2f}x fewer bytes; the loop "
          f"waited {base['stall_ms_median'] / ours['stall_ms_median']:.1f}x less per checkpoint")

    folder = os.path.join(root, "TPDECheckpointIO")
    print(f"\nresuming the tpde run from 'last' for one more epoch ({folder})")
    plugin = tpde.TPDECheckpointIO()
    train(folder, plugin, epochs=4, every=4, ckpt_path="last")
    first = plugin.reports[0]
    print(f"first save after resuming: {'keyframe' if first.keyframe else 'delta'}, "
          f"{first.stored_bytes / 1e6:.2f} MB of {first.raw_bytes / 1e6:.2f} MB")
    last = os.path.join(folder, "last.ckpt")
    print(f"\n$ tpde restore {last} --output {root}/plain.ckpt")
    tpde_cli(["restore", last, "--output", os.path.join(root, "plain.ckpt"), "-q"])
    plain = torch.load(os.path.join(root, "plain.ckpt"), weights_only=False)
    print(f"plain .ckpt: epoch {plain['epoch']}, global_step {plain['global_step']}, "
          f"{len(plain['state_dict'])} tensors in its state_dict")
    print(f"\n$ tpde ls {folder}")
    tpde_cli(["ls", folder])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("runs", "lightning"))
