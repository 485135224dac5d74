"""A Lightning run under a sharded strategy, its sharded checkpoints stored by tpde or by DCP's
own ``FileSystemWriter`` (the stock strategy), so that the two can be compared:
``ModelParallelStrategy`` (FSDP2, 2 CPU devices, gloo; ``tpde`` or ``dcp``) or
``FSDPStrategy(state_dict_type="sharded")`` (every CUDA device; ``fsdp-tpde`` or ``fsdp``).

    python tests/lightning_sharded.py FOLDER EPOCHS tpde|dcp|fsdp-tpde|fsdp

The first call trains from scratch; later calls resume from ``last``. At the end rank 0 writes
the full model state to FOLDER/final.pt and the step it resumed at to FOLDER/resumed.txt.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

import tpde


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class WrappedNet(Net):
    """The same network, wrapped whole by ``FSDPStrategy``."""

    def configure_model(self) -> None:
        pass


def main(folder: str, epochs: int, how: str) -> None:
    L.seed_everything(0, verbose=False)
    ckpt = os.path.join(folder, "ckpt")
    resume = "last" if os.path.exists(os.path.join(ckpt, "last.ckpt")) else None
    strategy = {
        "tpde": lambda: tpde.TPDEModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
        "dcp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "fsdp-tpde": lambda: tpde.TPDEFSDPStrategy(),
        "fsdp": lambda: FSDPStrategy(state_dict_type="sharded"),
    }[how]()
    fsdp = how.startswith("fsdp")
    trainer = L.Trainer(max_epochs=epochs, accelerator="cuda" if fsdp else "cpu",
                        devices=torch.cuda.device_count() if fsdp else 2, strategy=strategy,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=ckpt, save_top_k=2, monitor="step",
                                                   mode="max", save_last=True,
                                                   every_n_train_steps=2)])
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g),
                                          torch.randn(64, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    start = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            start["step"] = trainer.global_step

    trainer.callbacks.append(Probe())
    module = WrappedNet() if fsdp else Net()
    trainer.fit(module, loader, ckpt_path=resume)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.strategy.model,  # FSDP's wrapper, or the module
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save(full, os.path.join(folder, "final.pt"))
        with open(os.path.join(folder, "resumed.txt"), "w") as f:
            f.write(str(start["step"]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written: skip interpreter teardown, where gloo's worker threads sometimes
    # abort the process ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
