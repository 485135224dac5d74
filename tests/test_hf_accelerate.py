"""``tpde.hf.attach(accelerator)``: Accelerate's ``save_state``/``load_state`` with the real
library (a GPT-2 built from a config, with dropout and tied weights, AdamW and a schedule, on
the CPU), against the stock ``Accelerator``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="needs accelerate: pip install 'tpde[dev]'")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402

import tpde  # noqa: E402
import tpde.hf  # noqa: E402
from helpers import difference  # noqa: E402
from hf_runs import gpt2, rows  # noqa: E402
from tpde.entries import entry  # noqa: E402
from tpde.plugins.hf_folders import held_bytes  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 4


@pytest.fixture(autouse=True)
def _accelerate_state_reset() -> Any:
    """Accelerate keeps its state process-wide; a later test's ``Trainer`` (which builds an
    ``Accelerator``) must not find this test's."""
    yield
    AcceleratorState._reset_state(True)


class Counter:
    """The loop's step, saved with the state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def train(project: str, attach: dict | None, *, stop_at: int = STEPS, resume: bool = False,
          total_limit: int | None = 2, automatic: bool = True) -> tuple[Accelerator, Any]:
    """Train to ``stop_at`` (from the newest checkpoint where ``resume``), saving every
    ``EVERY`` steps; the accelerator and the prepared model, optimizer and scheduler."""
    AcceleratorState._reset_state(True)
    set_seed(0)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / STEPS)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=automatic, total_limit=total_limit))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    if attach is not None:
        tpde.hf.attach(acc, **attach)
    if resume:
        acc.load_state()
        newest = max(int(n.split("_")[1]) for n in os.listdir(os.path.join(project, "checkpoints")))
        acc.project_configuration.iteration = newest + 1  # as Accelerate's docs ask
    data = torch.stack([r["input_ids"] for r in rows()])
    model.train()
    while counter.step < stop_at:
        batch = data[(counter.step * 4) % len(data):][:4]
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.step += 1
        if counter.step % EVERY == 0:
            acc.save_state()
    acc.end_training()
    return acc, (model, opt, sched)


def outcome(parts: Any) -> dict[str, Any]:
    model, opt, sched = parts
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state()}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_resumed_accelerator_ends_as_an_uninterrupted_stock_one(tmp_path, where,
                                                                  request) -> None:
    attach: dict = {}
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        attach = {"chain": f"s3://tpde/acc-{uuid.uuid4().hex[:8]}",
                  "storage_options": server["options"]}
    _, stock = train(str(tmp_path / "stock"), None)
    expected = outcome(stock)
    train(str(tmp_path / "tpde"), attach, stop_at=8)
    _, resumed = train(str(tmp_path / "tpde"), attach, resume=True)
    assert difference(expected, outcome(resumed)) is None
    folder = tmp_path / "tpde" / "checkpoints" / "checkpoint_2"
    files = set(os.listdir(folder))
    assert "checkpoint.tpde" in files and {"model.safetensors", "optimizer.bin"}.isdisjoint(files)
    assert {"scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"} <= files
    assert os.path.isdir(tmp_path / "tpde" / ".tpde") == (where == "local")


def test_rotation_frees_steps_and_writes_each_step_whole(tmp_path) -> None:
    stock, _ = train(str(tmp_path / "stock"), None)
    acc, _ = train(str(tmp_path / "tpde"), {})
    names = sorted(os.listdir(tmp_path / "tpde" / "checkpoints"))
    assert names == ["checkpoint_1", "checkpoint_2"] == sorted(
        os.listdir(tmp_path / "stock" / "checkpoints"))
    chain = tpde.Checkpointer(str(tmp_path / "tpde" / ".tpde")).chain
    assert len(chain.steps()) == 2
    # Accelerate deletes the oldest folder before it writes the next: no room for a re-base.
    assert all(chain.manifest(s).keyframe for s in chain.steps())
    assert held_bytes(str(tmp_path / "tpde")) < held_bytes(str(tmp_path / "stock"))
    assert len(acc.tpde.reports) == 3


def test_without_a_limit_steps_are_deltas(tmp_path) -> None:
    train(str(tmp_path), {}, total_limit=None)
    chain = tpde.Checkpointer(str(tmp_path / ".tpde")).chain
    assert [chain.manifest(s).keyframe for s in chain.steps()] == [True, False, False]


def test_an_explicit_folder_restores_to_files_the_stock_accelerator_loads(tmp_path) -> None:
    acc, parts = train(str(tmp_path / "p"), {}, stop_at=2, automatic=False)
    saved = str(tmp_path / "run" / "step_0")
    acc.save_state(saved, safe_serialization=False)
    acc.tpde.wait()
    assert {"pytorch_model.bin", "optimizer.bin"}.isdisjoint(os.listdir(saved))
    plain = str(tmp_path / "plain")
    cli = subprocess.run([sys.executable, "-m", "tpde.cli", "restore", saved, "--output", plain],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert {"pytorch_model.bin", "optimizer.bin", "random_states_0.pkl"} <= set(os.listdir(plain))
    expected = outcome(parts)
    stock, stock_parts = train(str(tmp_path / "q"), None, stop_at=0, automatic=False)
    with torch.no_grad():
        for p in stock_parts[0].parameters():
            p.add_(1.0)  # the load must overwrite these
    stock.load_state(plain)
    assert difference(expected["weights"], outcome(stock_parts)["weights"]) is None
    assert difference(expected["optimizer"], outcome(stock_parts)["optimizer"]) is None
    found = entry.read(os.path.join(saved, "checkpoint.tpde"))
    assert found is not None and found.meta["iteration"] == 0


SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from accelerate import Accelerator
import tpde.hf
from hf_runs import gpt2
acc = tpde.hf.attach(Accelerator(cpu=True))
model = acc.prepare(gpt2())
torch.save(model.state_dict(), {plain!r})
acc.save_state({saved!r})  # the script's last line: exit comes next, the save still queued
"""


def test_a_save_state_on_the_last_line_of_a_script_is_not_lost(tmp_path) -> None:
    saved, plain = str(tmp_path / "run" / "step_0"), str(tmp_path / "plain.pt")
    script = SCRIPT.format(tests=os.path.dirname(__file__), plain=plain, saved=saved)
    # Run from tmp_path: the checkout's top-level kernels/ is not Hugging Face's kernels.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "failed at exit" not in done.stderr
    found = entry.read(os.path.join(saved, "checkpoint.tpde"))
    assert isinstance(found, entry.CheckpointEntry)
    expected = torch.load(plain)
    state = tpde.load_state_dict(saved)
    assert difference({k: expected[k] for k in state}, state) is None
