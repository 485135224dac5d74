"""Two processes start saving into one run at the same moment, many times over.

Each trial: a run with one committed step; two forked writers open it behind a barrier and
save, the same step or one each, and keep their writers open until both have tried (a writer
that finished and closed would hand the run on legitimately). After each trial: one save got
through, it restores bit-exactly what its writer saved, and the other writer got
``WriterConflictError`` or ``StepExistsError``. The third kind has both writers take the lease
over (``takeover=True``) and save the same step: the commit alone must keep one.

    python tests/campaigns/races.py [--s3] [--trials 200]   # prints the outcomes
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import uuid
from collections import Counter
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import tpde  # noqa: E402
from helpers import assert_same  # noqa: E402

REFUSALS = ("WriterConflictError", "StepExistsError")


def state(writer: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + writer)
    return {"w": torch.randn(256, 64, generator=g), "writer": writer, "step": step}


KINDS = ("same step", "different steps", "same step, both taking over")


def _writer(url: str, options: dict | None, writer: int, step: int, takeover: bool,
            start: Any, done: Any, out: Any) -> None:
    try:
        start.wait(60)
        try:
            ck = tpde.Checkpointer(url, storage_options=options, takeover=takeover)
            ck.save(step, state(writer, step))
            out.put((writer, step, "ok"))
        except tpde.TPDEError as exc:
            out.put((writer, step, type(exc).__name__ if isinstance(
                exc, (tpde.WriterConflictError, tpde.StepExistsError)) else f"{exc!r}"))
            ck = None
        done.wait(60)
        if ck is not None:
            ck.close()
    except BaseException as exc:  # anything else is a failure the parent reports
        out.put((writer, step, f"{type(exc).__name__}: {exc}"))


def trial(url: str, options: dict | None, kind: str) -> list[tuple[int, int, str]]:
    """One race of ``kind`` (``KINDS``); returns each writer's (writer, step, outcome) after
    checking the run."""
    with tpde.Checkpointer(url, storage_options=options) as ck:
        ck.save(0, state(9, 0))
    ctx = multiprocessing.get_context("fork")
    start, done, out = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    steps = (1, 2) if kind == "different steps" else (1, 1)
    takeover = kind == KINDS[2]
    procs = [ctx.Process(target=_writer,
                         args=(url, options, w, steps[w], takeover, start, done, out))
             for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    outcomes = sorted(out.get(timeout=10) for _ in procs)
    for writer, step, said in outcomes:
        assert said == "ok" or said in REFUSALS, f"writer {writer}: {said}"
    won = [(w, s) for w, s, said in outcomes if said == "ok"]
    assert len(won) == 1, f"{len(won)} writers got through: {outcomes}"
    reader = tpde.Checkpointer(url, storage_options=options)
    assert reader.steps() == sorted({0, *(s for _, s in won)}), (reader.steps(), outcomes)
    for writer, step in won:  # what got through is exactly what its writer saved
        assert_same(reader.load(step), state(writer, step))
    assert_same(reader.load(0), state(9, 0))
    return outcomes


def campaign(make_url: Callable[[], tuple[str, dict | None]], trials: int) -> Counter:
    """``trials`` races of each kind; returns how often each outcome was seen."""
    seen: Counter = Counter()
    for _ in range(trials):
        for kind in KINDS:
            url, options = make_url()
            for _, _, said in trial(url, options, kind):
                seen[(kind, said)] += 1
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--s3", action="store_true", help="against a moto S3 server on 127.0.0.1")
    p.add_argument("--trials", type=int, default=200, help="races of each kind")
    args = p.parse_args()
    if args.s3:
        from campaigns.s3 import moto_server

        with moto_server() as options:
            seen = campaign(lambda: (f"s3://tpde/{uuid.uuid4().hex[:10]}", options), args.trials)
    else:
        root = tempfile.mkdtemp()
        try:
            seen = campaign(lambda: (os.path.join(root, uuid.uuid4().hex[:10]), None),
                            args.trials)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    where = "S3 (moto)" if args.s3 else "local disk"
    print(f"{args.trials} races of each kind on {where}; one writer got through each time:")
    for (kind, said), n in sorted(seen.items()):
        print(f"  {kind}: {said} x{n}")


if __name__ == "__main__":
    main()
