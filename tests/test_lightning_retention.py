"""Bytes at rest under Lightning's retention policies: TPDECheckpointIO against TorchCheckpointIO.

Each configuration trains, then resumes from ``last`` and trains on (weights-only checkpoints,
which Lightning cannot resume from, train as long in one run), once with each plugin. The
folder's bytes are measured at the end and at their peak: for TorchCheckpointIO after every
file it writes, for tpde after every object it writes (the background worker's re-bases
included), by wrapping the store's write calls.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402

import tpde  # noqa: E402
from helpers import assert_same, decode_depths  # noqa: E402
from tpde.store import store  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from lightning_train import CharLM, loaders  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = {
    "top1": dict(monitor="val_loss", save_top_k=1, save_last=True),
    "top2+last": dict(monitor="val_loss", save_top_k=2, save_last=True),
    "every_n_steps+all": dict(every_n_train_steps=2, save_top_k=-1, save_last=True),
    "weights_only": dict(monitor="val_loss", save_top_k=2, save_last=True,
                         save_weights_only=True),
}


def size(folder: str) -> int:
    """The folder's bytes now; a file removed between the listing and its stat counts as gone
    (the training thread removes checkpoints while the background worker writes)."""
    total = 0
    for d, _, fs in os.walk(folder):
        for f in fs:
            if f.endswith(".tmp"):
                continue
            try:
                total += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                pass
    return total


class Peak:
    """The largest size a folder reached, sampled after each write into it."""

    def __init__(self, folder: str) -> None:
        self.folder, self.value, self.lock = folder, 0, threading.Lock()

    def sample(self) -> None:
        with self.lock:
            self.value = max(self.value, size(self.folder))

    def after(self, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.sample()
            return out
        return wrapped


class MeasuredTorchIO(TorchCheckpointIO):
    def __init__(self, peak: Peak) -> None:
        super().__init__()
        self.peak = peak

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        super().save_checkpoint(*args, **kwargs)
        self.peak.sample()


def fit(dirpath: str, io: Any, epochs: int, ckpt_path: str | None, **options: Any
        ) -> tuple[CharLM, ModelCheckpoint]:
    L.seed_everything(0, verbose=False)
    model = CharLM(dim=32, layers=1)
    train, val = loaders(windows=64, batch=16)
    callback = ModelCheckpoint(dirpath=dirpath, **options)
    trainer = L.Trainer(max_epochs=epochs, plugins=[io], callbacks=[callback], logger=False,
                        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, num_sanity_val_steps=0)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return model, callback


def run(folder: str, make_io: Callable[[], Any], options: dict[str, Any]
        ) -> tuple[CharLM, ModelCheckpoint]:
    if options.get("save_weights_only"):  # Lightning cannot resume without the optimizer
        return fit(folder, make_io(), 7, None, **options)
    fit(folder, make_io(), 4, None, **options)
    return fit(folder, make_io(), 7, "last", **options)  # resumed from last.ckpt


@pytest.mark.parametrize("config, deltas_against",
                         [(c, "previous") for c in CONFIGS] + [("top2+last", "keyframe")])
def test_tpde_holds_fewer_bytes_than_torch_checkpointio(config, deltas_against, tmp_path,
                                                        monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tpde.lightning")
    options = CONFIGS[config]
    torch_dir, tpde_dir = str(tmp_path / "torch"), str(tmp_path / "tpde")
    torch_peak, tpde_peak = Peak(torch_dir), Peak(tpde_dir)
    torch_model, torch_cb = run(torch_dir, lambda: MeasuredTorchIO(torch_peak), options)

    for owner, name in ((store.Store, "put_atomic"), (store.BlobWriter, "close")):
        monkeypatch.setattr(owner, name, tpde_peak.after(getattr(owner, name)))

    plugins: list[Any] = []

    def make() -> Any:
        plugins.append(tpde.TPDECheckpointIO(deltas_against=deltas_against))
        return plugins[-1]

    model, cb = run(tpde_dir, make, options)
    for plugin in plugins:
        plugin.teardown()

    # The same checkpoints, with the same contents, and the same trained weights.
    kept = sorted(f for f in os.listdir(torch_dir) if f.endswith(".ckpt"))
    assert sorted(f for f in os.listdir(tpde_dir) if f.endswith(".ckpt")) == kept
    for f in kept:
        want = torch.load(os.path.join(torch_dir, f), weights_only=False)
        got = tpde.load_checkpoint(os.path.join(tpde_dir, f))
        assert_same(want["state_dict"], got["state_dict"], f)
    assert_same(torch_model.state_dict(), model.state_dict())

    torch_end, tpde_end = size(torch_dir), size(tpde_dir)
    print(f"{config}: TorchCheckpointIO {torch_end} B at the end, peak {torch_peak.value}; "
          f"tpde {tpde_end} B ({tpde_end / torch_end:.2f}x), peak {tpde_peak.value} "
          f"({tpde_peak.value / torch_peak.value:.2f}x)")
    assert tpde_end <= 0.85 * torch_end
    assert tpde_peak.value <= torch_peak.value
    chain = tpde.Checkpointer(os.path.join(tpde_dir, ".tpde")).chain
    assert chain.verify() == []
    if deltas_against == "keyframe":  # through Lightning's removals and the resume from last
        assert chain.deltas_against() == "keyframe"
        assert all(max(decode_depths(chain, s).values()) <= 1 for s in chain.steps())
    # Each save's log states the folder's bytes at rest beside TorchCheckpointIO's.
    said = [r.getMessage() for r in caplog.records if "at rest" in r.getMessage()]
    assert said and all("TorchCheckpointIO would hold" in m for m in said)
