"""TPDECheckpointIO with a real Lightning Trainer and ModelCheckpoint, on disk and on S3 (moto)."""

from __future__ import annotations

import logging
import os
import pickle
import re
import subprocess
import sys
from typing import Any

import fsspec
import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import tpde  # noqa: E402
from helpers import assert_same  # noqa: E402
from tpde.chain import Chain  # noqa: E402
from tpde.cli import main as cli  # noqa: E402
from tpde.entries import entry as entries  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from lightning_train import CharLM, loaders  # noqa: E402

pytestmark = pytest.mark.slow


def fit(dirpath: str, io: Any, *, epochs: int = 2, ckpt_path: str | None = None,
        seed: int = 0, **checkpoint: Any) -> tuple[L.Trainer, CharLM, ModelCheckpoint]:
    """A seeded, deterministic run: 4 optimizer steps per epoch, a checkpoint every 2."""
    L.seed_everything(seed, verbose=False)
    model = CharLM(dim=32, layers=1)
    train, val = loaders(windows=64, batch=16)
    options = dict(monitor="val_loss", save_top_k=2, save_last=True, every_n_train_steps=2)
    callback = ModelCheckpoint(dirpath=dirpath, **{**options, **checkpoint})
    trainer = L.Trainer(max_epochs=epochs, plugins=[io], callbacks=[callback], logger=False,
                        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return trainer, model, callback


def files(fs: Any, folder: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False, refresh=True)
                  if p.endswith(".ckpt"))


