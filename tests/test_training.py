"""End to end: a real model trained with ``attach`` on S3 (moto server), restored by the CLI."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch

import tpde
from forked import run_module
from helpers import assert_same, decode_depths

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def tiny_lm(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A small character-level language model on real text (this repository's own README)."""
    torch.manual_seed(seed)
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), "rb").read()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Flatten(),
                                torch.nn.Linear(32 * 8, 64), torch.nn.GELU(), torch.nn.Linear(64, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), data


def batches(data: torch.Tensor, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        at = torch.randint(0, data.numel() - 9, (32,), generator=g)
        window = torch.stack([data[a : a + 9] for a in at.tolist()])
        yield window[:, :8], window[:, 8]


def cli(*args: str, storage: dict | None = None) -> subprocess.CompletedProcess:
    opts = []
    for k, v in (storage or {}).items():
        if isinstance(v, dict):
            opts += [f"-o{k}.{kk}={vv}" for kk, vv in v.items()]
        else:
            opts += [f"-o{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    return run_module("tpde.cli", *args, *opts)


def test_attach_on_s3_restores_every_step_bit_exactly_through_the_cli_and_the_api(s3_server, tmp_path) -> None:
    url, opts = "s3://tpde/attach-run", s3_server["options"]
    model, opt, data = tiny_lm(0)
    expected = {}
    handle = tpde.attach(model, opt, url, every_n_steps=5, keyframe_every=4, storage_options=opts)
    original_save = handle.save_now

    def spy() -> tpde.StepInfo:
        info = original_save()
        expected[handle.step] = copy.deepcopy(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": handle.step})
        return info

    handle.save_now = spy  # type: ignore[method-assign]
    for epoch in range(3):
        for x, y in batches(data, 10, epoch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    handle.remove()
    assert sorted(expected) == [5, 10, 15, 20, 25, 30]
    assert [i.keyframe for i in handle.saved] == [True] + [False] * 5  # keyframes per tensor
    chain = tpde.Checkpointer(url, storage_options=opts).chain
    assert all(max(decode_depths(chain, s).values()) <= 3 for s in expected)

    listing = cli("ls", url, "--json", storage=opts)
    assert listing.returncode == 0, listing.stderr
    assert [s["step"] for s in json.loads(listing.stdout)["steps"]] == sorted(expected)
    reader = tpde.Checkpointer(url, storage_options=opts)
    for step, state in expected.items():
        # Every step restores bit-exactly; the CLI restores the keyframe and the deepest.
        if step in (5, 30):
            out = tmp_path / f"{step}.pt"
            done = cli("restore", url, "--step", str(step), "--output", str(out), storage=opts)
            assert done.returncode == 0, done.stderr
            restored = torch.load(out, weights_only=True)
        else:
            restored = reader.load(step)
        assert set(restored.pop("rng")) == {"python", "numpy", "torch"}  # (checked on resume)
        assert_same(state, restored)
    verify = cli("verify", url, "--json", storage=opts)
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout


def test_attach_resume_continues_the_chain_with_a_delta(tmp_path) -> None:
    url = str(tmp_path / "run")
    model, opt, data = tiny_lm(1)
    handle = tpde.attach(model, opt, url, every_n_steps=4)
    for x, y in batches(data, 8, 0):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    handle.remove()
    trained = copy.deepcopy(model.state_dict())

    model2, opt2, _ = tiny_lm(2)  # different init: resume must overwrite it
    # Forgetting resume=True fails here, not inside a later optimizer.step(); nothing changes.
    with pytest.raises(tpde.StepExistsError, match="resume=True"):
        tpde.attach(model2, opt2, url, every_n_steps=4)
    assert tpde.Checkpointer(url).steps() == [4, 8]
    resumed = tpde.attach(model2, opt2, url, every_n_steps=4, resume=True)
    assert resumed.step == 8
    assert_same(trained, model2.state_dict())
    for x, y in batches(data, 4, 1):
        opt2.zero_grad()
        torch.nn.functional.cross_entropy(model2(x), y).backward()
        opt2.step()
    assert resumed.saved[-1].step == 12 and not resumed.saved[-1].keyframe
    assert resumed.checkpointer.chain.manifest(12).parent == 8


def test_attach_resume_on_a_run_saved_without_an_optimizer_says_what_is_missing(tmp_path) -> None:
    run = str(tmp_path / "weights-only")
    model = torch.nn.Linear(4, 4)
    with tpde.Checkpointer(run) as ck:
        ck.save(1, {"model": model.state_dict(), "step": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tpde.UnsupportedError, match=r"needs the step's 'optimizer'.*"
                                                    r"holds only \['model', 'step'\]"):
        tpde.attach(model, opt, run, every_n_steps=1, resume=True)
    with tpde.Checkpointer(run) as ck:  # the refused attach left no writer behind
        ck.save(2, {"model": model.state_dict(), "step": 2})


class _Net(torch.nn.Module):
    """Batch norm (buffers a forward changes) and dropout (draws from torch's generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                                        torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                        torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _loop(seed: int):
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    return model, opt, sched, scaler


def _train(model, opt, sched, scaler, iterations: range) -> None:
    import random

    import numpy as np
    for _ in iterations:
        # Data drawn from all three generators: a resume that put one back wrong differs.
        x = torch.randn(8, 4) * (1 + random.random()) + float(np.random.rand())
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def _everything(model, opt, sched, scaler) -> dict:
    import random

    import numpy as np
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                          "torch": torch.get_rng_state(), "python": random.getstate(),
                          "numpy": np.random.get_state()[1].tolist()})


def test_a_resumed_loop_ends_as_the_uninterrupted_one(tmp_path) -> None:
    import random

    import numpy as np

    def seeded() -> None:
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)

    whole = _loop(0)
    seeded()
    _train(*whole, range(10))
    expected = _everything(*whole)

    run = str(tmp_path / "run")
    first = _loop(0)
    seeded()
    handle = tpde.attach(first[0], first[1], run, every_n_steps=3, scheduler=first[2],
                         scaler=first[3])
    _train(*first, range(7))  # steps 3 and 6 are saved as steps 4 and 7 begin
    handle.checkpointer.close()  # the job stops here, before step 7 could be saved
    assert tpde.Checkpointer(run).steps() == [3, 6]

    again = _loop(1)  # other weights, and the generators wherever they are
    torch.manual_seed(99)
    random.seed(99)
    resumed = tpde.attach(again[0], again[1], run, every_n_steps=3, scheduler=again[2],
                          scaler=again[3], resume=True)
    assert resumed.step == 6
    _train(*again, range(resumed.step, 10))
    resumed.remove()  # saves step 9, still due
    assert_same(_everything(*again), expected)
    assert tpde.Checkpointer(run).steps() == [3, 6, 9]

    other = str(tmp_path / "without")
    plain = _loop(2)
    without = tpde.attach(plain[0], plain[1], other, every_n_steps=1)
    without.save_now()
    without.remove()
    with pytest.raises(tpde.UnsupportedError, match="needs the step's 'scheduler'"):
        tpde.attach(plain[0], plain[1], other, every_n_steps=1, scheduler=plain[2],
                    resume=True)
