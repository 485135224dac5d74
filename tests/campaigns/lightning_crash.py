"""Kill a Lightning run that checkpoints with TPDECheckpointIO at each I/O operation in turn.

The run resumes from ``last`` with ``ModelCheckpoint(save_top_k=1, save_last=True)``, so its
background worker saves, replaces ``last.ckpt`` and removes old checkpoints. The killed process
keeps a journal of the checkpoints it committed and of the removals it began. After every
SIGKILL:

- every checkpoint committed before the kill and not being removed is there, names the global
  step it was saved at, and holds exactly the state a run without the kill saved at that step;
- every checkpoint file left loads bit-exactly and ``tpde verify`` passes on it;
- the run resumes from ``last`` at the step ``last`` names, and its weights after two more
  epochs are bit-identical to those of a run resumed from the same step that was never killed;
- ``tpde gc`` leaves no unreferenced data.

    python tests/campaigns/lightning_crash.py [--points 60]     # prints the kill points tried
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

JOURNAL = "journal.log"  # beside the checkpoints; not a .ckpt, so Lightning ignores it
COUNT = "operations.txt"  # a finished child's count of store operations


def fit(folder: str, epochs: int, *, top_k: int, ckpt_path: str | None = None
        ) -> tuple[Any, Any, int]:
    """A seeded, deterministic run; returns (plugin, model, the global step it started at)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_train import CharLM, loaders

    import tpde

    L.seed_everything(0, verbose=False)
    model = CharLM(dim=32, layers=1)
    started: list[int] = []

    class Start(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            started.append(trainer.global_step)

    callback = ModelCheckpoint(dirpath=folder, save_top_k=top_k, monitor="step", mode="max",
                               save_last=True, every_n_train_steps=2)
    plugin = tpde.TPDECheckpointIO(keyframe_every=3)
    trainer = L.Trainer(max_epochs=epochs, plugins=[plugin], callbacks=[callback, Start()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, num_sanity_val_steps=0)
    trainer.fit(model, loaders(windows=64, batch=16)[0], ckpt_path=ckpt_path)
    plugin.teardown()
    return plugin, model, started[0]


def child(folder: str, kill_at: int) -> None:
    """Resume the run and SIGKILL this process at the ``kill_at``-th store operation.

    With ``kill_at`` 0 nothing is killed and the number of operations is printed. The journal
    is appended with unbuffered writes, which a SIGKILL cannot take back.
    """
    from campaigns.crash import arm
    from tpde.plugins.lightning import TPDECheckpointIO

    journal = open(os.path.join(folder, JOURNAL), "a", buffering=1)
    write, remove = TPDECheckpointIO._write, TPDECheckpointIO.remove_checkpoint

    def journaled_write(self: Any, snap: Any, path: str, options: Any, meta: dict,
                        stall_ms: float, asked: int) -> None:
        name = os.path.basename(path)
        journal.write(f"saving {name}\n")
        write(self, snap, path, options, meta, stall_ms, asked)
        journal.write(f"saved {name} {meta['global_step']}\n")

    def journaled_remove(self: Any, path: Any) -> None:
        journal.write(f"removing {os.path.basename(str(path))}\n")
        remove(self, path)

    TPDECheckpointIO._write, TPDECheckpointIO.remove_checkpoint = journaled_write, journaled_remove
    count = arm(kill_at)
    last = os.path.join(folder, "last.ckpt")
    fit(folder, 3, top_k=1, ckpt_path=last)
    print(f"operations={count[0]}")
    with open(os.path.join(folder, COUNT), "w") as f:
        f.write(str(count[0]))


@dataclass
class Reference:
    """The run without kills: every checkpoint it saved, and the weights after resuming."""

    root: str
    paths: dict[int, str] = field(default_factory=dict)  # global step -> a checkpoint of it
    states: dict[int, Any] = field(default_factory=dict)
    finals: dict[int, Any] = field(default_factory=dict)  # resumed at step -> final weights

    def final(self, step: int) -> Any:
        """Weights after resuming from this run's checkpoint at ``step``, never killed."""
        if step not in self.finals:
            folder = os.path.join(self.root, f"resumed-at-{step}")
            self.finals[step] = fit(folder, 4, top_k=1, ckpt_path=self.paths[step])[1].state_dict()
        return self.finals[step]


def checkpoints(folder: str) -> dict[str, tuple[int, Any]]:
    """Every .ckpt file in ``folder`` that names a committed step: its global step and state
    dict (a pending entry reads as the entry it replaced)."""
    from tpde.entries import entry

    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".ckpt"):
            continue
        path = os.path.join(folder, name)
        found = entry.read_any(path)
        if isinstance(found, entry.PendingEntry) and found.previous is None:
            continue  # a first save the kill cut short: nothing was committed at this path
        state = entry.load_checkpoint(path)
        out[name] = state["global_step"], state["state_dict"]
    return out


def committed(folder: str, before: dict[str, int]) -> tuple[dict[str, int], set[str]]:
    """The checkpoints the journal says were committed (and not being removed) at the kill,
    and the names whose next save had begun (they may name the newer step already)."""
    out, saving = dict(before), set()
    with open(os.path.join(folder, JOURNAL)) as journal:
        for line in journal:
            words = line.split()
            if words[0] == "saving":
                saving.add(words[1])
            elif words[0] == "saved":
                out[words[1]] = int(words[2])
                saving.discard(words[1])
            elif words[0] == "removing":
                out.pop(words[1], None)
    return out, saving


def in_flight(folder: str) -> bool:
    """Whether the kill fell inside a save: the journal's last save began but never ended."""
    with open(os.path.join(folder, JOURNAL)) as journal:
        saves = [line.split()[0] for line in journal if line.startswith("sav")]
    return bool(saves) and saves[-1] == "saving"


def check(folder: str, before: dict[str, int], reference: Reference) -> None:
    from helpers import assert_same
    from tpde.cli import main as cli

    import tpde

    left = checkpoints(folder)
    kept, saving = committed(folder, before)
    for name, step in kept.items():
        assert name in left, f"{name} (step {step}) was committed before the kill and is gone"
        now = left[name][0]
        assert now == step or (name in saving and now > step), \
            f"{name} names step {now}, committed as {step}"
    for name, (step, state) in left.items():
        assert_same(state, reference.states[step], name)
        assert cli(["verify", os.path.join(folder, name), "-q"]) == 0, f"verify failed: {name}"
    resumed_at = left["last.ckpt"][0]
    _, model, started = fit(folder, 4, top_k=1, ckpt_path=os.path.join(folder, "last.ckpt"))
    assert started == resumed_at, f"resumed at step {started}, last.ckpt is step {resumed_at}"
    assert_same(model.state_dict(), reference.final(resumed_at), "weights after resuming")
    assert cli(["gc", folder, "--grace", "0", "-q"]) == 0
    chain = tpde.Checkpointer(os.path.join(folder, ".tpde")).chain
    live = {chain.manifest(s).blob for s in chain.committed()}
    unreferenced = {e.path for e in chain.store.list("data")} - live
    assert not unreferenced, f"gc left unreferenced blobs: {unreferenced}"


def _run_child(folder: str, kill_at: int) -> bool:
    """Run the child; whether it was killed. The run's last operations are what its
    teardown frees, and how much that is depends on how far training had gone when the
    worker looked at the entries: a kill point past a run's end is that run finishing."""
    from forked import Forked

    child = Forked(__file__, ["--child", folder, str(kill_at)], dict(os.environ))
    stdout, stderr = child.communicate(timeout=600)
    done = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    if done.returncode == 0 and kill_at:
        ran = int(done.stdout.rsplit("operations=", 1)[1].split()[0])
        assert ran < kill_at, f"kill point {kill_at} reached in {ran} operations, no kill"
        return False
    expected = -9 if kill_at else 0
    assert done.returncode == expected, (
        f"kill point {kill_at}: exit status {done.returncode}, expected {expected}\n"
        + done.stderr[-3000:])
    return bool(kill_at)


def campaign(root: str, *, points: int = 60) -> dict[str, int]:
    """SIGKILL at ``points`` store operations spread evenly over the whole resumed run (the
    first and the last included). Returns the kills, the operations in the run, and how many
    kills fell inside a save."""
    template = os.path.join(root, "template")
    fit(template, 1, top_k=1)
    before = {name: step for name, (step, _) in checkpoints(template).items()}
    reference = Reference(os.path.join(root, "reference"))
    full = os.path.join(reference.root, "run")
    shutil.copytree(template, full)
    fit(full, 3, top_k=-1, ckpt_path=os.path.join(full, "last.ckpt"))
    for name, (step, state) in checkpoints(full).items():
        reference.paths[step], reference.states[step] = os.path.join(full, name), state
    dry = os.path.join(root, "count")
    shutil.copytree(template, dry)
    _run_child(dry, 0)
    with open(os.path.join(dry, COUNT)) as f:
        total = int(f.read())
    step = max(1, (total - 1) / max(1, points - 1))
    kill_points = sorted({min(total, 1 + round(i * step)) for i in range(points)})
    inside = kills = 0
    for kill_at in kill_points:
        folder = os.path.join(root, f"kill-{kill_at}")
        shutil.copytree(template, folder)
        if _run_child(folder, kill_at):
            kills += 1
            inside += in_flight(folder)
        check(folder, before, reference)
        shutil.rmtree(folder)
    return {"kills": kills, "points": len(kill_points), "operations": total,
            "inside_a_save": inside}


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
        stats = campaign(root, points=args.points)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{stats['kills']} SIGKILLs ({stats['points']} kill points) among the "
          f"{stats['operations']} store operations of a "
          f"resumed Lightning run with TPDECheckpointIO, {stats['inside_a_save']} of them inside "
          "a save: every committed checkpoint survived bit-exactly and verified, and the run "
          "resumed from last at its step and matched a run that was never killed")


if __name__ == "__main__":
    main()
