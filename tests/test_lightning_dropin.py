"""TPDECheckpointIO behaves as Lightning's default CheckpointIO does, where a user can tell.

Each test is one behaviour that Lightning's own checkpoint tests rely on, with a real
``Trainer``: a saved path is there when ``save_checkpoint`` returns, nothing queued is lost at
exit, a finished ``Trainer`` leaves no thread or state behind, the plugin pickles whole for
spawned workers, and reads work over stores that answer ranges badly.
"""

from __future__ import annotations

import gc
import http.server
import os
import pickle
import subprocess
import sys
import threading
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import tpde  # noqa: E402
from helpers import assert_same  # noqa: E402
from tpde.chain import Chain  # noqa: E402
from tpde.entries import entry as entries  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from lightning_train import CharLM, loaders  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer_for(root: Any, io: Any, *, epochs: int = 1, callbacks: list[Any] | None = None,
                **kwargs: Any) -> L.Trainer:
    return L.Trainer(default_root_dir=str(root), max_epochs=epochs, plugins=[io],
                     callbacks=callbacks or [], logger=False,
                     accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_train_batches=2, limit_val_batches=1,
                     **kwargs)


def model_and_data(seed: int = 0, dim: int = 16) -> tuple[CharLM, Any, Any]:
    L.seed_everything(seed, verbose=False)
    train, val = loaders(windows=32, batch=16)
    return CharLM(dim=dim, layers=1), train, val


def tpde_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tpde")]


def test_a_saved_path_is_there_when_save_returns_and_a_new_trainer_resumes_from_it(
        tmp_path) -> None:
    model, train, val = model_and_data()
    first = trainer_for(tmp_path, tpde.TPDECheckpointIO(), callbacks=[])
    first.fit(model, train, val)
    path = str(tmp_path / "new" / "manual.ckpt")
    first.save_checkpoint(path)
    assert os.path.isfile(path)  # before any wait(): Lightning checks files at once
    again, train, val = model_and_data(seed=1)
    second = trainer_for(tmp_path, tpde.TPDECheckpointIO(), epochs=2)  # a plugin of its own
    second.fit(again, train, val, ckpt_path=path)
    assert second.global_step == 2 * first.global_step
    resumed = tpde.TPDECheckpointIO()
    assert resumed.load_checkpoint(path)["global_step"] == first.global_step
    resumed.teardown()


def test_a_repeated_file_name_gets_versions_and_every_checkpoint_survives(tmp_path) -> None:
    model, train, val = model_and_data()
    callback = ModelCheckpoint(dirpath=str(tmp_path), filename="fixed", monitor="val_loss",
                               save_top_k=-1, every_n_epochs=1)
    trainer = trainer_for(tmp_path, tpde.TPDECheckpointIO(), epochs=4, callbacks=[callback])
    trainer.fit(model, train, val)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))
    assert names == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed-v3.ckpt", "fixed.ckpt"]
    steps = [entries.read(str(tmp_path / n)).step for n in names]
    assert len(set(steps)) == 4
    assert sorted(steps) == Chain(str(tmp_path / ".tpde")).steps()


def test_save_last_link_into_a_folder_that_does_not_exist_yet(tmp_path) -> None:
    model, train, val = model_and_data()
    folder = tmp_path / "not" / "yet"
    callback = ModelCheckpoint(dirpath=str(folder), save_last="link", every_n_epochs=1)
    trainer = trainer_for(tmp_path, tpde.TPDECheckpointIO(), epochs=2, callbacks=[callback])
    trainer.fit(model, train, val)
    assert os.path.islink(folder / "last.ckpt")
    io = tpde.TPDECheckpointIO()
    assert io.load_checkpoint(str(folder / "last.ckpt"))["global_step"] == trainer.global_step
    io.teardown()


SCRIPT = """
import sys, torch, lightning as L
sys.path.insert(0, {examples!r})
import tpde
from lightning_train import CharLM, loaders
L.seed_everything(0, verbose=False)
model = CharLM(dim=16, layers=1)
train, val = loaders(windows=32, batch=16)
trainer = L.Trainer(max_epochs=1, plugins=[tpde.TPDECheckpointIO()], logger=False,
                    accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, limit_train_batches=2, limit_val_batches=1)
trainer.fit(model, train, val)
torch.save(model.state_dict(), {plain!r})
trainer.save_checkpoint({final!r})  # the script's last line: exit comes next
"""


