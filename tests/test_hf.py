"""``tpde.hf.attach`` with the real Hugging Face libraries: transformers' ``Trainer``, TRL's
``SFTTrainer`` and PEFT's LoRA, on local disk and on S3 (moto), against the stock ``Trainer``
doing the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install 'tpde[dev]'")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import tpde  # noqa: E402
import tpde.hf  # noqa: E402
from helpers import difference  # noqa: E402
from hf_runs import build, gpt2, outcome, rows  # noqa: E402
from tpde.entries import entry  # noqa: E402
from tpde.errors import TPDEError  # noqa: E402
from tpde.plugins.hf_folders import held_bytes  # noqa: E402

pytestmark = pytest.mark.slow


def _resumed(out: str, kind: str, attach: dict, resume: str) -> dict:
    """A run stopped after step 8, then resumed in a new trainer (``resume``: "newest" for
    ``True``, "path" for the checkpoint's folder)."""
    build(out, kind, attach=attach, stop_at=8).train()
    trainer = build(out, kind, attach=attach)
    trainer.train(resume_from_checkpoint=True if resume == "newest"
                  else os.path.join(out, "checkpoint-8"))
    return outcome(trainer)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_resumed_trainer_ends_as_an_uninterrupted_stock_one(tmp_path, where, request) -> None:
    attach: dict = {}
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        attach = {"chain": f"s3://tpde/hf-{uuid.uuid4().hex[:8]}",
                  "storage_options": server["options"]}
    stock = build(str(tmp_path / "stock"))
    stock.train()
    resumed = _resumed(str(tmp_path / "tpde"), "full", attach,
                       "newest" if where == "local" else "path")
    assert difference(outcome(stock), resumed) is None
    folder = tmp_path / "tpde" / "checkpoint-12"
    files = set(os.listdir(folder))
    assert "checkpoint.tpde" in files and {"model.safetensors", "optimizer.pt"}.isdisjoint(files)
    assert {"config.json", "trainer_state.json", "scheduler.pt", "rng_state.pth"} <= files
    assert os.path.isdir(tmp_path / "tpde" / ".tpde") == (where == "local")


@pytest.mark.parametrize("kind", ["lora", "sft"])
def test_lora_and_sft_trainers_resume_bit_identical(tmp_path, kind) -> None:
    stock = build(str(tmp_path / "stock"), kind)
    stock.train()
    resumed = _resumed(str(tmp_path / "tpde"), kind, {}, "newest")
    assert difference(outcome(stock), resumed) is None


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_only(tmp_path) -> None:
    trainer = build(str(tmp_path), "lora", attach={})
    trainer.train()
    chain, step, _ = entry.resolve(str(tmp_path / "checkpoint-12"))
    state, _ = chain.load(step, map_location="cpu")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in state["model"])
    assert len(state["model"]) == len(trained)
    assert len(state["optimizer"]["state"]) == len(trained)
    assert "adapter_config.json" in os.listdir(tmp_path / "checkpoint-12")


def test_rotation_keeps_the_newest_and_never_holds_more_than_the_trainer(tmp_path) -> None:
    stock = build(str(tmp_path / "stock"), steps=20)
    stock.train()
    trainer = build(str(tmp_path / "tpde"), attach={}, steps=20)
    trainer.train()
    names = sorted(n for n in os.listdir(tmp_path / "tpde") if n.startswith("checkpoint-"))
    assert names == ["checkpoint-16", "checkpoint-20"] == sorted(
        n for n in os.listdir(tmp_path / "stock") if n.startswith("checkpoint-"))
    chain = tpde.Checkpointer(str(tmp_path / "tpde" / ".tpde")).chain
    assert len(chain.steps()) == 2
    assert held_bytes(str(tmp_path / "tpde")) < held_bytes(str(tmp_path / "stock"))
    assert trainer.tpde.reports and trainer.tpde.ledger.freed_bytes >= 0
    # Files unchanged since the previous checkpoint are held once; the others are their own.
    a, b = tmp_path / "tpde" / "checkpoint-16", tmp_path / "tpde" / "checkpoint-20"
    assert os.stat(a / "config.json").st_ino == os.stat(b / "config.json").st_ino
    assert os.stat(a / "trainer_state.json").st_ino != os.stat(b / "trainer_state.json").st_ino
    plain = build(str(tmp_path / "copies"), attach={"link_unchanged": False}, steps=20)
    plain.train()
    assert os.stat(tmp_path / "copies" / "checkpoint-16" / "config.json").st_nlink == 1


class _HoldCommits(TrainerCallback):
    """Keeps the chain's writer busy from the start until training ends, so that every entry
    commits well after the Trainer finished writing its folder."""

    def __init__(self, trainer: Trainer) -> None:
        self.run = trainer.tpde.run_for()
        self.run.lock.acquire()

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        time.sleep(0.1)
        self.run.lock.release()


def test_a_late_commit_keeps_the_folder_times_rotation_sorts_by(tmp_path) -> None:
    # The Trainer rotates by folder modification times: a commit (or a link) that moved an
    # older folder's time past a newer folder's would make rotation delete the newer one.
    trainer = build(str(tmp_path), attach={"max_pending": 3}, save_total_limit=None)
    trainer.add_callback(_HoldCommits(trainer))
    trainer.train()
    folders = [tmp_path / f"checkpoint-{s}" for s in (4, 8, 12)]
    for folder in folders:
        assert isinstance(entry.read_any(str(folder / "checkpoint.tpde")), entry.CheckpointEntry)
        assert os.stat(folder).st_mtime_ns <= os.stat(folder / "trainer_state.json").st_mtime_ns
    times = [os.stat(f).st_mtime_ns for f in folders]
    assert times == sorted(times)