def comparable(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What two runs in different folders must agree on (callback state names the folder)."""
    return {k: v for k, v in ckpt.items() if k != "callbacks"}


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path) -> tuple[str, Any]:
    """A checkpoint folder on disk or in a bucket of the moto server, and its filesystem."""
    if request.param == "local":
        return str(tmp_path), fsspec.filesystem("file")
    options = request.getfixturevalue("s3_server")["options"]
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = options  # Lightning opens s3:// paths with fsspec defaults
    request.addfinalizer(lambda: fsspec.config.conf.pop("s3") if saved is None
                         else fsspec.config.conf.update(s3=saved))
    return f"s3://tpde/{os.path.basename(tmp_path)}", fsspec.filesystem("s3", **options)


def test_modelcheckpoint_topk_last_and_resume_match_torch(where, tmp_path) -> None:
    root, fs = where
    _, torch_model, torch_cb = fit(str(tmp_path / "torch"), TorchCheckpointIO())
    plugin = tpde.TPDECheckpointIO()
    _, model, cb = fit(f"{root}/tpde", plugin)

    # The same files ModelCheckpoint keeps with the default plugin: top 2 and last.
    assert files(fs, f"{root}/tpde") == files(fsspec.filesystem("file"), str(tmp_path / "torch"))
    assert len(files(fs, f"{root}/tpde")) == 3
    assert os.path.basename(cb.best_model_path) == os.path.basename(torch_cb.best_model_path)
    for name in files(fs, f"{root}/tpde"):
        ours = plugin.load_checkpoint(f"{root}/tpde/{name}")
        theirs = torch.load(tmp_path / "torch" / name, weights_only=False)
        assert_same(comparable(ours), comparable(theirs))
    # A save of the same state again (last.ckpt) stores no tensor bytes: its manifest only.
    same = [r for r in plugin.reports if r.path.endswith("last.ckpt")]
    assert same and all(set(r.codecs) == {"same"} and r.stored_bytes < r.raw_bytes / 10
                        for r in same)
    # Every visible step has an entry; everything else was hidden.
    steps = {entries.read(f"{root}/tpde/{n}").step for n in files(fs, f"{root}/tpde")}
    assert set(tpde.Checkpointer(f"{root}/tpde/.tpde").steps()) == steps

    # Resume from "last" with each plugin: the same weights, bit for bit.
    _, torch_resumed, _ = fit(str(tmp_path / "torch"), TorchCheckpointIO(), epochs=3,
                              ckpt_path="last")
    resumed_plugin = tpde.TPDECheckpointIO()
    # Lightning resolves "last" on local disk only (it drops the s3:// of what it lists, with
    # any CheckpointIO); on a bucket the path is given.
    last = "last" if "://" not in root else f"{root}/tpde/last.ckpt"
    _, resumed, _ = fit(f"{root}/tpde", resumed_plugin, epochs=3, ckpt_path=last)
    assert_same(resumed.state_dict(), torch_resumed.state_dict())
    assert not resumed_plugin.reports[0].keyframe  # the chain goes on with a delta
    assert cli(["verify", f"{root}/tpde", "-q"]) == 0


def test_best_test_and_manual_save(where) -> None:
    root, _ = where
    plugin = tpde.TPDECheckpointIO()
    trainer, model, cb = fit(root, plugin)
    trainer.test(model, loaders(windows=64, batch=16)[1], ckpt_path="best", verbose=False)
    manual = f"{root}/manual/by-hand.ckpt"
    trainer.save_checkpoint(manual)
    plugin.wait()
    assert_same(plugin.load_checkpoint(manual)["state_dict"], model.state_dict())
    # A folder of its own gets a chain of its own.
    assert tpde.Checkpointer(f"{root}/manual/.tpde").steps()


def torch_load(path: str, **kwargs: Any) -> Any:
    with fsspec.open(path, "rb") as f:
        return torch.load(f, **kwargs)


def test_synchronous_saves_copy_nothing_and_store_reference_matches_torch(tmp_path,
                                                                          monkeypatch) -> None:
    from tpde.plugins import lightning as plugin_module

    taken = []
    real = plugin_module.snapshot
    monkeypatch.setattr(plugin_module, "snapshot", lambda *a, **k: taken.append(1)
                        or real(*a, **k))
    _, _, torch_cb = fit(str(tmp_path / "torch"), TorchCheckpointIO())
    # 16 kB in flight: the embedding, head, attention and MLP weights (and the Adam moments
    # beside them) are stored in 8 kB pieces.
    options = dict(async_save=False, reference="store", max_inflight_bytes=16384)
    plugin = tpde.TPDECheckpointIO(**options)
    _, _, cb = fit(str(tmp_path / "tpde"), plugin)
    assert not taken, "a synchronous save copied the state"
    names = files(fsspec.filesystem("file"), str(tmp_path / "tpde"))
    assert names == files(fsspec.filesystem("file"), str(tmp_path / "torch"))
    for name in names:
        assert_same(comparable(plugin.load_checkpoint(str(tmp_path / "tpde" / name))),
                    comparable(torch.load(tmp_path / "torch" / name, weights_only=False)))
    chain = tpde.Checkpointer(str(tmp_path / "tpde" / ".tpde")).chain
    records = [r for s in chain.steps() for r in chain.manifest(s).records]
    assert any(r.start is not None for r in records)
    assert {r.codec for r in records} > {"key"}  # deltas, coded against the chain's own bytes

    _, torch_resumed, _ = fit(str(tmp_path / "torch"), TorchCheckpointIO(), epochs=3,
                              ckpt_path="last")
    _, resumed, _ = fit(str(tmp_path / "tpde"), tpde.TPDECheckpointIO(**options), epochs=3,
                        ckpt_path="last")
    assert_same(resumed.state_dict(), torch_resumed.state_dict())
    assert cli(["verify", str(tmp_path / "tpde"), "-q"]) == 0


def test_load_from_checkpoint_and_torch_load(where, tmp_path) -> None:
    root, _ = where
    plugin = tpde.TPDECheckpointIO()
    _, model, cb = fit(root, plugin)
    plugin.teardown()
    path = cb.last_model_path
    with pytest.raises(pickle.UnpicklingError, match=r"tpde\.load_checkpoint"):
        torch_load(path)
    with pytest.raises(pickle.UnpicklingError, match=r"tpde\.load_checkpoint"):
        CharLM.load_from_checkpoint(path)
    loaded = CharLM.load_from_checkpoint(path, weights_only=False)
    assert_same(loaded.state_dict(), model.state_dict())
    assert_same(torch_load(path, weights_only=False)["state_dict"], model.state_dict())
    assert_same(tpde.load_checkpoint(path)["state_dict"], model.state_dict())
    with torch.serialization.safe_globals([tpde.load_checkpoint]):
        assert_same(torch_load(path)["state_dict"], model.state_dict())
    # The CLI turns an entry back into a plain .ckpt.
    assert cli(["restore", path, "--output", str(tmp_path / "plain.ckpt"), "-q"]) == 0
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    assert_same(plain["state_dict"], model.state_dict())


def test_save_last_link_weights_only_every_epoch(tmp_path) -> None:
    plugin = tpde.TPDECheckpointIO()
    _, model, cb = fit(str(tmp_path), plugin, save_last="link", save_weights_only=True,
                       every_n_train_steps=None, every_n_epochs=1)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink()
    loaded = plugin.load_checkpoint(str(last))
    assert "optimizer_states" not in loaded
    assert_same(loaded["state_dict"], model.state_dict())
    target = os.path.realpath(last)
    plugin.remove_checkpoint(str(last))
    plugin.wait()
    assert not last.exists() and os.path.exists(target)  # the link goes, its target stays


def test_each_saves_log_states_what_the_run_holds(tmp_path, caplog) -> None:
    """Kept up save by save, not counted again: the log line of every save names the
    checkpoints held so far, their bytes at rest and their raw bytes."""
    caplog.set_level(logging.INFO, logger="tpde.lightning")
    plugin = tpde.TPDECheckpointIO(async_save=False)
    fit(str(tmp_path), plugin, save_top_k=-1, save_last=False)
    said = [r.getMessage() for r in caplog.records if "at rest for" in r.getMessage()]
    found = [re.search(r"holds ([0-9.]+) MB at rest for (\d+) checkpoints; TorchCheckpointIO "
                       r"would hold at least ([0-9.]+) MB", m).groups() for m in said]
    assert [int(n) for _, n, _ in found] == list(range(1, len(plugin.reports) + 1))
    chain = Chain(str(tmp_path / ".tpde"))
    raw = sum(chain.manifest(s).raw_bytes for s in chain.steps())
    assert found[-1] == (f"{chain.at_rest().total / 1e6:.1f}", str(len(chain.steps())),
                         f"{raw / 1e6:.1f}")


def test_switch_from_torch_midway_and_bounded_disk(tmp_path) -> None:
    folder = str(tmp_path)
    fit(folder, TorchCheckpointIO(), save_top_k=1)
    plugin = tpde.TPDECheckpointIO(keyframe_every=4)
    _, model, _ = fit(folder, plugin, epochs=12, ckpt_path="last", save_top_k=1)
    # The plain files of the first part were removed like any other; entries remain.
    names = files(fsspec.filesystem("file"), folder)
    assert len(names) == 2 and all(entries.read(f"{folder}/{n}") for n in names)
    chain = tpde.Checkpointer(f"{folder}/.tpde")
    saves = len(plugin.reports)
    assert saves >= 20
    # Only what the kept steps need stays: at most one keyframe group, however long the run.
    assert len(os.listdir(f"{folder}/.tpde/data")) <= 4 + 2
    assert plugin.freed_bytes > 0 and len(chain.steps()) == 2


def test_background_failure_is_deferred_and_plugin_stays_usable(tmp_path) -> None:
    plugin = tpde.TPDECheckpointIO()
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a folder")
    (tmp_path / "chainless").mkdir()
    (tmp_path / "chainless" / ".tpde").write_bytes(b"a file where the chain would go")
    raised: list[BaseException] = []

    class SaveBadly(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            try:  # the entry is written at once: its failure is raised at once too
                trainer.save_checkpoint(str(blocker / "x.ckpt"))
            except tpde.StoreError as exc:
                raised.append(exc)
            trainer.save_checkpoint(str(tmp_path / "chainless" / "x.ckpt"))  # fails later

    L.seed_everything(0, verbose=False)
    model = CharLM(dim=32, layers=1)
    train, val = loaders(windows=64, batch=16)
    trainer = L.Trainer(max_epochs=1, plugins=[plugin], callbacks=[SaveBadly()], logger=False,
                        accelerator="cpu", enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(tpde.StoreError) as info:  # by teardown, at the end of fit
        trainer.fit(model, train, val)
    assert raised
    assert any("background save" in note for note in info.value.__notes__)
    assert not (tmp_path / "chainless" / "x.ckpt").exists()  # its pending entry withdrawn
    trainer.save_checkpoint(str(tmp_path / "after.ckpt"))
    plugin.teardown()
    assert_same(plugin.load_checkpoint(str(tmp_path / "after.ckpt"))["state_dict"],
                model.state_dict())


def test_wrapped_by_async_checkpoint_io(tmp_path) -> None:
    inner = tpde.TPDECheckpointIO()
    _, model, cb = fit(str(tmp_path), AsyncCheckpointIO(inner))
    inner.teardown()
    # AsyncCheckpointIO's own copy of the state drops the state dict's _metadata; tensors match.
    loaded = inner.load_checkpoint(cb.last_model_path)["state_dict"]
    assert_same(dict(loaded), dict(model.state_dict()))
    # Its removals run at once while its saves queue, so a removal can overtake a save (with
    # any CheckpointIO): every file that is left is a loadable entry, and top 2 + last remain.
    names = files(fsspec.filesystem("file"), str(tmp_path))
    assert len(names) >= 3
    for name in names:
        assert inner.load_checkpoint(str(tmp_path / name))["state_dict"].keys() == loaded.keys()


def test_pytorch_lightning_imports(tmp_path) -> None:
    pl = pytest.importorskip("pytorch_lightning", reason="the pytorch_lightning package is not installed")
    from pytorch_lightning.callbacks import ModelCheckpoint as PLCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), 4)
    plugin = tpde.TPDECheckpointIO()
    trainer = pl.Trainer(max_epochs=2, plugins=[plugin], logger=False, enable_progress_bar=False,
                         callbacks=[PLCheckpoint(dirpath=str(tmp_path), save_last=True)])
    module = Module()
    trainer.fit(module, data)
    assert_same(plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"],
                module.state_dict())


@pytest.mark.parametrize("kind", ["model-parallel", pytest.param("fsdp", marks=pytest.mark.gpu)])
def test_sharded_strategies_through_tpde_match_dcp(tmp_path, kind: str) -> None:
    """ModelParallelStrategy (FSDP2, 2 CPU devices) and FSDPStrategy(state_dict_type="sharded")
    (every CUDA device): the same run through tpde's strategy and the stock one (DCP's
    FileSystemWriter), each trained, then resumed from ``last``, keeps the same checkpoints
    (top 2 and last) and ends with bit-identical weights."""
    if kind == "fsdp" and not torch.cuda.is_available():
        pytest.skip("FSDPStrategy needs a CUDA device")
    script = os.path.join(os.path.dirname(__file__), "lightning_sharded.py")
    from campaigns.s3 import free_port

    ours, theirs = ("tpde", "dcp") if kind == "model-parallel" else ("fsdp-tpde", "fsdp")
    per_epoch = 64 // 8 // (2 if kind == "model-parallel" else torch.cuda.device_count())
    for how in (ours, theirs):
        for epochs in (2, 3):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            done = subprocess.run([sys.executable, script, str(tmp_path / how), str(epochs), how],
                                  capture_output=True, text=True, timeout=600, env=env)
            assert done.returncode == 0, done.stderr[-4000:]
        assert (tmp_path / how / "resumed.txt").read_text() == str(2 * per_epoch)
    mine, stock = tmp_path / ours / "ckpt", tmp_path / theirs / "ckpt"
    assert sorted(os.listdir(stock)) == sorted(p for p in os.listdir(mine) if p != ".tpde")
    a, b = (torch.load(tmp_path / how / "final.pt") for how in (ours, theirs))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chain = Chain(str(mine / ".tpde"))
    assert all(chain.manifest(s).dcp is not None for s in chain.steps())
    assert len(chain.steps()) == 3  # what the three entries name: removed steps were freed
    # The last checkpoint, consolidated by the CLI: a plain Lightning checkpoint.
    plain = tmp_path / "plain.ckpt"
    subprocess.run([sys.executable, "-m", "tpde.cli", "restore", str(mine / "last.ckpt"),
                    "--output", str(plain)], check=True, capture_output=True)
    ckpt = torch.load(plain, weights_only=False)
    assert ckpt["global_step"] == 3 * per_epoch and len(ckpt["optimizer_states"]) == 1
    assert "loops" in ckpt and all(torch.equal(ckpt["state_dict"][k], a[k]) for k in a)


def test_the_plugin_refuses_unknown_options_on_the_training_thread() -> None:
    """Checked in the constructor, not first by the background worker at the first save."""
    with pytest.raises(ValueError, match="deltas_against"):
        tpde.TPDECheckpointIO(deltas_against="parent")
    with pytest.raises(ValueError, match="reference"):
        tpde.TPDECheckpointIO(reference="disk")


def test_tpde_sharded_strategies_refuse_full_checkpoints() -> None:
    """They store sharded checkpoints only; full ones go through the plain strategies with
    TPDECheckpointIO, which the messages name."""
    with pytest.raises(ValueError, match="state_dict_type='full'"):
        tpde.TPDEFSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        tpde.TPDEModelParallelStrategy(save_distributed_checkpoint=False)
    strategy = tpde.TPDEFSDPStrategy(checkpoint_io=tpde.TPDECheckpointIO(level=5))
    assert strategy._state_dict_type == "sharded" and strategy._tpde().options.level == 5
    against = tpde.TPDECheckpointIO(deltas_against="keyframe")
    strategy = tpde.TPDEFSDPStrategy(checkpoint_io=against)
    with pytest.raises(ValueError, match="deltas_against and error_bound"):
        strategy._tpde()  # what a save and a load ask for first
    bounded = tpde.TPDECheckpointIO(error_bound={"state_dict/*": tpde.Rel(1e-3)})
    with pytest.raises(ValueError, match="deltas_against and error_bound"):
        tpde.TPDEFSDPStrategy(checkpoint_io=bounded)._tpde()


def test_cli_gc_frees_steps_whose_entries_were_deleted(tmp_path) -> None:
    plugin = tpde.TPDECheckpointIO()
    fit(str(tmp_path), plugin, save_top_k=-1)
    plugin.teardown()
    names = files(fsspec.filesystem("file"), str(tmp_path))
    for name in names[:-2]:
        os.remove(tmp_path / name)  # by hand, behind the plugin's back
    assert cli(["gc", str(tmp_path), "-q"]) == 0
    live = {entries.read(str(tmp_path / n)).step for n in names[-2:]}
    assert set(tpde.Checkpointer(str(tmp_path / ".tpde")).steps()) == live
    for name in names[-2:]:
        assert cli(["verify", str(tmp_path / name), "-q"]) == 0


def test_ddp_two_processes(tmp_path) -> None:
    script = os.path.join(os.path.dirname(__file__), "lightning_ddp.py")
    for epochs in (2, 3):
        run = subprocess.run([sys.executable, script, str(tmp_path), str(epochs)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    done = {int(line.split()[1]): line for line in (tmp_path / "ranks.log").read_text().split("\n")
            if line}
    assert set(done) == {0, 1}  # both ranks loaded the checkpoint and trained on
    assert cli(["verify", str(tmp_path / "ckpt"), "-q"]) == 0
    writer_steps = tpde.Checkpointer(str(tmp_path / "ckpt" / ".tpde")).steps()
    # Both ranks resumed at the 8th step (4 per epoch on each rank), only rank 0 wrote.
    assert writer_steps and all(e in done[0] for e in ("resumed=8", "delta=True"))
    assert all(e in done[1] for e in ("resumed=8", "saved=0"))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_training_snapshots_on_host_or_gpu(tmp_path, device: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L.seed_everything(0, verbose=False)
    model = CharLM(dim=32, layers=1)
    plugin = tpde.TPDECheckpointIO(device=device)
    trainer = L.Trainer(max_epochs=2, accelerator="cuda", devices=1, plugins=[plugin],
                        logger=False, enable_progress_bar=False,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True,
                                                   every_n_train_steps=2)])
    trainer.fit(model, loaders(windows=64, batch=16)[0])
    loaded = plugin.load_checkpoint(str(tmp_path / "last.ckpt"))
    expected = model.state_dict()  # an OrderedDict with its _metadata, as Lightning saves it
    for k, v in expected.items():
        expected[k] = v.cpu()
    assert_same(loaded["state_dict"], expected)
    assert any(not r.keyframe for r in plugin.reports)


@pytest.mark.gpu
def test_fsdp_full_state_dict(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("FSDP in Lightning needs a GPU")
    from lightning.pytorch.strategies import FSDPStrategy

    plugin = tpde.TPDECheckpointIO()
    trainer = L.Trainer(max_epochs=1, accelerator="cuda", devices=1, logger=False,
                        strategy=FSDPStrategy(state_dict_type="full"), plugins=[plugin],
                        enable_progress_bar=False,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True)])
    trainer.fit(CharLM(dim=32, layers=1), loaders(windows=64, batch=16)[0])
    plugin.wait()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "last.ckpt" in names, names
    assert "state_dict" in tpde.load_checkpoint(str(tmp_path / "last.ckpt"))


def test_mount_a_lightning_trained_model(tmp_path) -> None:
    from quickstart import TinyGPT

    plugin = tpde.TPDECheckpointIO()
    _, model, cb = fit(str(tmp_path / "tpde"), plugin, save_top_k=-1)
    plugin.teardown()
    fit(str(tmp_path / "torch"), TorchCheckpointIO(), save_top_k=-1)  # the same run, plain files
    x = torch.randint(0, 256, (4, 32))
    first = min((r for r in plugin.reports), key=lambda r: r.step)
    latest = max((r for r in plugin.reports), key=lambda r: r.step)
    assert first.keyframe and not latest.keyframe
    for report in (first, latest):  # the dense model on its fused fast path, as by default
        dense = CharLM(dim=32, layers=1)
        plain = tmp_path / "torch" / os.path.basename(report.path)
        dense.load_state_dict(torch.load(plain, weights_only=False)["state_dict"])
        dense.eval()
        with torch.no_grad():
            expected = dense.model(x)
        # The whole LightningModule, and its inner network (keys under the "model." prefix).
        whole = tpde.mount(report.path, model=CharLM(dim=32, layers=1), device="cpu", budget=0)
        inner = tpde.mount(report.path, model=TinyGPT(32, 1, 64), device="cpu", budget=0)
        with torch.no_grad():
            assert torch.equal(whole.model(x), expected)
            assert torch.equal(inner(x), expected)


def test_damaged_entries_are_errors_never_wrong_checkpoints(tmp_path) -> None:
    import random

    from campaigns.corrupt import damage

    plugin = tpde.TPDECheckpointIO()
    fit(str(tmp_path), plugin, save_top_k=-1)
    plugin.teardown()
    names = files(fsspec.filesystem("file"), str(tmp_path))
    truth = {n: tpde.load_checkpoint(str(tmp_path / n)) for n in names}
    rng, seen = random.Random(0), {"detected": 0, "harmless": 0, "deleted": 0}
    for trial in range(60):
        name = rng.choice(names)
        copy = tmp_path / f"damaged-{trial}.ckpt"
        copy.write_bytes((tmp_path / name).read_bytes())
        if damage(str(copy), rng) == "delete":
            seen["deleted"] += 1
            continue
        try:
            got = tpde.load_checkpoint(str(copy))
        except tpde.TPDEError:  # the README's promise: nothing else escapes
            seen["detected"] += 1
            continue
        finally:
            copy.unlink(missing_ok=True)
        assert_same(comparable(got), comparable(truth[name]))
        seen["harmless"] += 1
    print(f"damaged entries: {seen}")
    assert seen["detected"] > 10


def test_error_bound_through_the_plugin_against_torch_files(tmp_path) -> None:
    """The same seeded run saved by TorchCheckpointIO and by the plugin with a bound on the
    weights: every kept file's weights are within the bound of the torch file's, everything
    else is identical, and a pattern that matches nothing fails at the first save."""
    from test_lossy import holds

    fit(str(tmp_path / "torch"), TorchCheckpointIO())
    bound = tpde.Rel(1e-3)
    plugin = tpde.TPDECheckpointIO(error_bound={"state_dict/*weight": bound})
    fit(str(tmp_path / "tpde"), plugin)
    names = files(fsspec.filesystem("file"), str(tmp_path / "tpde"))
    lossy = 0
    for name in names:
        ours = plugin.load_checkpoint(str(tmp_path / "tpde" / name))
        theirs = torch.load(tmp_path / "torch" / name, weights_only=False)
        for k, v in theirs["state_dict"].items():
            if k.endswith("weight") and v.is_floating_point():
                assert holds(v, ours["state_dict"][k], bound).all(), (name, k)
                lossy += not torch.equal(v, ours["state_dict"][k])
                ours["state_dict"][k] = v
        assert_same(comparable(ours), comparable(theirs))
    assert lossy > 0
    assert "LOSSY" in subprocess.run([sys.executable, "-m", "tpde.cli", "ls",
                                      str(tmp_path / "tpde")], capture_output=True,
                                     text=True).stdout
    with pytest.raises(tpde.BoundError, match="state_dict/"):
        fit(str(tmp_path / "bad"), tpde.TPDECheckpointIO(error_bound={"model/*": bound}))


def test_installing_tpde_leaves_other_trainers_alone(tmp_path) -> None:
    """tpde registers nothing with Lightning: a Trainer built without the plugin does not even
    import tpde, and one built with it gets no callback from tpde (a fresh process each)."""
    script = (
        "import lightning as L, sys\n"
        "if sys.argv[1] == 'with':\n"
        "    import tpde; io = tpde.TPDECheckpointIO(); extra = {'plugins': [io]}\n"
        "else:\n"
        "    extra = {}\n"
        "t = L.Trainer(accelerator='cpu', logger=False, **extra)\n"
        "print('CALLBACKS', [type(c).__module__ for c in t.callbacks])\n"
        "print('IMPORTED', 'tpde' in sys.modules)\n")
    runs = {how: subprocess.run([sys.executable, "-c", script, how], capture_output=True,
                                text=True, timeout=300, cwd=tmp_path) for how in ("without", "with")}
    without, with_plugin = runs["without"], runs["with"]
    assert without.returncode == 0 and with_plugin.returncode == 0, without.stderr + with_plugin.stderr
    assert "IMPORTED False" in without.stdout
    assert "entry point 'tpde'" not in without.stdout + without.stderr
    assert "tpde" not in with_plugin.stdout.split("CALLBACKS")[1].split("\n")[0]

def test_top_k_removals_wait_within_the_plain_files_and_go_by_teardown(tmp_path, caplog) -> None:
    """Lightning's removals hide a checkpoint's step at once; its bytes go once the run would
    hold more than TorchCheckpointIO's files of the kept checkpoints, and all of them by the
    end of fit."""
    caplog.set_level(logging.INFO, logger="tpde.lightning")
    plugin = tpde.TPDECheckpointIO(async_save=False)
    fit(str(tmp_path), plugin, epochs=6)  # save_top_k=2, save_last=True
    said = [r.getMessage() for r in caplog.records]
    removed = [m for m in said if "replaced or removed" in m]
    waited = [m for m in removed if "freed when needed" in m]
    assert len(removed) >= 8 and waited and len(waited) < len(removed)
    for before, line in zip(said, said[1:]):  # while removed steps wait, the run is within
        held = re.search(r"holds ([0-9.]+) MB at rest for \d+ checkpoints; TorchCheckpointIO "
                         r"would hold at least ([0-9.]+) MB", line)
        if "freed when needed" in before:
            assert held and float(held[1]) <= float(held[2]), line
    chain = Chain(str(tmp_path / ".tpde"))
    assert not chain.at_rest().hidden and plugin.freed_bytes > 0
    names = files(fsspec.filesystem("file"), str(tmp_path))
    assert [entries.read(f"{tmp_path}/{n}").step for n in names] == chain.steps()
