"""tpde.mount: a read-only model decoded just in time, against the same step loaded densely."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time

import fsspec
import numpy as np
import pytest
import torch

import tpde
from helpers import NATIVE, assert_same, flip_bit, native_path, zstd_path
from tpde.chain import Chain
from tpde.chain.read import Reader
from tpde.cli import main as cli
from tpde.runtime.frame_threads import usable_cpus

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from mount_bench import Probe, drift, torch_threads  # noqa: E402  (the benchmark's own)


class Encoder(torch.nn.Module):
    """A BERT-shaped encoder the tests build themselves (14 MB of fp32 weights): embeddings
    named as drift() expects, a non-persistent position buffer (as BERT's position ids are),
    and blocks of LayerNorm, attention and MLP written out, without fused fast paths."""

    def __init__(self, vocab: int = 2000, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(vocab, dim)
        self.position_embeddings = torch.nn.Embedding(64, dim)
        self.register_buffer("position_ids", torch.arange(64), persistent=False)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "LayerNorm": torch.nn.LayerNorm(dim), "qkv": torch.nn.Linear(dim, 3 * dim),
            "out": torch.nn.Linear(dim, dim), "LayerNorm2": torch.nn.LayerNorm(dim),
            "up": torch.nn.Linear(dim, 4 * dim), "down": torch.nn.Linear(4 * dim, dim),
        }) for _ in range(layers))
        self.heads = 4

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids[:n])
        for b in self.blocks:
            q, k, v = b["qkv"](b["LayerNorm"](x)).unflatten(-1, (3, self.heads, -1)).unbind(2)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + b["out"](att.transpose(1, 2).flatten(2))
            x = x + b["down"](torch.nn.functional.gelu(b["up"](b["LayerNorm2"](x))))
        return x


BATCH = {"input_ids": torch.randint(0, 2000, (3, 48), generator=torch.Generator().manual_seed(1))}


def fresh_encoder() -> Encoder:
    return Encoder().eval()


def dense(folder: str, step: int) -> Encoder:
    """The reference: the model loaded from the plain ``torch.save`` file of the same state."""
    model = fresh_encoder()
    model.load_state_dict(torch.load(os.path.join(folder, f"dense-{step}.pt"), weights_only=True))
    return model


@pytest.fixture(scope="module")
def encoder_chain(tmp_path_factory) -> tuple[str, str]:
    """Three steps of the encoder's weights (a keyframe, then two deltas) in a run, and each
    step also written with ``torch.save``; returns (run, folder of the plain files)."""
    folder = str(tmp_path_factory.mktemp("encoder"))
    torch.manual_seed(0)
    state = dict(fresh_encoder().state_dict())
    run = os.path.join(folder, "run")
    with tpde.Checkpointer(run) as ckpt:
        for step in range(3):
            ckpt.save(step, state)
            torch.save(state, os.path.join(folder, f"dense-{step}.pt"))
            state = drift(state, step)
    return run, folder


@pytest.mark.slow
@NATIVE
@pytest.mark.parametrize("step", [0, 2])
@pytest.mark.parametrize("budget", ["none", "zero", "third"])
def test_mounted_equals_dense(encoder_chain, step: int, budget: str, native: bool,
                              monkeypatch) -> None:
    native_path(monkeypatch, native)
    run, folder = encoder_chain
    reference = dense(folder, step)
    with torch.no_grad():
        expected = reference(**BATCH)
    total = sum(v.numel() * v.element_size() for v in reference.state_dict().values())
    limit = {"none": None, "zero": 0, "third": total // 3}[budget]
    model = tpde.mount(run, step, fresh_encoder, device="cpu", budget=limit)
    probe = Probe(model)
    with torch.no_grad(), probe:
        for _ in range(2):  # the second pass prefetches in the order the first one learned
            assert torch.equal(model(**BATCH), expected)
    stats = model.tpde_mount.stats
    assert probe.peak > 0
    if limit is not None:
        # Residual non-persistent buffers (position ids) are the model's own, not the mount's.
        own = sum(b.numel() * b.element_size() for n, b in reference.named_buffers()
                  if n not in reference.state_dict())
        assert probe.peak <= limit + stats.largest_module_bytes + own
        assert probe.peak < total // 2  # the bound holds something back at this size
    else:
        assert stats.decodes == stats.modules  # decoded once, kept
    # Natively, every module's stored tensors but its packs' were planned and rebuilt there.
    planned = model.tpde_mount.decoder.native or {}
    assert bool(planned) == native and all(planned.values())
    model.tpde_mount.close()


@NATIVE
def test_weights_held_past_their_module_keep_their_values(encoder_chain, native: bool,
                                                          monkeypatch) -> None:
    """At budget 0 the words a module's native rebuild makes come from the mount's arena, and
    each forward reuses them; a weight someone still holds (here, every MLP input weight a
    forward computed with) is not handed out again: after later forwards each still equals
    the stored one."""
    native_path(monkeypatch, native)
    run, folder = encoder_chain
    reference = dense(folder, 2)
    model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=0)
    kept: list[torch.Tensor] = []
    linear = torch.nn.functional.linear

    def keeping(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        if weight.shape == reference.blocks[0]["up"].weight.shape:
            kept.append(weight)
        return linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", keeping)
    with torch.no_grad():
        for _ in range(3):
            model(**BATCH)
    arena = model.tpde_mount.decoder.arena
    assert arena is not None
    maps = [(np.frombuffer(m, dtype=np.uint8).ctypes.data, len(m)) for m in arena._maps]
    assert all(any(a <= t.data_ptr() < a + n for a, n in maps) == native for t in kept)
    assert len(kept) == 3 * len(reference.blocks)
    for i, t in enumerate(kept):
        assert torch.equal(t, reference.blocks[i % len(reference.blocks)]["up"].weight), i
    model.tpde_mount.close()


#: Tests of decoding ahead, which needs a CPU that torch's threads leave free.
AHEAD = pytest.mark.skipif(usable_cpus() < 2, reason="decoding ahead needs two CPUs")


@AHEAD
def test_at_budget_zero_the_next_modules_are_decoded_ahead_on_a_spare_cpu(
        encoder_chain) -> None:
    """Where torch's intra-op threads leave a CPU free, a mount at budget 0 decodes the next
    modules on its worker (or on the forward's thread while the worker is busy) within the
    largest module's room; where they take every CPU, it decodes nothing ahead. Either way the
    output is the dense model's and every module is decoded once a forward."""
    run, folder = encoder_chain
    for threads, ahead in ((usable_cpus() - 1, True), (usable_cpus(), False)):
        # Matmuls sum in another order on another number of threads: the dense model's output
        # is computed on as many as the mount's.
        with torch_threads(threads), torch.no_grad():
            expected = {step: dense(folder, step)(**BATCH) for step in (0, 2)}
        for step in (0, 2):
            model = tpde.mount(run, step, fresh_encoder, device="cpu", budget=0, prefetch=4)
            probe = Probe(model)
            with torch_threads(threads), torch.no_grad(), probe:
                for _ in range(3):
                    assert torch.equal(model(**BATCH), expected[step]), (threads, step)
            stats = model.tpde_mount.stats
            assert stats.decodes == 3 * stats.modules
            assert (stats.decoded_ahead > 0) == ahead, (threads, stats.decoded_ahead)
            assert probe.peak <= stats.largest_module_bytes + 64 * 8  # + the position ids
            model.tpde_mount.close()


@AHEAD
def test_a_mount_made_on_one_cpu_decodes_ahead_once_let_onto_more(encoder_chain) -> None:
    """The CPUs torch's threads leave free are counted at each forward, not when the model
    was mounted: mounted while its thread was held to one CPU, a model decodes nothing ahead
    there, and decodes ahead once the thread may run on every CPU."""
    run, folder = encoder_chain
    everywhere = os.sched_getaffinity(0)
    with torch_threads(1), torch.no_grad():
        expected = dense(folder, 2)(**BATCH)
        try:
            os.sched_setaffinity(0, {min(everywhere)})
            model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=0, prefetch=4)
            assert torch.equal(model(**BATCH), expected)
            assert model.tpde_mount.stats.decoded_ahead == 0
        finally:
            os.sched_setaffinity(0, everywhere)
        for _ in range(2):
            assert torch.equal(model(**BATCH), expected)
    assert model.tpde_mount.stats.decoded_ahead > 0
    model.tpde_mount.close()


@AHEAD
def test_a_damaged_module_decoded_ahead_fails_its_own_forward(encoder_chain, tmp_path
                                                              ) -> None:
    """A damaged record of a module decoded ahead is an error naming its tensor, on this forward
    and the next: never an output from the damaged words."""
    run = str(tmp_path / "run")
    shutil.copytree(encoder_chain[0], run)
    m = Chain(run).manifest(2)
    flip_bit(run, m, m.record("blocks.2.out.weight"))
    model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=0, prefetch=4)
    for _ in range(2):
        with pytest.raises(tpde.CorruptionError, match=r"blocks\.2\.out\.weight"), \
                torch_threads(usable_cpus() - 1), torch.no_grad():
            model(**BATCH)
    assert model.tpde_mount.stats.decoded_ahead > 0
    model.tpde_mount.close()


