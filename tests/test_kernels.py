"""Triton kernels against their CPU references (on a GPU when there is one, else interpreted)."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton", reason="needs Triton (tpde[dev] installs it on Linux x86_64)")

from helpers import mixed_codec_chain  # noqa: E402
from tpde.codec import elias, transform  # noqa: E402
from tpde.errors import FormatError  # noqa: E402
from tpde.kernels import triton_kernels as tk  # noqa: E402

if not torch.cuda.is_available() and type(tk._unshuffle_kernel).__name__ != "InterpretedFunction":
    # Triton picks the interpreter when a kernel is decorated: decorate them again under
    # TRITON_INTERPRET=1 to run them on CPU tensors, then leave the environment as it was.
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.reload(tk)
    finally:
        if _before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = _before

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WORDS = {torch.int8: "int", torch.int16: "float", torch.int32: "float", torch.int64: "float"}


def words(draw: st.DrawFn, dtype: torch.dtype, n: int) -> torch.Tensor:
    info = torch.iinfo(dtype)
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, (n,), dtype=torch.int64, generator=g).to(dtype)


@st.composite
def word_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, str]:
    dtype = draw(st.sampled_from(list(WORDS)))
    n = draw(st.integers(0, 3000))
    new = words(draw, dtype, n)
    ref = new.clone()
    if n:  # a few changed words, like a training delta
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        changed = torch.randint(0, n, (max(1, n // 10),), generator=g)
        ref[changed] = words(draw, dtype, changed.numel())
    kind = draw(st.sampled_from(["float", "int"])) if dtype != torch.int8 else "int"
    return new, ref, kind


@given(word_pairs(), st.sampled_from(["xor", "sub"]))
def test_dense_residual_kernel_matches_cpu(pair, how: str) -> None:
    new, ref, kind = pair
    r = transform.residual(new, ref, how, kind)
    expected = transform.apply_residual(ref, r, how, kind)
    got = tk.apply_residual_(ref.clone().to(DEVICE), r.to(DEVICE), how, kind)
    assert torch.equal(got.cpu(), expected) and torch.equal(expected, new)


@given(word_pairs())
def test_sparse_xor_kernel_matches_cpu(pair) -> None:
    new, ref, _ = pair
    pos = torch.nonzero(new != ref).reshape(-1)
    r = new[pos] ^ ref[pos]
    got = tk.apply_sparse_xor_(ref.clone().to(DEVICE), pos.to(DEVICE), r.to(DEVICE))
    assert torch.equal(got.cpu(), new)


@given(st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64]),
       st.integers(0, 5000), st.integers(0, 2**31))
def test_unshuffle_kernel_matches_cpu(dtype: torch.dtype, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-100, 100, (n,), dtype=torch.int64, generator=g).to(dtype)
    planes = transform.shuffle(w)
    assert torch.equal(tk.unshuffle(planes.to(DEVICE), dtype).cpu(),
                       transform.unshuffle(planes, dtype))


@given(st.lists(st.integers(0, 2**40), max_size=700, unique=True), st.sampled_from([1, 7, 256]))
def test_elias_kernel_matches_cpu_decoder(values: list[int], block: int) -> None:
    positions = np.array(sorted(values), dtype=np.int64)
    stream = elias.encode(positions, block)
    got = tk.decode_positions(stream, DEVICE)
    assert np.array_equal(got.cpu().numpy(), elias.decode(stream))
    assert np.array_equal(got.cpu().numpy(), positions)


def test_elias_kernel_refuses_damaged_streams() -> None:
    stream = bytearray(elias.encode(np.arange(0, 3000, 3, dtype=np.int64), 256))
    stream[-5] ^= 0xFF  # inside the codes of the last block
    with pytest.raises(FormatError):
        tk.decode_positions(bytes(stream), DEVICE)
    with pytest.raises(FormatError):
        tk.decode_positions(bytes(stream[:-1]), DEVICE)


@pytest.mark.parametrize("inflight", [256 << 20, 1 << 20], ids=["whole", "pieces"])
def test_chain_rebuilt_by_the_kernels_equals_the_cpu_rebuild(tmp_path, inflight: int) -> None:
    import tpde

    run = str(tmp_path / "run")
    mixed_codec_chain(run, inflight)
    chain = tpde.Checkpointer(run).chain
    records = [r for s in range(5) for r in chain.manifest(s).records]
    assert {"key", "sparse", "dense", "same"} <= {r.codec for r in records}
    assert any(r.start for r in records) == (inflight < 5 << 20)
    # The last step's rebuild decodes every record of every step before it (each tensor's
    # lineage from its keyframe) through the kernels, the words after each record checked
    # against its hash (``check_every``); the last step's are compared with the CPU's here.
    cpu = chain.materialize(4)
    kernels = chain.materialize(4, on=DEVICE, check_every=True)
    assert cpu.keys() == kernels.keys()
    for name in cpu:
        assert torch.equal(kernels[name].cpu(), cpu[name]), name


def test_mount_with_the_kernel_decoder(tmp_path) -> None:
    import tpde

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    run = str(tmp_path / "run")
    with tpde.Checkpointer(run, max_inflight_bytes=1024) as ckpt:  # weights in 512-byte pieces
        for step in range(3):
            with torch.no_grad():
                net[0].weight[step] += 0.5
            ckpt.save(step, net.state_dict())
    x = torch.randn(3, 32)
    mounted = tpde.mount(run, 2, torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                                     torch.nn.Linear(32, 4)),
                         device=DEVICE, budget=0, decoder="kernels", prefetch=0)
    with torch.no_grad():  # the same device: a GPU's matmul rounds unlike the CPU's
        assert torch.equal(mounted(x.to(DEVICE)), net.to(DEVICE)(x.to(DEVICE)))
