"""Damage never turns into deletion: a damaged checkpoint entry is listed as damaged, keeps the
step it names through ``gc`` and the plugin's own collection, and ``tpde repair`` writes it again.
The CLI runs as a real subprocess on a folder written by the real Lightning plugin."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import tpde
from forked import run_module
from tpde.entries import checkpoint_folder, entry

pytest.importorskip("lightning", reason="needs Lightning: pip install 'tpde[dev]'")


def tpde_cli(*argv: str) -> subprocess.CompletedProcess:
    """``python -m tpde.cli ARGV...``, forked from a server that imported tpde once."""
    return run_module("tpde.cli", *argv)


def state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"state_dict": {"w": torch.randn(64, 64, generator=g)}, "epoch": i,
            "global_step": 10 * i}


@pytest.fixture()
def folder(tmp_path) -> str:
    """Four checkpoints as ModelCheckpoint names them, and ``last.ckpt`` naming the latest."""
    out = tmp_path / "ckpts"
    plugin = tpde.TPDECheckpointIO()
    for i in range(4):
        plugin.save_checkpoint(state(i), str(out / f"epoch={i}.ckpt"))
    plugin.save_checkpoint(state(3), str(out / "last.ckpt"))
    plugin.teardown()
    return str(out)


def flip_in_json(path: str) -> None:
    """One byte changed inside the entry's JSON member: its CRC no longer matches."""
    data = bytearray(open(path, "rb").read())
    at = data.index(b'"tpde-entry"') + 3
    data[at] ^= 0x20
    open(path, "wb").write(bytes(data))


def cut(path: str, size: int) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:size])


def steps_of(folder: str) -> dict[str, int]:
    chain = tpde.Checkpointer(f"{folder}/{entry.CHAIN_DIR}").chain
    return {n: e.step for n, e in checkpoint_folder.listing(folder, chain).items()}


def test_damaged_entries_are_listed_kept_through_gc_and_repaired(folder) -> None:
    named = steps_of(folder)
    cut(f"{folder}/last.ckpt", os.path.getsize(f"{folder}/last.ckpt") // 2)
    flip_in_json(f"{folder}/epoch=1.ckpt")

    listed = tpde_cli("ls", folder, "--json")
    assert listed.returncode == 1
    rows = {e["name"]: e for e in json.loads(listed.stdout)["entries"]}
    assert set(rows) == set(named)
    for name in ("last.ckpt", "epoch=1.ckpt"):
        assert rows[name]["state"] == "damaged" and rows[name]["steps"] == [named[name]]
    assert rows["epoch=2.ckpt"]["state"] == "ok"
    assert "tpde repair" in tpde_cli("ls", folder).stdout

    gc = tpde_cli("gc", folder, "--grace", "0", "--json")
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert report["hidden_steps"] == [] and report["purged_steps"] == []
    for name in ("last.ckpt", "epoch=1.ckpt"):  # what the damaged files named restores
        out = f"{folder}/../{name}.pt"
        assert tpde_cli("restore", folder, "--step", str(named[name]), "--output",
                        out).returncode == 0
        assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["w"],
                           state(3 if name == "last.ckpt" else 1)["state_dict"]["w"])

    with pytest.raises(tpde.FormatError, match=r"tpde repair .*ckpts"):
        tpde.load_checkpoint(f"{folder}/epoch=1.ckpt")
    repaired = tpde_cli("repair", folder, "--json")
    assert repaired.returncode == 0, repaired.stderr
    assert json.loads(repaired.stdout) == {
        "repaired": {"epoch=1.ckpt": named["epoch=1.ckpt"], "last.ckpt": named["last.ckpt"]},
        "unresolved": {}}
    assert steps_of(folder) == named
    loaded = torch.load(f"{folder}/epoch=1.ckpt", weights_only=False)
    assert torch.equal(loaded["state_dict"]["w"], state(1)["state_dict"]["w"])


def test_an_entry_that_names_nothing_found_keeps_every_step(folder) -> None:
    named = steps_of(folder)
    cut(f"{folder}/epoch=2.ckpt", 2)  # "PK": nothing of it tells which step it named
    listed = json.loads(tpde_cli("ls", folder, "--json").stdout)
    row = next(e for e in listed["entries"] if e["name"] == "epoch=2.ckpt")
    assert row["state"] == "damaged" and row["steps"] == [] and row["step"] is None
    os.remove(f"{folder}/epoch=0.ckpt")  # its step is named by nothing now...
    gc = json.loads(tpde_cli("gc", folder, "--grace", "0", "--json").stdout)
    assert gc["hidden_steps"] == []  # ...but the damaged file might have named it

    left = tpde_cli("repair", folder)
    assert left.returncode == 1 and "--entry epoch=2.ckpt --step N" in left.stderr
    assert tpde_cli("repair", folder, "--step", "3").returncode == 1  # --step needs --entry
    fixed = tpde_cli("repair", folder, "--entry", "epoch=2.ckpt", "--step",
                     str(named["epoch=2.ckpt"]))
    assert fixed.returncode == 0, fixed.stderr
    gc = json.loads(tpde_cli("gc", folder, "--grace", "0", "--json").stdout)
    assert gc["hidden_steps"] == [named["epoch=0.ckpt"]]
    assert torch.equal(tpde.load_checkpoint(f"{folder}/epoch=2.ckpt")["state_dict"]["w"],
                       state(2)["state_dict"]["w"])


def test_the_plugin_does_not_free_what_a_damaged_entry_names(folder) -> None:
    named = steps_of(folder)
    flip_in_json(f"{folder}/epoch=1.ckpt")
    plugin = tpde.TPDECheckpointIO()
    plugin.remove_checkpoint(f"{folder}/epoch=0.ckpt")
    plugin.save_checkpoint(state(4), f"{folder}/last.ckpt")  # replaces what last.ckpt named
    plugin.teardown()
    chain = tpde.Checkpointer(f"{folder}/{entry.CHAIN_DIR}").chain
    assert named["epoch=1.ckpt"] in chain.steps()
    assert named["epoch=0.ckpt"] not in chain.steps()  # the undamaged removal still frees


def test_random_damage_to_a_folder_never_frees_a_named_step() -> None:
    """The quick version of ``campaigns/corrupt_entries.py``: it checks each trial itself."""
    from campaigns.corrupt_entries import campaign

    stats = campaign(trials=15, seed=1)
    # Which damage a trial meets depends on the blobs' random names, so these only check that
    # the campaign reached each kind of damage and the repair at all.
    assert stats["flip"] + stats["truncate"] > 10 and stats["repaired"] >= 2
