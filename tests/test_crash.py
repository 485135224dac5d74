"""A real save in a child process, killed with SIGKILL at fixed points: nothing committed is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import tpde
from helpers import assert_same

CHILD = textwrap.dedent("""
    import os, signal, sys, torch, tpde
    from tpde import store

    url, point, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = {"n": 0}

    def killer(original):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > after:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return wrapped

    if point == "blob":
        store.BlobWriter.write = killer(store.BlobWriter.write)
    elif point == "rename":
        os.replace = killer(os.replace)
    elif point == "manifest":
        store.Store.put_atomic = killer(store.Store.put_atomic)
    ck = tpde.Checkpointer(url)
    ck.load()
    g = torch.Generator().manual_seed(7)
    ck.save(2, {"w": torch.randn(1000, 1000, generator=g), "b": torch.randn(300, generator=g)})
""")


def committed(url: str) -> dict[int, dict]:
    ck = tpde.Checkpointer(url)
    g = torch.Generator().manual_seed(0)
    states = {}
    w = torch.randn(300, 300, generator=g)
    for step in (0, 1):
        w = w + 0.01 * torch.randn(300, 300, generator=g)
        states[step] = {"w": w.clone(), "b": torch.full((300,), float(step))}
        ck.save(step, states[step])
    return states


@pytest.mark.parametrize("point, after", [("blob", 0), ("blob", 3), ("rename", 0), ("manifest", 0)])
def test_sigkill_mid_save_keeps_committed_steps(tmp_path, point: str, after: int) -> None:
    url = str(tmp_path / "run")
    states = committed(url)
    done = subprocess.run([sys.executable, "-c", CHILD, url, point, str(after)], timeout=120,
                          capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    ck = tpde.Checkpointer(url)
    assert ck.steps() == [0, 1]  # the half-written step 2 is invisible
    assert ck.verify() == []
    for step, state in states.items():
        assert_same(state, ck.load(step))
    leftovers = set(os.listdir(tmp_path / "run" / "data")) | set(os.listdir(tmp_path / "run" / "steps"))
    report = ck.gc(grace_seconds=0)
    assert all(os.path.basename(p) in leftovers for p in report.deleted)
    assert len(os.listdir(tmp_path / "run" / "data")) == 2
    assert not [f for f in os.listdir(tmp_path / "run" / "steps") if f.endswith(".tmp")]
    ck.save(2, {"w": torch.zeros(3)})  # the next writer continues
    assert ck.steps() == [0, 1, 2]