def test_a_save_on_the_last_line_of_a_script_is_not_lost(tmp_path) -> None:
    final, plain = str(tmp_path / "final.ckpt"), str(tmp_path / "plain.pt")
    script = SCRIPT.format(examples=os.path.join(ROOT, "examples"), plain=plain, final=final)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert "failed at exit" not in done.stderr
    state = tpde.load_checkpoint(final)["state_dict"]
    assert_same(dict(state), dict(torch.load(plain)))


def test_a_save_after_fit_is_written_when_it_returns(tmp_path) -> None:
    model, train, val = model_and_data()
    plugin = tpde.TPDECheckpointIO()
    trainer = trainer_for(tmp_path, plugin, callbacks=[], enable_checkpointing=False)
    trainer.fit(model, train, val)
    trainer.save_checkpoint(str(tmp_path / "after.ckpt"))
    assert not [t for t in tpde_threads() if t.name == "tpde-lightning"]  # none in flight
    found = entries.read_any(str(tmp_path / "after.ckpt"))
    assert isinstance(found, entries.CheckpointEntry) and found.meta["global_step"] == 2


def test_a_save_during_fit_is_there_at_once_and_read_in_this_process_when_done(
        tmp_path) -> None:
    """Saves during fit go to the background: the path holds a pending entry until the step
    commits, and any reader in this process waits for it."""
    seen: list[int] = []

    class SaveMidway(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            path = str(tmp_path / "mid" / f"e{trainer.current_epoch}.ckpt")
            # The writer's lock, held here, keeps the background save from committing.
            with plugin.run_for(str(tmp_path / "mid" / ".tpde")).lock:
                trainer.save_checkpoint(path)
                assert isinstance(entries.read_any(path), entries.PendingEntry)
            seen.append(tpde.load_checkpoint(path)["global_step"])  # waits for the save
            assert isinstance(entries.read_any(path), entries.CheckpointEntry)

    model, train, val = model_and_data()
    plugin = tpde.TPDECheckpointIO()
    trainer = trainer_for(tmp_path, plugin, epochs=2, callbacks=[SaveMidway()])
    trainer.fit(model, train, val)
    assert seen == [2, 4]
    assert [r.path.rsplit("/", 1)[-1] for r in plugin.reports if "mid" in r.path] == \
        ["e0.ckpt", "e1.ckpt"]


def test_a_removal_during_fit_waits_for_no_save(tmp_path) -> None:
    """ModelCheckpoint removes the old best right after saving the new one: the file goes at
    once, and the step's bytes are freed after the save, in the background."""
    order: list[str] = []

    class SaveThenRemove(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            old, new = (str(tmp_path / f"e{trainer.current_epoch - k}.ckpt") for k in (1, 0))
            before = entries.read(old).step if trainer.current_epoch else None  # committed
            # The writer's lock, held here, keeps the save from committing, and the removal's
            # freeing queued behind it.
            with plugin.run_for(str(tmp_path / ".tpde")).lock:
                trainer.save_checkpoint(new)
                if before is not None:
                    trainer.strategy.remove_checkpoint(old)
                    assert not os.path.exists(old)  # the file goes at once
                    assert before in Chain(str(tmp_path / ".tpde")).steps()  # the step later
                order.append(type(entries.read_any(new)).__name__)

    model, train, val = model_and_data()
    plugin = tpde.TPDECheckpointIO()
    trainer_for(tmp_path, plugin, epochs=2, callbacks=[SaveThenRemove()]).fit(model, train, val)
    assert order == ["PendingEntry", "PendingEntry"]
    chain = Chain(str(tmp_path / ".tpde"))
    assert chain.steps() == [entries.read(str(tmp_path / "e1.ckpt")).step]
    assert not chain.at_rest().hidden


def test_a_plain_checkpoint_at_the_path_stays_until_the_save_commits(tmp_path) -> None:
    """A run that switches to tpde midway saves over plain files: a save that fails leaves
    the plain file as it was."""
    plain = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 7}
    folder = tmp_path / "switched"
    folder.mkdir()
    torch.save(plain, folder / "last.ckpt")
    (folder / ".tpde").write_bytes(b"a file where the chain would go: the save fails")

    class SaveOverIt(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            trainer.save_checkpoint(str(folder / "last.ckpt"))
            assert torch.load(folder / "last.ckpt")["global_step"] == 7  # still the plain one

    model, train, val = model_and_data()
    trainer = trainer_for(tmp_path, tpde.TPDECheckpointIO(), callbacks=[SaveOverIt()],
                          enable_checkpointing=False)
    with pytest.raises(tpde.StoreError):
        trainer.fit(model, train, val)
    assert_same(torch.load(folder / "last.ckpt"), plain)


def test_the_plugin_pickles_with_every_setting_and_saves_after(tmp_path) -> None:
    plugin = tpde.TPDECheckpointIO(error_bound={"state_dict/*": tpde.Rel(1e-3)},
                                   keyframe_every=3, max_pending=2)
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.options == plugin.options and copy.max_pending == 2
    model, train, val = model_and_data()
    trainer = trainer_for(tmp_path, copy)
    trainer.fit(model, train, val)
    trainer.save_checkpoint(str(tmp_path / "b.ckpt"))
    copy.teardown()
    saved = copy.load_checkpoint(str(tmp_path / "b.ckpt"))["state_dict"]
    for name, value in model.state_dict().items():
        assert torch.allclose(saved[name], value, rtol=1e-3, atol=0), name
    copy.teardown()


def test_ddp_spawn_with_a_passed_plugin_keeps_its_final_weights(tmp_path) -> None:
    model, train, val = model_and_data()
    # Spawning pickles the loaders: their tensors own their storage (views of one fail to
    # share).
    train, val = (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        loader.dataset.tensors[0].clone()), batch_size=16) for loader in (train, val))
    callback = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_epochs=1)
    plugin = tpde.TPDECheckpointIO(error_bound={"*weight": tpde.Rel(1e-3)})
    trainer = trainer_for(tmp_path, plugin, callbacks=[callback], strategy="ddp_spawn", devices=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, train, val)
    io = tpde.TPDECheckpointIO()
    last = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert last["global_step"] > 0
    # The weights came back from the workers through the plugin: trained, within the bound.
    for name, value in model.named_parameters():
        assert not torch.equal(value, before[name]), name
        assert torch.allclose(last["state_dict"][name], value, rtol=2e-3, atol=0), name
    io.teardown()


