"""Two-process DDP (gloo, CPU) with TPDECheckpointIO: rank 0 writes, every rank loads.

    python tests/lightning_ddp.py FOLDER EPOCHS

The first call trains from scratch; later calls resume from ``last``. Each rank appends a line
to FOLDER/ranks.log saying where it resumed and whether rank 0's first save was a delta.
"""

from __future__ import annotations

import os
import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lightning_train import CharLM, loaders  # noqa: E402

import tpde  # noqa: E402


def main(folder: str, epochs: int) -> None:
    L.seed_everything(0, verbose=False)
    ckpt = os.path.join(folder, "ckpt")
    resume = "last" if os.path.exists(os.path.join(ckpt, "last.ckpt")) else None
    plugin = tpde.TPDECheckpointIO()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp",
                        plugins=[plugin], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=ckpt, save_top_k=2, monitor="step",
                                                   mode="max", save_last=True,
                                                   every_n_train_steps=2)])
    train, _ = loaders(windows=128, batch=16)
    start = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            start["step"] = trainer.global_step

    trainer.callbacks.append(Probe())
    trainer.fit(CharLM(dim=32, layers=1), train, ckpt_path=resume)
    delta = bool(plugin.reports) and not plugin.reports[0].keyframe
    if resume:
        with open(os.path.join(folder, "ranks.log"), "a") as log:
            log.write(f"rank {trainer.global_rank} resumed={start['step']} "
                      f"saved={len(plugin.reports)} delta={delta}\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