def test_a_forward_that_fails_to_read_its_weights_leaves_the_budget_to_the_next(
        encoder_chain, tmp_path) -> None:
    """A module whose weights cannot be read (its blob gone for a moment) fails its forward;
    once the blob is back, forwards compute as the dense model and the budget holds again: the
    failed module is not taken for one still running, which would keep its weights."""
    run, folder = str(tmp_path / "run"), encoder_chain[1]
    shutil.copytree(encoder_chain[0], run)
    blob = os.path.join(run, Chain(run).manifest(0).blob)
    with torch.no_grad():
        expected = dense(folder, 0)(**BATCH)
    model = tpde.mount(run, 0, fresh_encoder, device="cpu", budget=0, resident="store")
    os.rename(blob, blob + ".away")
    with pytest.raises(tpde.TPDEError), torch.no_grad():
        model(**BATCH)
    os.rename(blob + ".away", blob)
    probe = Probe(model)
    with torch.no_grad(), probe:
        for _ in range(2):
            assert torch.equal(model(**BATCH), expected)
    assert probe.peak <= model.tpde_mount.stats.largest_module_bytes + 64 * 8  # + position ids
    model.tpde_mount.close()


@pytest.mark.slow
def test_mount_never_writes_even_while_a_writer_appends(encoder_chain, tmp_path) -> None:
    run, folder = encoder_chain
    fs = fsspec.filesystem("file")

    def listing() -> dict[str, str]:
        return {p: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(run)}

    before = listing()
    model = tpde.mount(run, 2, fresh_encoder(), device="cpu", budget=0, resident="store")
    with torch.no_grad():
        first = model(**BATCH)
        assert torch.equal(first, dense(folder, 2)(**BATCH))
    assert listing() == before
    with tpde.Checkpointer(run) as writer:  # training goes on appending to the same run
        writer.load(2)
        writer.save(3, drift(tpde.load_state_dict(run, 2), 9))
    with torch.no_grad():
        assert torch.equal(model(**BATCH), first)
    assert {p: h for p, h in listing().items() if p in before} == before
    with tpde.Checkpointer(run) as writer:  # leave the module's chain as it was
        writer.remove(3)