def test_finished_trainers_leave_no_thread_and_no_copy_of_the_state(tmp_path) -> None:
    """The stock plugin holds nothing once fit returns: neither may this one, not even the
    coding threads that resuming from the chain started."""
    gc.collect()  # plugins of earlier tests dropped without a teardown let go of their runs
    plugin = tpde.TPDECheckpointIO()
    largest = None
    for epoch in range(3):
        model, train, val = model_and_data(dim=48)
        callback = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_epochs=1)
        trainer = trainer_for(tmp_path, plugin, epochs=epoch + 1, callbacks=[callback])
        trainer.fit(model, train, val, ckpt_path="last" if epoch else None)
        largest = max(model.parameters(), key=lambda p: p.numel()).shape
        assert not tpde_threads(), tpde_threads()
        del trainer, model, callback
    gc.collect()
    alive = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.shape == largest]
    assert not alive, f"{len(alive)} tensors of the model's shape outlived its Trainer"
    plugin.teardown()
    assert plugin.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 3 * 2


def test_the_last_removal_before_teardown_frees_its_step(tmp_path) -> None:
    """save_top_k=1 on a falling metric removes the previous best after each save, the last
    of them right before fit ends: no step but the kept one survives it."""

    class Falling(CharLM):
        def on_validation_epoch_end(self) -> None:
            self.log("score", float(-self.current_epoch))

    L.seed_everything(0, verbose=False)
    model = Falling(dim=16, layers=1)
    train, val = loaders(windows=32, batch=16)
    callback = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", mode="min",
                               save_top_k=1, every_n_epochs=1)
    plugin = tpde.TPDECheckpointIO()
    trainer_for(tmp_path, plugin, epochs=3, callbacks=[callback]).fit(model, train, val)
    names = [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]
    chain = Chain(str(tmp_path / ".tpde"))
    assert len(names) == 1
    assert chain.steps() == [entries.read(str(tmp_path / names[0])).step]
    assert not chain.at_rest().hidden


