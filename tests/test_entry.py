"""Checkpoint entries: the roots of a chain, read once and re-read whenever rewritten."""

from __future__ import annotations

import pytest
import torch

import tpde
from tpde.entries import checkpoint_folder, entry
from tpde.store.store import Store


@pytest.mark.parametrize("where", ["local", "s3"])
def test_roots_follow_a_rewritten_entry(where: str, tmp_path, request) -> None:
    if where == "local":
        folder, options = str(tmp_path), None
    else:
        folder, options = "s3://tpde/entry-roots", request.getfixturevalue("s3_server")["options"]
    url = f"{folder}/{entry.CHAIN_DIR}"
    with tpde.Checkpointer(url, storage_options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((8,), float(step))})
    chain = ckpt.chain

    def point(step: int) -> None:
        data = entry.to_bytes(entry.CheckpointEntry(run=entry.CHAIN_DIR, run_url=url, step=step,
                                                    blob=chain.manifest(step).blob))
        Store(folder, options).put_atomic("last.ckpt", data)

    seen: checkpoint_folder.Seen = {}

    def named() -> dict[str, tuple[int, str]]:
        return {n: (e.step, e.blob) for n, e in checkpoint_folder.listing(folder, chain, options, seen).items()}

    point(1)
    assert named() == {"last.ckpt": (1, chain.manifest(1).blob)}
    point(2)  # the same size, rewritten at once: the cache must not answer for it
    assert named() == {"last.ckpt": (2, chain.manifest(2).blob)}
    assert checkpoint_folder.orphans(chain, folder, options, seen) == [1]
    assert torch.equal(entry.load_checkpoint(f"{folder}/last.ckpt", storage_options=options)["w"],
                       torch.full((8,), 2.0))


def test_a_pending_entry_reads_as_the_entry_it_replaced_or_as_not_yet_saved(tmp_path) -> None:
    """Another process sees what the path held before a save that has not committed."""
    run = str(tmp_path / ".tpde")
    with tpde.Checkpointer(run) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        blob = ckpt.chain.manifest(1).id
    before = entry.CheckpointEntry(run=".tpde", run_url=run, step=1, blob=blob)
    path = tmp_path / "last.ckpt"
    for previous in (before, None):
        pending = entry.PendingEntry(run=".tpde", run_url=run, writer="elsewhere:1",
                                     token="t", previous=previous)
        path.write_bytes(entry.to_bytes(pending))
        assert entry.read_any(str(path)) == pending
        if previous is None:
            with pytest.raises(tpde.StepPendingError, match="still being saved"):
                entry.read(str(path))
            with pytest.raises(tpde.StepPendingError, match="had not committed"):
                torch.load(str(path), weights_only=False)
        else:
            assert entry.read(str(path)) == before
            assert torch.equal(torch.load(str(path), weights_only=False)["w"], torch.ones(4))
            assert torch.equal(tpde.load_checkpoint(str(path))["w"], torch.ones(4))