@pytest.mark.s3
@pytest.mark.slow
def test_mount_from_s3_by_range_reads(s3_server, encoder_chain) -> None:
    """A run on S3 mounted at budget 0 range-reads what each forward decodes; where torch
    leaves a CPU free, the worker's reads and the forward's thread's go side by side."""
    run, folder = encoder_chain
    options = s3_server["options"]
    url = "s3://tpde/mounted-encoder"
    assert cli(["export", run, "--step", "2", "--to", url, "-q",
                *[f"-o{k}={v}" for k, v in {"key": "testing", "secret": "testing",
                  "client_kwargs.endpoint_url": options["client_kwargs"]["endpoint_url"],
                  "skip_instance_cache": "true"}.items()]]) == 0
    model = tpde.mount(url, None, fresh_encoder(), device="cpu", budget=0, resident="store",
                       storage_options=options)
    assert model.tpde_mount.step == 2 and model.tpde_mount.chain.manifest(2).keyframe
    with torch.no_grad():
        assert torch.equal(model(**BATCH), dense(folder, 2)(**BATCH))
    if usable_cpus() > 1:
        with torch_threads(usable_cpus() - 1), torch.no_grad():
            expected = dense(folder, 2)(**BATCH)  # summed on as many threads
            for _ in range(2):
                assert torch.equal(model(**BATCH), expected)
        assert model.tpde_mount.stats.decoded_ahead > 0


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
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert_same(dict(tpde.load_state_dict(run, model=fresh)), dict(net.state_dict()))
    assert_same(dict(fresh.state_dict()), dict(net.state_dict()))  # loaded into the model
    other = torch.nn.Linear(3, 3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(tpde.TPDEError, match="no stored tensor"):
        tpde.load_state_dict(run, model=other)
    assert_same(dict(other.state_dict()), before)
    with pytest.raises(tpde.TPDEError, match="no stored tensor"):
        tpde.mount(run, model=torch.nn.Linear(3, 3), device="cpu")
    for bad, match in [({"budget": -1}, "budget"), ({"budget": 1.5}, "budget"),
                       ({"prefetch": -1}, "prefetch"), ({"prefetch": True}, "prefetch"),
                       ({"resident": "disk"}, "resident"), ({"decoder": "gpu"}, "decoder")]:
        with pytest.raises(ValueError, match=match):
            tpde.mount(run, model=skeleton, device="cpu", **bad)
    with torch.no_grad():  # the model is as it was
        assert torch.equal(model(x), net(x))


@pytest.mark.parametrize("budget", [None, 0])
def test_a_mounted_model_moved_to_bf16_computes_as_the_dense_one_in_bf16(encoder_chain,
                                                                         budget) -> None:
    run, folder = encoder_chain
    reference = dense(folder, 2).to(torch.bfloat16)
    model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=budget)
    with torch.no_grad():
        model(**BATCH)  # weights decoded (and held at budget None) before the move
        assert model.to(torch.bfloat16) is model
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.position_ids.dtype == torch.int64  # what .to(dtype) leaves alone
        out = model(**BATCH)
        assert out.dtype == torch.bfloat16 and torch.equal(out, reference(**BATCH))
        assert torch.equal(model.float()(**BATCH), dense(folder, 2)(**BATCH))
    model.tpde_mount.close()


