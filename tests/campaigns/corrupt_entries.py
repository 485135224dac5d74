"""Damage the checkpoint files of a Lightning folder at random and check that no damage turns into
deletion.

The folder is written by the real ``TPDECheckpointIO``: five checkpoints as ``ModelCheckpoint``
names them and ``last.ckpt``. Per trial one or two of its files are bit-flipped, truncated or
deleted. Then ``tpde gc`` runs on the folder, and:

- every step that an undamaged file names, and every step that a damaged (not deleted) file
  named, still restores bit-exactly: ``gc`` freed none of them;
- ``tpde ls`` lists each damaged file as damaged (or it still reads: harmless);
- ``tpde repair`` writes each damaged file again where what is left names its step, and the
  repaired file loads as the checkpoint it was; the others are reported, not guessed.

    python tests/campaigns/corrupt_entries.py [--trials 500] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import tpde  # noqa: E402
from campaigns.corrupt import damage  # noqa: E402
from helpers import assert_same  # noqa: E402
from tpde.cli import main as cli  # noqa: E402
from tpde.entries import checkpoint_folder, entry  # noqa: E402

NAMES = [f"epoch={i}-step={10 * i}.ckpt" for i in range(5)] + ["last.ckpt"]


def state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"state_dict": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "epoch": i, "global_step": 10 * i}


def folder(root: str) -> dict[str, int]:
    """The folder every trial starts from; returns the step each file names."""
    plugin = tpde.TPDECheckpointIO()
    for i, name in enumerate(NAMES):
        plugin.save_checkpoint(state(min(i, 4)), os.path.join(root, name))
    plugin.teardown()
    chain = tpde.Checkpointer(os.path.join(root, entry.CHAIN_DIR)).chain
    return {n: e.step for n, e in checkpoint_folder.listing(root, chain).items()}


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli(list(argv))
    return code, out.getvalue()


def trial(base: str, work: str, named: dict[str, int], rng: random.Random, stats: Counter) -> None:
    shutil.copytree(base, work)
    hit = rng.sample(NAMES, rng.choice([1, 2]))
    how = {name: damage(os.path.join(work, name), rng) for name in hit}
    stats.update(how.values())
    code, _ = run("gc", work, "--grace", "0", "--json", "-q")
    assert code == 0
    chain = tpde.Checkpointer(os.path.join(work, entry.CHAIN_DIR)).chain
    kept = [named[n] for n in NAMES if how.get(n) != "delete"]
    for step in kept:  # gc freed nothing a file names or may have named
        step_state = chain.load(step)[0]
        assert_same(step_state, state(step_state["epoch"]))
    _, out = run("ls", work, "--json", "-q")
    rows = {e["name"]: e for e in json.loads(out)["entries"]}
    broken = {n for n, r in rows.items() if r["state"] == "damaged"}
    assert broken <= {n for n, h in how.items() if h != "delete"}
    stats["harmless"] += len([n for n, h in how.items() if h != "delete" and n not in broken])
    code, out = run("repair", work, "--json", "-q")
    report = json.loads(out)
    assert set(report["repaired"]) | set(report["unresolved"]) == broken
    for name, step in report["repaired"].items():
        assert step == named[name]
        loaded = torch.load(os.path.join(work, name), weights_only=False)
        assert_same(loaded, state(loaded["epoch"]))
    stats["repaired"] += len(report["repaired"])
    stats["unresolved"] += len(report["unresolved"])
    shutil.rmtree(work)


def campaign(trials: int, seed: int = 0) -> Counter:
    rng = random.Random(seed)
    stats: Counter = Counter()
    root = tempfile.mkdtemp()
    try:
        base = os.path.join(root, "base")
        named = folder(base)
        assert sorted(named) == sorted(NAMES)
        for i in range(trials):
            trial(base, os.path.join(root, f"t{i}"), named, rng, stats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    stats = campaign(args.trials, args.seed)
    print(f"{args.trials} trials ({stats['flip']} flips, {stats['truncate']} truncations, "
          f"{stats['delete']} deletions): no step a file named was freed; damaged files "
          f"{stats['repaired']} repaired, {stats['unresolved']} reported without a step, "
          f"{stats['harmless']} still readable")


if __name__ == "__main__":
    main()
