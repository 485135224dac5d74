"""What the CLI prints for people: step and tensor rows, byte counts, bytes at rest, damage
summaries, progress bars. Apart from the commands so that they read as what they do."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from tpde.chain import AtRest, Chain, Reads
from tpde.codec.quant import Bound, applies
from tpde.manifest import Manifest

#: Messages for people go to stderr; stdout carries tables and JSON.
err = Console(stderr=True)


@contextmanager
def bar(total: int, label: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    if quiet or not err.is_terminal:
        yield lambda n: None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def step_row(m: Manifest) -> dict[str, Any]:
    return {
        "step": m.step, "keyframe": m.keyframe, "parent": m.parent,
        "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes,
        "ratio": round(m.raw_bytes / max(1, m.stored_bytes), 3),
        "codecs": dict(Counter(r.codec for r in m.records)), "seconds": round(m.seconds, 3),
        "lossy": m.lossy,
        # Sharded steps (saved through torch.distributed.checkpoint): the ranks that saved.
        "ranks": m.dcp.get("world_size") if m.dcp is not None else None,
    }


def entries_table(chain: Chain, named: list[dict[str, Any]]) -> None:
    table = Table(title=f"checkpoint files beside {chain.url}")
    for col in ("file", "epoch", "global_step", "step", "state"):
        table.add_column(col, justify="left" if col in ("file", "state") else "right")
    for e in named:
        table.add_row(e["name"], str(e["epoch"] if e["epoch"] is not None else "-"),
                      str(e["global_step"] if e["global_step"] is not None else "-"),
                      "-" if e["step"] is None else str(e["step"]), _entry_state(e))
    out().print(table)


def _entry_state(e: dict[str, Any]) -> str:
    if e["state"] == "damaged":
        steps = e["steps"]
        return "DAMAGED, " + (f"names step {steps[0]}" if len(steps) == 1 else
                              f"may name steps {steps}" if steps else "names no step found")
    if e["state"] == "pending":
        return f"first save pending ({e['writer']})"
    return "ok" if e["restores"] else "its step is gone"


def at_rest_line(rest: AtRest) -> str:
    """What the run holds in its store, and why beyond its visible steps."""
    parts = [f"at rest: {mb(rest.total)} ({mb(rest.visible)} in visible steps"]
    for h in rest.as_dict()["hidden_steps"]:
        why = (f"read by steps {h['needed_by']}" if h["needed_by"]
               else "kept as the writer's reference or a deferred removal, until the writer "
               "closes or `tpde gc`")
        parts.append(f"hidden step {h['step']}: {mb(h['bytes'])}, {why}")
    for d in rest.as_dict()["damaged_steps"]:
        parts.append(f"damaged step {d['step']}: {mb(d['bytes'])}")
    if rest.leftovers:
        parts.append(f"{mb(rest.leftovers)} left by unfinished saves (`tpde gc` deletes them)")
    return "; ".join(parts) + ")"


def reads_line(reads: Reads, raw: int) -> str:
    """What a restore of the step decodes, and what bounds it where that is several times the
    step's own bytes (dense deltas far from their keyframe)."""
    line = (f"restore: decodes {len(reads.records)} record(s) from {steps_text(reads.steps)} "
            f"step(s): {mb(reads.stored_bytes)} stored, at most {reads.deepest} delta(s) deep")
    if reads.stored_bytes > 2 * raw:
        line += (f"; {reads.stored_bytes / max(1, raw):.1f}x the step's raw bytes: "
                 "deltas_against=\"keyframe\" or a lower keyframe_every bounds that (docs/"
                 "performance.md, \"Deltas against keyframes\")")
    return line


def mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def out() -> Console:
    """Tables for people: full width in a terminal, wide enough not to fold when piped."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def bound_cell(r: Any) -> str:
    if r.bound is None:
        return "exact"
    bound = str(Bound.from_dict(r.bound))
    if not applies(r.dtype):
        return f"{bound} not applied: {r.dtype} is stored exactly"
    if r.error is None:
        return f"{bound}; exact at this step"
    return f"{bound}; max error {r.error['abs']:.3g} abs, {r.error['rel']:.3g} rel"


def steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:12]))
    return f"{len(steps)} ({shown}{', ...' if len(steps) > 12 else ''})" if steps else "none"


def damage_summary(chain: Chain, run: str, problems: list[Any], fine: list[int],
                    damaged: list[int], depend: list[int]) -> None:
    """Three groups of steps, the damage behind them, and what a user can do about it."""
    say = (lambda text: err.print(text, markup=False, highlight=False, soft_wrap=True))
    say(f"{chain.url}: {len(fine) + len(damaged) + len(depend)} step(s) verified")
    say(f"  fine: {steps_text(fine)}")
    say(f"  damaged: {steps_text(damaged)}")
    say(f"  depend on a damaged step: {steps_text(depend)}")
    causes: dict[tuple[int, str], set[str]] = {}
    for p in problems:  # one line per damaged object, naming the tensors it breaks
        tensors = causes.setdefault((p.step, p.error.detail if p.error else p.message), set())
        tensors.update([p.tensor] if p.tensor else [])
    say("damage found:")
    for (at, detail), tensors in sorted(causes.items())[:8]:
        names = ", ".join(repr(t) for t in sorted(tensors)[:3]) + (", ..." if len(tensors) > 3
                                                                  else "")
        say(f"  step {at}" + (f" ({names})" if tensors else "") + f": {detail}")
    if len(causes) > 8:
        say(f"  ... and {len(causes) - 8} more (-v lists every problem, --json gives them all)")
    say("what to do:")
    if fine:
        say(f"  - restore a fine step: tpde restore {run} --step {fine[-1]} --output FILE")
        say(f"  - go on training from a fine step; or write one as a fresh keyframe that nothing "
            f"damaged is read from: tpde export {run} --step {fine[-1]} --to NEW_RUN")
    say("  - if the training job still holds a damaged step's state, save it again")
    say("  - damage that keeps appearing points at the storage: check its disk or bucket")