@pytest.mark.parametrize("budget", [None, 0])
def test_a_write_into_mounted_weights_is_refused_at_the_next_forward(encoder_chain,
                                                                      budget) -> None:
    run, folder = encoder_chain
    model = tpde.mount(run, 1, fresh_encoder, device="cpu", budget=budget)
    with torch.no_grad():
        expected = model(**BATCH)
        model.blocks[1]["up"].weight.mul_(2)  # held at budget None, a placeholder at 0
        with pytest.raises(tpde.TPDEError, match=r"read-only.*'blocks\.1\.up\.weight'.*"
                                                 r"load_state_dict") as err:
            model(**BATCH)
    assert err.value.step == 1
    again = tpde.mount(run, 1, fresh_encoder, device="cpu", budget=budget)
    with torch.no_grad():
        again(**BATCH)
        with pytest.raises(tpde.TPDEError, match="read-only: load_state_dict"):
            again.load_state_dict(dense(folder, 0).state_dict())  # would copy into them
        assert torch.equal(again(**BATCH), expected)  # nothing was written


@pytest.mark.parametrize("budget", [None, 0])
def test_state_dict_of_a_mount_holds_the_weights_at_any_budget(encoder_chain, budget) -> None:
    run, folder = encoder_chain
    reference = dense(folder, 2)
    model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=budget)
    for _ in range(2):  # before any forward, and after one
        state = model.state_dict()
        assert state.keys() == reference.state_dict().keys()
        # (packed small tensors view one storage in a mount: equal values are the contract)
        assert all(torch.equal(v, reference.state_dict()[k]) for k, v in state.items())
        block = model.blocks[0].state_dict()
        assert all(torch.equal(v, reference.blocks[0].state_dict()[k]) for k, v in block.items())
        with torch.no_grad():
            assert torch.equal(model(**BATCH), reference(**BATCH))
    held = {p.device.type for p in model.parameters()}
    assert held == ({"meta"} if budget == 0 else {"cpu"})  # state_dict() held nothing back
    model.tpde_mount.close()


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
    assert_same(exported.load(3), {"w": w, "note": {"step": 3}})  # what was saved


