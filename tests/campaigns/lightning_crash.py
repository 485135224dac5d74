"""Kill a Lightning run that checkpoints with TPDECheckpointIO at each I/O operation in turn.

The run resumes from ``last`` with ``ModelCheckpoint(save_top_k=1, save_last=True)``, so its
background worker saves, replaces ``last.ckpt`` and removes old checkpoints. After every
SIGKILL: every checkpoint file left loads and holds exactly the state a run without the kill
saved at that global step, ``tpde verify`` passes on each, the run resumes from ``last`` and
finishes, and ``tpde gc`` leaves no unreferenced data.

    python tests/campaigns/lightning_crash.py [--points 60]     # prints the kill points tried
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))


def fit(folder: str, epochs: int, *, top_k: int, resume: bool) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_train import CharLM, loaders

    import tpde

    L.seed_everything(0, verbose=False)
    model = CharLM(dim=32, layers=1)
    callback = ModelCheckpoint(dirpath=folder, save_top_k=top_k, monitor="step", mode="max",
                               save_last=True, every_n_train_steps=2)
    plugin = tpde.TPDECheckpointIO(keyframe_every=3)
    trainer = L.Trainer(max_epochs=epochs, plugins=[plugin], callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, num_sanity_val_steps=0)
    last = os.path.join(folder, "last.ckpt")
    trainer.fit(model, loaders(windows=64, batch=16)[0],
                ckpt_path=last if resume and os.path.exists(last) else None)
    return plugin


def child(folder: str, kill_at: int) -> None:
    """Resume the run and SIGKILL this process at the ``kill_at``-th store operation.

    With ``kill_at`` 0 nothing is killed and the number of operations is printed.
    """
    from campaigns.crash import arm

    count = arm(kill_at)
    fit(folder, 3, top_k=1, resume=True).teardown()
    print(f"operations={count[0]}")


def states_by_step(folder: str) -> dict[int, Any]:
    from tpde import entry

    out = {}
    for name in os.listdir(folder):
        if name.endswith(".ckpt"):
            state = entry.load_checkpoint(os.path.join(folder, name))
            out[state["global_step"]] = state["state_dict"]
    return out


def check(folder: str, reference: dict[int, Any]) -> None:
    from helpers import assert_same
    from tpde import entry
    from tpde.cli import main as cli

    for name in sorted(os.listdir(folder)):
        if not name.endswith(".ckpt"):
            continue
        path = os.path.join(folder, name)
        state = entry.load_checkpoint(path)
        assert_same(state["state_dict"], reference[state["global_step"]], name)
        assert cli(["verify", path, "-q"]) == 0, f"verify failed on {name}"
    plugin = fit(folder, 4, top_k=1, resume=True)  # the next run resumes and finishes
    plugin.teardown()
    assert cli(["gc", folder, "--grace", "0", "-q"]) == 0
    import tpde

    chain = tpde.Checkpointer(os.path.join(folder, ".tpde")).chain
    live = {chain.manifest(s).blob for s in chain.committed()}
    left = {e.path for e in chain.store.list("data")} - live
    assert not left, f"gc left unreferenced blobs: {left}"


def _run_child(folder: str, kill_at: int) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, __file__, "--child", folder, str(kill_at)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, -9), done.stderr[-3000:]
    return done


def campaign(root: str, *, points: int = 60) -> tuple[int, int]:
    """SIGKILL at ``points`` store operations spread evenly over the whole resumed run (the
    first and the last included). Returns (kill points tried, operations in the run)."""
    template = os.path.join(root, "template")
    fit(template, 1, top_k=1, resume=False).teardown()
    full = os.path.join(root, "reference")
    shutil.copytree(template, full)
    fit(full, 3, top_k=-1, resume=True).teardown()
    reference = states_by_step(full)
    dry = os.path.join(root, "count")
    shutil.copytree(template, dry)
    total = int(_run_child(dry, 0).stdout.rsplit("operations=", 1)[1].split()[0])
    step = max(1, (total - 1) / max(1, points - 1))
    kill_points = sorted({min(total, 1 + round(i * step)) for i in range(points)})
    for kill_at in kill_points:
        folder = os.path.join(root, f"kill-{kill_at}")
        shutil.copytree(template, folder)
        _run_child(folder, kill_at)
        check(folder, reference)
        shutil.rmtree(folder)
    return len(kill_points), total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--points", type=int, default=60, help="kill points, spread over the run")
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "KILL_AT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    root = tempfile.mkdtemp()
    try:
        n, total = campaign(root, points=args.points)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{n} kill points tried among the {total} store operations of a resumed Lightning run "
          "with TPDECheckpointIO: every checkpoint left loaded bit-exactly and verified, and the "
          "run resumed from last each time")


if __name__ == "__main__":
    main()
