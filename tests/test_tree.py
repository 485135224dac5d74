"""The state tree: any nesting of plain values and tensors round-trips through JSON exactly."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_same
from tpde.errors import FormatError
from tpde.state import tree

BASE = torch.arange(64, dtype=torch.float32)


def tensors() -> st.SearchStrategy:
    fresh = st.builds(lambda n, seed: torch.randn(n, generator=torch.Generator().manual_seed(seed)),
                      st.integers(0, 20), st.integers(0, 100))
    views = st.builds(lambda a, b: BASE[a : max(a, b)], st.integers(0, 64), st.integers(0, 64))
    return st.one_of(fresh, views, st.just(BASE.reshape(8, 8).t()), st.just(torch.tensor(2.5)))


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True), st.binary(max_size=8),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8]), tensors(),
)
keys = st.one_of(st.text(max_size=5), st.integers(-3, 3), st.just("$t"), st.just("a/b"))
states = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=4).map(OrderedDict),
    ),
    max_leaves=12,
)


@given(states)
def test_any_state_round_trips_through_json(state) -> None:
    flat = tree.flatten(state)
    skeleton = json.loads(json.dumps(flat.skeleton))
    spans = [s.tensor.clone() for s in flat.spans]
    out = tree.unflatten(skeleton, spans)
    assert_same(state, out)
    assert len({s.name for s in flat.spans}) == len(flat.spans)


def test_views_of_one_storage_become_one_span_and_stay_views() -> None:
    state = {"a": BASE[2:10], "b": BASE[5:20], "c": BASE.reshape(8, 8)[:, 1]}
    flat = tree.flatten(state)
    assert len(flat.spans) == 1 and flat.spans[0].tensor.numel() == 57  # offsets 1..57
    out = tree.unflatten(json.loads(json.dumps(flat.skeleton)), [flat.spans[0].tensor.clone()])
    out["a"][3] = -1.0
    assert out["b"][0] == -1.0  # still sharing memory, as with torch.save


@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), data=st.data())
def test_a_tensor_s_extent_is_the_storage_it_touches(shape: list[int], data) -> None:
    """Contiguous or not (transposed, sliced, broadcast): from the first element to one past
    the last one it reads."""
    t = torch.arange(200, dtype=torch.float32)[data.draw(st.integers(0, 10)):]
    t = t[: int(torch.tensor(shape).prod())].reshape(shape) if shape else t[0]
    if t.dim() >= 2 and data.draw(st.booleans()):
        t = t.transpose(0, 1)
    if t.dim() >= 1 and t.shape[0] > 1 and data.draw(st.booleans()):
        t = t[:: data.draw(st.integers(1, 2))]
    if t.dim() >= 1 and data.draw(st.booleans()):
        t = t.unsqueeze(0).expand(3, *t.shape)
    if not t.numel():
        assert tree._extent(t) == (t.storage_offset(), t.storage_offset())
        return
    # Each element's storage index, from the strides: the first and last one touched.
    index = t.storage_offset() + sum(
        torch.arange(n).reshape([-1 if d == i else 1 for d in range(t.dim())]) * s
        for i, (n, s) in enumerate(zip(t.shape, t.stride()))) if t.dim() else \
        torch.tensor(t.storage_offset())
    assert tree._extent(t) == (int(index.min()), int(index.max()) + 1)


@given(states, st.integers(1, 600))
def test_packed_spans_come_back_as_the_storages_they_were(state, most: int) -> None:
    """Small spans joined into packs (``tree.pack``) come back as the tensors they were: each
    storage its own again, views of one storage still sharing it, Parameters as they were."""
    flat = tree.pack(tree.flatten(state), 4096, most)
    skeleton = json.loads(json.dumps(flat.skeleton))
    out = tree.unflatten(skeleton, [s.tensor.clone() for s in flat.spans])
    assert_same(state, out)
    assert len({s.name for s in flat.spans}) == len(flat.spans)
    packs = [s for s in flat.spans if s.parts]
    assert all(s.parts >= 2 and s.tensor.numel() * s.tensor.element_size() <= most
               for s in packs)


def test_packs_join_small_spans_by_top_level_key_and_dtype_and_leave_the_rest() -> None:
    big = torch.zeros(2048)  # 8 KiB: a span of its own
    biases = [torch.full((k + 1,), float(k)) for k in range(5)]
    state = {"big": big, "biases": biases, "half": [torch.ones(3, dtype=torch.float16)] * 2,
             "alone": torch.ones(2, dtype=torch.int64), "kept": torch.ones(4)}
    flat = tree.pack(tree.flatten(state), 4096, 1 << 20, apart=lambda n: n == "kept")
    assert [(s.name, s.parts) for s in flat.spans] == [
        ("big", 0), ("half/0", 0), ("alone", 0), ("kept", 0), ("biases/<pack float32>", 5)]
    assert torch.equal(flat.spans[-1].tensor, torch.cat(biases))
    out = tree.unflatten(flat.skeleton, [s.tensor for s in flat.spans])
    assert_same(state, out)
    out["biases"][1][0] = -1.0  # a storage of its own, not a view of the pack
    assert flat.spans[-1].tensor[1] == 1.0 and out["biases"][2][0] == 2.0
    again = tree.pack(flat, 4096, 1 << 20)
    assert [s.name for s in again.spans] == [s.name for s in flat.spans]


def test_a_part_outside_its_pack_is_refused() -> None:
    flat = tree.pack(tree.flatten([torch.ones(3), torch.ones(4)]), 4096, 1 << 20)
    node = flat.skeleton[1]
    for part in ([5, 4], [-1, 2], [0, 8], "0:4", [0]):
        with pytest.raises(FormatError, match="part"):
            tree.unflatten([{**node, "part": part}], [flat.spans[0].tensor])