@pytest.mark.parametrize("resident,z,native", [("host", True, True), ("store", True, True),
                                                ("host", True, False), ("store", True, False),
                                                ("store", False, False)],
                         ids=["host", "store", "host-python", "store-python",
                              "store-zstandard"])
def test_damaged_chain_never_gives_a_wrong_output(tmp_path, resident: str, z: bool,
                                                   native: bool, monkeypatch) -> None:
    """Damage anywhere in a run is an error or harmless to a mount at budget 0, its modules
    rebuilt natively or through the Python path, whose small records' frames are decompressed
    by ``tpde.codec._zframes`` or, without it, by zstandard."""
    import random
    from campaigns.corrupt import damage

    zstd_path(monkeypatch, z)
    native_path(monkeypatch, native)

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


class CausalLM(torch.nn.Module):
    """A small language model on nn.TransformerEncoder, as people write them."""

    def __init__(self, vocab: int = 512, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


def test_a_mounted_transformer_computes_as_the_dense_one_fast_path_included(tmp_path) -> None:
    torch.manual_seed(0)
    dense = CausalLM().eval()
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ckpt:
        ckpt.save(0, dense.state_dict())
    ids = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = dense(ids)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = dense(ids)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert not torch.equal(slow, expected)  # the fused path computes differently: it matters
    for budget in (None, 0):
        model = tpde.mount(run, 0, CausalLM(), device="cpu", budget=budget)
        with torch.no_grad():
            assert torch.equal(model(ids), expected)
            assert torch.equal(model(ids), expected)  # again, from what the first pass left
        model.tpde_mount.close()


def test_decode_seconds_count_the_decodes_and_nothing_else(tmp_path) -> None:
    """``MountStats.decode_seconds`` is what mount_bench divides the decoded bytes by, the time
    forwards spent getting their weights: it grows with every forward that decodes, not with
    forwards that decode nothing, and stays within the forwards' wall time."""
    torch.manual_seed(0)
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run) as ckpt:
        ckpt.save(0, CausalLM().state_dict())
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(2))
    # No prefetching: each decode is one the forward waits for, on its own thread.
    kept = tpde.mount(run, 0, CausalLM(), device="cpu", budget=None, prefetch=0)
    with torch.no_grad():
        kept(ids)
        once = kept.tpde_mount.stats.decode_seconds
        kept(ids)
    assert once > 0
    assert kept.tpde_mount.stats.decode_seconds == once  # nothing decoded the second time
    kept.tpde_mount.close()
    none = tpde.mount(run, 0, CausalLM(), device="cpu", budget=0)
    stats = none.tpde_mount.stats
    started, before = time.perf_counter(), 0.0
    with torch.no_grad():
        for calls in (1, 2, 3):
            none(ids)
            assert stats.decodes == calls * stats.modules
            assert before < stats.decode_seconds <= time.perf_counter() - started
            before = stats.decode_seconds
    none.tpde_mount.close()


