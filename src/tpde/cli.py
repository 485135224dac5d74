"""The ``tpde`` command line: ls, info, restore, verify, gc.

Exit status: 0 success, 1 a tpde error or damaged data, 2 wrong usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from . import __version__, dtypes, tree
from . import entry as entries
from .api import Checkpointer, Snapshot
from .chain import AtRest, Chain, span_words
from .errors import TPDEError
from .lease import Lease
from .manifest import Manifest

err = Console(stderr=True)


def _options(pairs: list[str]) -> dict[str, Any]:
    """``-o key=value`` pairs; values that parse as JSON (numbers, booleans) are converted."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"tpde: storage option {pair!r} is not KEY=VALUE")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parsed
    return out


@contextmanager
def _bar(total: int, label: str, quiet: bool) -> Iterator[Any]:
    if quiet or not err.is_terminal:
        yield lambda n: None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _step_row(m: Manifest) -> dict[str, Any]:
    return {
        "step": m.step, "keyframe": m.keyframe, "parent": m.parent,
        "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes,
        "ratio": round(m.raw_bytes / max(1, m.stored_bytes), 3),
        "codecs": dict(Counter(r.codec for r in m.records)), "seconds": round(m.seconds, 3),
    }


def cmd_ls(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()
    rows = [_step_row(chain.manifest(s)) for s in chain.steps()]
    raw = sum(r["raw_bytes"] for r in rows)
    stored = sum(r["stored_bytes"] for r in rows)
    rest = chain.at_rest()
    if args.json:
        print(json.dumps({"run": chain.url, "steps": rows, "raw_bytes": raw, "stored_bytes": stored,
                          "ratio": round(raw / max(1, stored), 3), "at_rest": rest.as_dict()}))
        return 0
    table = Table(title=f"{chain.url}: {len(rows)} steps")
    for col in ("step", "kind", "raw", "stored", "ratio", "codecs"):
        table.add_column(col, justify="right" if col in ("step", "raw", "stored", "ratio") else "left")
    for r in rows:
        table.add_row(str(r["step"]), "key" if r["keyframe"] else f"delta<-{r['parent']}",
                      _mb(r["raw_bytes"]), _mb(r["stored_bytes"]), f"{r['ratio']:.2f}x",
                      " ".join(f"{k}:{v}" for k, v in sorted(r["codecs"].items())))
    _out().print(table)
    print(f"total: {_mb(raw)} raw, {_mb(stored)} stored, {raw / max(1, stored):.2f}x")
    print(_at_rest_line(rest))
    return 0


def _at_rest_line(rest: AtRest) -> str:
    """What the run holds in its store, and why beyond its visible steps."""
    parts = [f"at rest: {_mb(rest.total)} ({_mb(rest.visible)} in visible steps"]
    for h in rest.as_dict()["hidden_steps"]:
        why = (f"read by steps {h['needed_by']}" if h["needed_by"]
               else "kept as the writer's reference, or until `tpde gc`")
        parts.append(f"hidden step {h['step']}: {_mb(h['bytes'])}, {why}")
    if rest.leftovers:
        parts.append(f"{_mb(rest.leftovers)} left by unfinished saves (`tpde gc` deletes them)")
    return "; ".join(parts) + ")"


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _out() -> Console:
    """Tables for people: full width in a terminal, wide enough not to fold when piped."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def cmd_info(chain: Chain, args: argparse.Namespace) -> int:
    m = chain.manifest(args.step if args.step is not None else chain.latest())
    tensors = [{
        "name": r.name, "dtype": r.dtype, "numel": r.numel, "device": r.device, "codec": r.codec,
        "residual": r.residual, "ref": r.ref,
        "density": round(r.density, 6),
        "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
        "ratio": round(r.raw_bytes / r.stored_bytes, 3) if r.stored_bytes else None,
    } for r in m.records]
    rest = chain.at_rest()
    if args.json:
        print(json.dumps({"run": chain.url, **_step_row(m), "tensors": tensors,
                          "at_rest": rest.as_dict()}))
        return 0
    table = Table(title=f"{chain.url} step {m.step} "
                        f"({'keyframe' if m.keyframe else f'delta against {m.parent}'})")
    table.add_column("tensor", overflow="fold", min_width=24)
    for col in ("dtype", "numel", "codec", "ref", "changed", "stored", "ratio"):
        table.add_column(col, justify="left" if col in ("dtype", "codec") else "right",
                         no_wrap=True)
    for t in tensors:
        table.add_row(t["name"], t["dtype"], str(t["numel"]),
                      t["codec"] + (f"/{t['residual']}" if t["residual"] else ""),
                      "" if t["ref"] is None else str(t["ref"]), f"{t['density']:.2%}",
                      _mb(t["stored_bytes"]), "-" if t["ratio"] is None else f"{t['ratio']:.2f}x")
    _out().print(table)
    print(_at_rest_line(rest))
    return 0


def cmd_restore(chain: Chain, args: argparse.Namespace) -> int:
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    with _bar(m.raw_bytes, f"restoring step {step}", args.quiet) as advance:
        state, _ = chain.load(step, map_location="cpu", trusted=args.trusted, progress=advance,
                              keep_words=False)
    if args.format == "torch":
        torch.save(state, args.output)
    else:
        _save_safetensors(state, args.output)
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "output": args.output,
                          "format": args.format, "raw_bytes": m.raw_bytes}))
    else:
        err.print(f"restored step {step} of {chain.url} to {args.output}")
    return 0


def _save_safetensors(state: Any, path: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise TPDEError("--format safetensors needs the safetensors package: "
                        "pip install 'tpde[safetensors]'") from None
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            tensors[prefix] = obj.detach().contiguous().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(state, "")
    save_file(tensors, path)


def cmd_verify(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()
    steps = [args.step] if args.step is not None else chain.steps()
    total = sum(chain.manifest(s).raw_bytes for s in steps)
    with _bar(total, "verifying", args.quiet) as advance:
        problems = [p for s in steps for p in chain.verify(s, progress=advance)]
    if args.json:
        print(json.dumps({"run": chain.url, "steps": steps, "ok": not problems,
                          "problems": [vars(p) for p in problems]}))
    elif problems:
        for p in problems:
            cause = f" (damage at step {p.step})" if p.step != p.needed_by else ""
            err.print(f"BAD step {p.needed_by}{cause}: {p.message}", markup=False,
                      highlight=False, soft_wrap=True)
    else:
        err.print(f"ok: {len(steps)} step(s) of {chain.url} restore bit-exactly")
    return 1 if problems else 0


def cmd_gc(chain: Chain, args: argparse.Namespace) -> int:
    lease = Lease(chain.store)
    lease.acquire(takeover=args.force)  # gc must not race a live writer's next delta
    hidden: list[int] = []
    try:
        if args.entries is not None:  # a checkpoint folder: steps no entry names go first
            hidden = entries.orphans(chain, args.entries, args.options)
            for step in hidden:
                chain.remove(step)
        report = chain.gc(grace_seconds=args.grace)
    finally:
        lease.release()
    if args.json:
        print(json.dumps({**vars(report), "hidden_steps": hidden}))
    else:
        note = f"; hid steps no checkpoint entry names: {hidden}" if hidden else ""
        err.print(f"freed {_mb(report.freed_bytes)} in {len(report.deleted)} object(s); "
                  f"purged steps: {report.purged_steps or 'none'}{note}")
    return 0


def cmd_export(chain: Chain, args: argparse.Namespace) -> int:
    """A step as the keyframe of a new run: mounting or loading it then decodes no deltas."""
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    with _bar(m.raw_bytes, f"exporting step {step}", args.quiet) as advance:
        words = chain.materialize(step, progress=advance)
    # The skeleton is copied as stored: nothing is unpickled on the way.
    spans = []
    for recs in m.spans():
        data = span_words([r.name for r in recs], words).view(torch.uint8)
        spans.append(tree.Span(recs[0].span, data.view(dtypes.by_name(recs[0].dtype).torch_dtype),
                               recs[0].device))
    with Checkpointer(args.to, storage_options=args.options) as out:
        info = out.save(step, Snapshot(tree.Flat(m.skeleton, spans), m.raw_bytes))
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "to": args.to,
                          "raw_bytes": info.raw_bytes, "stored_bytes": info.stored_bytes}))
    else:
        err.print(f"exported step {step} of {chain.url} to {args.to} as a keyframe "
                  f"({_mb(info.stored_bytes)})")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpde", description="Inspect, restore, verify and clean "
                                "tpde checkpoint chains in any fsspec location.")
    p.add_argument("--version", action="version", version=f"tpde {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("run", help="the run's URL or path (file, s3://, gs://, memory://, ...), "
                       "a checkpoint folder of TPDECheckpointIO, or one checkpoint entry in it")
        c.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="fsspec storage option, repeatable (e.g. client_kwargs.endpoint_url=...)")
        c.add_argument("--json", action="store_true", help="print machine-readable JSON")
        c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        return c

    command("ls", "List the visible steps with codec mix, raw and stored bytes, ratio.")
    c = command("info", "Per-tensor codec, changed density, bytes and ratio of one step.")
    c.add_argument("--step", type=int, help="step (default: the entry's, else the latest)")
    c = command("restore", "Write a step as a file that plain torch.load (or safetensors) reads.")
    c.add_argument("--step", type=int, help="step to restore (default: the latest)")
    c.add_argument("--output", required=True, help="file to write")
    c.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    c.add_argument("--trusted", action="store_true",
                   help="allow unpickling objects outside torch's weights-only allowlist")
    c = command("verify", "Rebuild steps and check every hash; exit 1 naming each bad tensor.")
    c.add_argument("--step", type=int, help="one step (default: every visible step)")
    c = command("export", "Write a step as the keyframe of another run (fast to mount).")
    c.add_argument("--step", type=int, help="step to export (default: the latest)")
    c.add_argument("--to", required=True, help="the run to write it to (new or existing)")
    c = command("gc", "Delete data no visible step needs and report the bytes freed.")
    c.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="keep unreferenced blobs younger than this (saves may be in progress)")
    c.add_argument("--force", action="store_true",
                   help="take the writer lease from a job that died without releasing it")
    return p


COMMANDS = {"ls": cmd_ls, "info": cmd_info, "restore": cmd_restore, "verify": cmd_verify,
            "export": cmd_export, "gc": cmd_gc}


def _resolve(args: argparse.Namespace, options: dict[str, Any]) -> tuple[Chain, str | None]:
    """The chain RUN names and, for a checkpoint folder, the folder; an entry sets ``--step``."""
    chain, step, folder = entries.resolve(args.run, options)
    if step is not None and getattr(args, "step", None) is None:
        args.step = step
    return chain, folder


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.options = _options(args.storage_option)
        chain, args.entries = _resolve(args, args.options)
        return COMMANDS[args.command](chain, args)
    except TPDEError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        err.print(f"tpde: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
