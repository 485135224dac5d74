"""Many ``fit`` calls in one process: threads and memory must not grow with them.

Each round makes a new ``Trainer`` with a new ``TPDECheckpointIO`` (or the stock plugin),
fits a model of about ``--mb`` MiB of fp32 weights for one epoch with ``ModelCheckpoint``
(``save_last=True``), saves once more after ``fit`` and drops everything. After each round it
prints the process's resident memory and its thread count; a plugin that kept a copy of the
state or a worker thread grows them by a round's worth each time.

    python tests/campaigns/lightning_fits.py [--rounds 10] [--mb 64] [--plugin tpde|torch]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO

import tpde


class Wide(L.LightningModule):
    def __init__(self, mb: int) -> None:
        super().__init__()
        side = int((mb * (1 << 20) / 4) ** 0.5)
        self.layer = torch.nn.Linear(side, side, bias=False)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--plugin", choices=("tpde", "torch"), default="tpde")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for n in range(args.rounds):
            model = Wide(args.mb)
            side = model.layer.in_features
            data = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(4, side)), batch_size=2)
            io = tpde.TPDECheckpointIO() if args.plugin == "tpde" else TorchCheckpointIO()
            trainer = L.Trainer(default_root_dir=root, max_epochs=1, plugins=[io],
                                callbacks=[ModelCheckpoint(dirpath=root, save_last=True)],
                                logger=False, accelerator="cpu", enable_progress_bar=False,
                                enable_model_summary=False)
            trainer.fit(model, data)
            trainer.save_checkpoint(os.path.join(root, f"after-{n}.ckpt"))
            del trainer, model, data, io
            gc.collect()
            rows.append({"round": n + 1, "rss_mb": round(rss_mb(), 1),
                         "threads": threading.active_count(),
                         "others": sorted(t.name for t in threading.enumerate()
                                          if t is not threading.main_thread())})
            print(json.dumps(rows[-1]), flush=True)
    growth = rows[-1]["rss_mb"] - rows[1]["rss_mb"] if len(rows) > 1 else 0.0
    print(json.dumps({"plugin": args.plugin, "mb": args.mb, "rounds": args.rounds,
                      "rss_growth_after_round_2_mb": round(growth, 1),
                      "threads_first_last": [rows[0]["threads"], rows[-1]["threads"]]}))


if __name__ == "__main__":
    main()