def test_a_pack_is_decoded_once_a_forward(encoder_chain, monkeypatch) -> None:
    """The encoder's biases and norms are packs (``tree.pack``) that most of its modules view:
    at budget 0 each forward decodes them once, for all of those modules, and lets go of them
    when it ends."""
    run, folder = encoder_chain
    with torch.no_grad():
        expected = dense(folder, 2)(**BATCH)
    packs = {r.name for r in Chain(run).manifest(2).records if r.parts}
    assert packs
    asked: list[set[str]] = []
    materialize = Reader.materialize

    def observed(self, step, names=None, **kwargs):
        asked.append(set(names) & packs)
        return materialize(self, step, names, **kwargs)

    monkeypatch.setattr(Reader, "materialize", observed)
    model = tpde.mount(run, 2, fresh_encoder, device="cpu", budget=0, prefetch=0)
    with torch.no_grad():
        for forward in range(1, 3):
            assert torch.equal(model(**BATCH), expected)
            assert [p for p in asked if p] == [packs] * forward  # again: not kept
    model.tpde_mount.close()


def _open_files() -> set[str]:
    """The files this process holds open (its descriptors' targets)."""
    fds = "/proc/self/fd"
    out = set()
    for fd in os.listdir(fds):
        try:
            out.add(os.readlink(os.path.join(fds, fd)))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return out


def _large_net() -> torch.nn.Module:
    """A weight of twice ``unframe.FRAMED_SPREAD_BYTES`` and more (21 MB) and a small one."""
    return torch.nn.Sequential(torch.nn.Linear(2304, 2304), torch.nn.GELU(),
                               torch.nn.Linear(2304, 16)).eval()


def _large_chain(run: str, storage_options: dict | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Three steps of ``_large_net``'s weights (a keyframe, then two ``drift`` deltas) saved to
    ``run``: an input, and the dense model's output on it at each step."""
    torch.manual_seed(0)
    model = _large_net()
    x = torch.randn(3, 2304, generator=torch.Generator().manual_seed(1))
    expected = {}
    state = dict(model.state_dict())
    with tpde.Checkpointer(run, storage_options=storage_options) as ckpt:
        for step in range(3):
            ckpt.save(step, state)
            model.load_state_dict(state)
            with torch.no_grad():
                expected[step] = model(x)
            state = drift(state, step)
    return x, expected


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@NATIVE
def test_a_large_module_at_budget_zero_is_decoded_on_the_frame_threads(tmp_path, native: bool,
                                                                        monkeypatch) -> None:
    """A weight of twice ``unframe.FRAMED_SPREAD_BYTES`` and more is decoded at budget 0 a range
    at a time, natively or in runs of slices on the frame threads, each reading its frames from
    the store by range: the output is the dense model's at its keyframe and two deltas deep, no
    file of the run stays open after a forward, and a damaged frame of that weight is refused,
    naming it."""
    from tpde.codec import unframe
    native_path(monkeypatch, native)
    assert 2304 * 2304 * 4 >= 2 * unframe.FRAMED_SPREAD_BYTES
    run = str(tmp_path / "run")
    x, expected = _large_chain(run)
    before = _open_files()
    for step in (0, 2):
        mounted = tpde.mount(run, step, _large_net(), device="cpu", budget=0)
        with torch.no_grad():
            got = mounted(x)
        assert torch.equal(got, expected[step]), step
        assert mounted.tpde_mount.stats.decodes == mounted.tpde_mount.stats.modules
        assert {f for f in _open_files() - before if f.startswith(run)} == set()
        mounted.tpde_mount.close()

    m = Chain(run).manifest(2)
    s = m.record("0.weight").sections["values"]
    flip_bit(run, m, m.record("0.weight"), at=s.length - s.frames[-1] - 100)  # a last frame
    mounted = tpde.mount(run, 2, _large_net(), device="cpu", budget=0)
    with pytest.raises(tpde.CorruptionError, match=r"0\.weight"), torch.no_grad():
        mounted(x)


def test_a_large_module_at_budget_zero_reads_its_frames_from_s3_on_two_threads(s3_server
                                                                            ) -> None:
    """The frame threads that share a large record out range-read its frames from S3 side by
    side (``resident="store"``): the output is the dense model's, two deltas deep."""
    options = s3_server["options"]
    run = "s3://tpde/large-module"
    x, expected = _large_chain(run, options)
    mounted = tpde.mount(run, 2, _large_net(), device="cpu", budget=0, resident="store",
                         storage_options=options)
    with torch.no_grad():
        assert torch.equal(mounted(x), expected[2])