def test_a_step_saved_again_changes_no_other_checkpoint(tmp_path) -> None:
    trainer = build(str(tmp_path), attach={}, steps=8, save_total_limit=None)
    trainer.train()
    earlier = tmp_path / "checkpoint-4" / "config.json"
    before = earlier.read_bytes()
    assert os.stat(earlier).st_nlink == 2  # shared with checkpoint-8
    trainer.model.config.tpde_note = "saved again"
    trainer._save_checkpoint(trainer.model, None)  # the Trainer writes checkpoint-8 again
    trainer.tpde.close()
    assert earlier.read_bytes() == before
    assert b"saved again" in (tmp_path / "checkpoint-8" / "config.json").read_bytes()


def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path) -> None:
    # greater_is_better on the loss: the best checkpoint is not the newest one.
    best = dict(eval_strategy="steps", eval_steps=4, load_best_model_at_end=True,
                metric_for_best_model="eval_loss", greater_is_better=True, save_total_limit=1)
    stock = build(str(tmp_path / "stock"), **best)
    stock.train()
    trainer = build(str(tmp_path / "tpde"), attach={}, **best)
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith(
        os.path.basename(stock.state.best_model_checkpoint))
    assert not trainer.state.best_model_checkpoint.endswith("checkpoint-12")
    assert difference(outcome(stock)["weights"], outcome(trainer)["weights"]) is None
    # The Trainer deleted the newest checkpoint as training ended: its step is freed too.
    names = [n for n in os.listdir(tmp_path / "tpde") if n.startswith("checkpoint-")]
    assert names == [os.path.basename(trainer.state.best_model_checkpoint)]
    chain = tpde.Checkpointer(str(tmp_path / "tpde" / ".tpde")).chain
    assert len(chain.steps()) == 1
    assert held_bytes(str(tmp_path / "tpde")) < held_bytes(str(tmp_path / "stock"))


def test_save_only_model_stores_the_weights_alone(tmp_path) -> None:
    trainer = build(str(tmp_path), attach={}, save_only_model=True)
    trainer.train()
    state = tpde.load_state_dict(str(tmp_path / "checkpoint-12"))
    trained = trainer.model.state_dict()
    assert set(state) == set(trained) - {"lm_head.weight"}  # tied to the embedding: not saved
    assert all(torch.equal(state[k], trained[k]) for k in state)
    fresh = gpt2()  # a tied weight is loaded under both its names
    tpde.load_state_dict(str(tmp_path / "checkpoint-12"), model=fresh)
    assert difference(trained, fresh.state_dict()) is None
    chain, step, _ = entry.resolve(str(tmp_path / "checkpoint-12"))
    assert "optimizer" not in chain.load(step, map_location="cpu")[0]


def test_save_model_writes_plain_files(tmp_path) -> None:
    trainer = build(str(tmp_path / "run"), attach={})
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert "model.safetensors" in os.listdir(tmp_path / "final")
    again = type(trainer.model).from_pretrained(str(tmp_path / "final"))
    assert difference(trainer.model.state_dict(), again.state_dict()) is None


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpde.cli", *argv], capture_output=True,
                          text=True)


def test_restore_writes_a_plain_checkpoint_folder_the_stock_trainer_resumes(tmp_path) -> None:
    stock = build(str(tmp_path / "stock"))
    stock.train()
    build(str(tmp_path / "tpde"), attach={}, stop_at=8).train()
    plain = tmp_path / "plain" / "checkpoint-8"
    (tmp_path / "plain").mkdir()
    done = _cli("restore", str(tmp_path / "tpde" / "checkpoint-8"), "--output", str(plain),
                "--json", "-q")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["format"] == "folder"
    files = set(os.listdir(plain))
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "config.json"} <= files
    assert "checkpoint.tpde" not in files
    resumed = build(str(tmp_path / "plain"))  # the stock Trainer, on the plain folder
    resumed.train(resume_from_checkpoint=str(plain))
    assert difference(outcome(stock), outcome(resumed)) is None
    again = _cli("restore", str(tmp_path / "tpde" / "checkpoint-8"), "--output", str(plain))
    assert again.returncode != 0 and "not an empty folder" in again.stderr


def test_a_checkpoint_folder_mounts_for_inference(tmp_path) -> None:
    trainer = build(str(tmp_path), attach={})
    trainer.train()
    model = tpde.mount(str(tmp_path / "checkpoint-12"), model=gpt2(), budget=0)
    ids = torch.stack([r["input_ids"] for r in rows(4)])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trainer.model(ids).logits)
    listed = _cli("ls", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    assert "checkpoint-12/checkpoint.tpde" in listed.stdout


def test_attach_refuses_a_lossy_chain_and_a_second_attach(tmp_path) -> None:
    with pytest.raises(TPDEError, match="error_bound"):
        build(str(tmp_path), attach={"error_bound": 1e-3})
    trainer = build(str(tmp_path), attach={})
    with pytest.raises(TPDEError, match="attached already"):
        tpde.hf.attach(trainer)


def test_a_kill_mid_save_resumes_from_the_newest_committed_checkpoint(tmp_path) -> None:
    """A quick version of ``campaigns/hf_crash.py``: two kill points inside the run's saves
    (the campaign's ends, its first and last operations, are left to it)."""
    from campaigns.hf_crash import campaign

    stats = campaign(str(tmp_path), points=2, within=(0.4, 0.8))
    assert stats["kills"] == 2 and stats["operations"] > 20 and stats["resumed"] == 2