def test_the_plugin_is_a_torch_checkpoint_io_that_never_writes_through_it(tmp_path,
                                                                         monkeypatch) -> None:
    """Code that checks for the default plugin's class finds it; every file is still tpde's."""
    from lightning.pytorch.plugins import TorchCheckpointIO

    def stock_write(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("saved through TorchCheckpointIO.save_checkpoint")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", stock_write)
    model, train, val = model_and_data()
    plugin = tpde.TPDECheckpointIO()
    trainer = trainer_for(tmp_path, plugin)
    assert isinstance(trainer.strategy.checkpoint_io, TorchCheckpointIO)
    trainer.fit(model, train, val)
    path = str(tmp_path / "final.ckpt")
    trainer.save_checkpoint(path)
    assert entries.read(path).step == Chain(str(tmp_path / ".tpde")).steps()[-1]
    plugin.teardown()


def test_storage_options_that_are_not_a_dict_are_refused_before_anything_is_written(
        tmp_path) -> None:
    model, train, val = model_and_data()
    plugin = tpde.TPDECheckpointIO()
    trainer = trainer_for(tmp_path, plugin)
    trainer.fit(model, train, val)
    path = tmp_path / "final.ckpt"
    with pytest.raises(TypeError, match=r"final\.ckpt.*a dict \(got str\)"):
        trainer.save_checkpoint(path, storage_options="my options")
    assert not path.exists()
    trainer.save_checkpoint(path, storage_options={"auto_mkdir": True})
    assert entries.read(str(path)).step >= 0
    plugin.teardown()


def test_resuming_from_a_path_that_does_not_exist_names_it_as_lightning_does(
        tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    plugin = tpde.TPDECheckpointIO()
    for path in ("not existing", str(tmp_path / "gone" / "x.ckpt")):
        with pytest.raises(FileNotFoundError, match=f"^Checkpoint file not found: {path}$"):
            plugin.load_checkpoint(path)
    model, train, val = model_and_data()
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: not existing"):
        trainer_for(tmp_path, plugin).fit(model, train, val, ckpt_path="not existing")
    assert not os.path.exists("not existing")


class _Whole(http.server.SimpleHTTPRequestHandler):
    """Answers every GET with the whole file, whatever Range asks (as some servers do)."""

    def log_message(self, *args: Any) -> None:
        pass


def test_reading_over_http_from_a_server_that_ignores_range(tmp_path) -> None:
    model, train, val = model_and_data()
    callback = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_epochs=1)
    plugin = tpde.TPDECheckpointIO()
    trainer_for(tmp_path, plugin, epochs=2, callbacks=[callback]).fit(model, train, val)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(_Whole, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/last.ckpt"
        state = tpde.load_checkpoint(url)
        weights = tpde.load_state_dict(url)  # the model's records alone: ranges of the blob
    finally:
        server.shutdown()
        server.server_close()
    assert_same(dict(state["state_dict"]), dict(model.state_dict()))
    assert_same(dict(weights), dict(model.state_dict()))


def test_a_plugin_dropped_without_teardown_keeps_no_copy_of_what_it_saved(tmp_path) -> None:
    shape = (3, 1 << 16)
    plugin = tpde.TPDECheckpointIO()
    plugin.save_checkpoint({"w": torch.randn(shape)}, str(tmp_path / "a.ckpt"))
    del plugin
    gc.collect()
    size = 3 * (1 << 16) * 4
    held = [o for o in gc.get_objects() if isinstance(o, (torch.Tensor, np.ndarray))
            and o.nbytes >= size]  # the state, or the words the next delta would be coded on
    assert not held
    assert torch.load(str(tmp_path / "a.ckpt"), weights_only=False)["w"].shape == shape
    # Its lease is this process's own: a new plugin here writes the folder at once.
    again = tpde.TPDECheckpointIO()
    again.save_checkpoint({"w": torch.zeros(shape)}, str(tmp_path / "b.ckpt"))
    again.teardown()
    assert not torch.load(str(tmp_path / "b.ckpt"), weights_only=False)["w"].any()


def test_a_plugin_collected_while_its_thread_makes_a_writer_does_not_hang(tmp_path) -> None:
    """A dropped plugin's finalizer runs wherever the collection happens: in the thread that
    is making a writer, under the writers' lock, a finalizer that waited for that lock hung
    the save (and the ``Trainer``) for good. What it lets go of is dropped at the next use."""
    from tpde.plugins import writers

    box = [tpde.TPDECheckpointIO()]
    box[0].save_checkpoint({"w": torch.ones(8)}, str(tmp_path / "a.ckpt"))
    done = threading.Event()

    def drop_under_the_lock() -> None:
        with writers._LOCK:
            box.clear()  # the last reference: its finalizer runs here, now
            gc.collect()
        done.set()

    thread = threading.Thread(target=drop_under_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert done.is_set(), "a plugin's finalizer waited for the lock its own thread held"
    again = tpde.TPDECheckpointIO()  # the folder's lease is this process's: taken at once
    again.save_checkpoint({"w": torch.zeros(8)}, str(tmp_path / "b.ckpt"))
    again.teardown()
    assert not torch.load(str(tmp_path / "b.ckpt"), weights_only=False)["w"].any()
    assert torch.load(str(tmp_path / "a.ckpt"), weights_only=False)["w"].all()
