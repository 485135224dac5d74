"""Kill a Hugging Face ``Trainer`` that checkpoints through ``tpde.hf.attach`` at its store
operations in turn, then resume it.

The killed run saves every 4 steps with ``save_total_limit=2``, in the background, so kills fall
inside saves, entry writes and the removals of rotated steps. After every SIGKILL:

- every checkpoint folder whose entry committed loads bit-exactly as the step it names, and
  ``tpde verify`` passes on the output folder;
- ``train(resume_from_checkpoint=True)`` resumes from the newest of them (from scratch where
  none committed), and the run ends bit-identical to the stock ``Trainer`` resumed from the
  same checkpoint of an uninterrupted run (one never interrupted, where none committed):
  weights, optimizer, scheduler, step and random state.

    python tests/campaigns/hf_crash.py [--points 12]     # prints the kill points tried
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

COUNT = "operations.txt"  # a finished child's count of store operations


def child(folder: str, kill_at: int) -> None:
    """Train from scratch with the kill armed at the ``kill_at``-th store operation (0: none;
    the count is written to ``COUNT``)."""
    from campaigns.crash import arm
    from hf_runs import build

    count = arm(kill_at)
    build(folder, attach={}).train()
    with open(os.path.join(folder, COUNT), "w") as f:
        f.write(str(count[0]))
    os._exit(0)


def _spawn(folder: str, kill_at: int) -> int:
    from forked import Forked

    worker = Forked(os.path.abspath(__file__), ["--child", folder, str(kill_at)],
                    dict(os.environ))
    out, err = worker.communicate(timeout=600)
    if worker.returncode not in (0, -9):
        raise AssertionError(f"the run at kill point {kill_at} failed:\n{out}\n{err}")
    return int(worker.returncode)


def committed(folder: str) -> list[str]:
    """The checkpoint folders whose entry committed."""
    from tpde.entries import entry

    names = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name, entry.FOLDER_ENTRY)
        if name.startswith("checkpoint-") and os.path.isfile(path) \
                and isinstance(entry.read_any(path), entry.CheckpointEntry):
            names.append(name)
    return names


def check(folder: str, reference: str, resumed: dict[str | None, dict[str, Any]]) -> bool:
    """The checks after one kill, against the stock run in ``reference`` (every checkpoint
    kept) and how it ends resumed from each of its checkpoints (``resumed``, filled as
    needed; None: trained from scratch); whether a committed checkpoint was there."""
    import torch
    from safetensors.torch import load_file

    from helpers import difference
    from hf_runs import build, outcome
    from tpde.entries import entry

    for name in committed(folder):
        chain, step, _ = entry.resolve(os.path.join(folder, name))
        state, _ = chain.load(step, map_location="cpu")
        expected = {"model": load_file(os.path.join(reference, name, "model.safetensors")),
                    "optimizer": torch.load(os.path.join(reference, name, "optimizer.pt"))}
        model = dict(sorted(state["model"].items()))  # a safetensors file's order is by name
        found = difference(expected, {"model": model, "optimizer": state["optimizer"]})
        assert found is None, f"{name} is not what the uninterrupted run saved: {found}"
    if committed(folder):
        cli = subprocess.run([sys.executable, "-m", "tpde.cli", "verify", folder, "-q"],
                             capture_output=True, text=True)
        assert cli.returncode == 0, cli.stdout + cli.stderr
    trainer = build(folder, attach={})
    last = trainer.tpde.last_checkpoint()
    trainer.train(resume_from_checkpoint=True if last is not None else None)
    name = os.path.basename(last) if last is not None else None
    if name not in resumed:  # the stock trainer, resumed from a copy of the same checkpoint
        copy = os.path.join(os.path.dirname(reference), f"stock-{name}")
        os.makedirs(copy)
        shutil.copytree(os.path.join(reference, str(name)), os.path.join(copy, str(name)))
        stock = build(copy)
        stock.train(resume_from_checkpoint=os.path.join(copy, str(name)))
        resumed[name] = outcome(stock)
    found = difference(resumed[name], outcome(trainer))
    assert found is None, f"resumed from {name}, the run differs from the stock one: {found}"
    return last is not None


def campaign(root: str, points: int = 12, within: tuple[float, float] = (0.0, 1.0)
             ) -> dict[str, int]:
    """Kills at ``points`` operations spread evenly over the ``within`` part (fractions) of a
    dry run's, both ends included; what was tried."""
    from hf_runs import build, outcome

    reference = os.path.join(root, "reference")
    reference_run = build(reference, save_total_limit=None)
    reference_run.train()
    resumed = {None: outcome(reference_run)}
    dry = os.path.join(root, "dry")
    _spawn(dry, 0)
    with open(os.path.join(dry, COUNT)) as f:
        total = int(f.read())
    stats = {"operations": total, "kills": 0, "resumed": 0}
    first, last = (1 + round(f * (total - 1)) for f in within)
    for i in range(points):
        kill_at = first + (i * (last - first)) // max(points - 1, 1)
        folder = os.path.join(root, f"kill-{kill_at}")
        if _spawn(folder, kill_at) == -9:
            stats["kills"] += 1
        stats["resumed"] += check(folder, reference, resumed)
        shutil.rmtree(folder)
        print(f"kill point {kill_at}/{total}: ok", flush=True)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, default=12)
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "KILL_AT"))
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
    with tempfile.TemporaryDirectory() as root:
        print(campaign(root, args.points))


if __name__ == "__main__":
    main()
