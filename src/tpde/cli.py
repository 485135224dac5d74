"""The ``tpde`` command line: ls, info, restore, verify, gc.

Exit status: 0 success, 1 a tpde error or damaged data, 2 wrong usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from . import __version__, dtypes, tree
from . import report as show
from . import entry as entries
from .api import Checkpointer, Snapshot
from .against import distances
from .chain import KEYFRAME, Chain, lossy_summary, span_words
from .errors import LossyWarning, StepExistsError, StepNotFoundError, TPDEError
from .lease import Lease
from .keys import weights_key

err = show.err


def _options(pairs: list[str]) -> dict[str, Any]:
    """``-o key=value`` pairs; values that parse as JSON (numbers, booleans) are converted."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"storage option {pair!r} is not KEY=VALUE")
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


def cmd_ls(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()
    rows, damaged = [], []
    for s in chain.steps():  # one damaged manifest must not hide the others
        try:
            rows.append(show.step_row(chain.manifest(s)))
        except TPDEError as exc:
            damaged.append({"step": s, "error": exc.detail})
    raw = sum(r["raw_bytes"] for r in rows)
    stored = sum(r["stored_bytes"] for r in rows)
    rest = chain.at_rest()
    named = None if args.entries is None else _entries(chain, args)
    if args.json:
        print(json.dumps({"run": chain.url, "steps": rows, "damaged_steps": damaged,
                          **({} if named is None else {"entries": named}),
                          "raw_bytes": raw, "stored_bytes": stored,
                          "ratio": round(raw / max(1, stored), 3),
                          "deltas_against": chain.deltas_against(),
                          "at_rest": rest.as_dict()}))
        return 1 if damaged else 0
    against = " (deltas against keyframes)" if chain.deltas_against() == KEYFRAME else ""
    table = Table(title=f"{chain.url}: {len(rows) + len(damaged)} steps{against}")
    for col in ("step", "kind", "raw", "stored", "ratio", "codecs"):
        table.add_column(col, justify="right" if col in ("step", "raw", "stored", "ratio") else "left")
    bad = {d["step"]: d["error"] for d in damaged}
    hidden = chain.hidden()
    for r in sorted(rows + damaged, key=lambda r: r["step"]):
        if r["step"] in bad:
            table.add_row(str(r["step"]), "DAMAGED", "", "", "", f"manifest: {bad[r['step']]}")
            continue
        kind = ("key" if r["keyframe"] else f"delta<-{r['parent']}" + (
            " (hidden)" if r["parent"] in hidden else "")) + (" LOSSY" if r["lossy"] else "") + (
            f" {r['ranks']} ranks" if r["ranks"] else "")
        table.add_row(str(r["step"]), kind, show.mb(r["raw_bytes"]), show.mb(r["stored_bytes"]),
                      f"{r['ratio']:.2f}x",
                      " ".join(f"{k}:{v}" for k, v in sorted(r["codecs"].items())))
    show.out().print(table)
    if named is not None:
        show.entries_table(chain, named)
    print(f"total: {show.mb(raw)} raw, {show.mb(stored)} stored, {raw / max(1, stored):.2f}x")
    lossy = [r["step"] for r in rows if r["lossy"]]
    if lossy:
        print(f"LOSSY: {show.steps_text(lossy)} step(s) restore within an error bound, not bit-exactly "
              f"(`tpde info {args.run} --step N` gives the bounds and errors)")
    print(show.at_rest_line(rest))
    if damaged:
        print(f"{len(damaged)} step(s) cannot be read: `tpde verify {args.run}` says which steps "
              "they break and what to do")
    return 1 if damaged else 0


def _entries(chain: Chain, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The checkpoint files of a folder (``TPDECheckpointIO``'s entries) and their steps."""
    visible = set(chain.steps())
    return [{"name": name, "epoch": e.meta.get("epoch"), "global_step": e.meta.get("global_step"),
             "step": e.step, "restores": e.step in visible and chain.manifest(e.step).id == e.blob}
            for name, e in entries.listing(args.entries, chain, args.options).items()]


def cmd_info(chain: Chain, args: argparse.Namespace) -> int:
    m = chain.manifest(args.step if args.step is not None else chain.latest())
    tensors = [{
        "name": r.name, "dtype": r.dtype, "numel": r.numel, "device": r.device, "codec": r.codec,
        "residual": r.residual, "ref": r.ref,
        "density": round(r.density, 6),
        "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
        "ratio": round(r.raw_bytes / r.stored_bytes, 3) if r.stored_bytes else None,
        "bound": r.bound, "error": r.error, "lossy": r.lossy, "parts": r.parts,
    } for r in m.records]
    rest = chain.at_rest()
    try:
        reads = chain.reads(m.step)
        restore, restore_line = reads.as_dict(), show.reads_line(reads, m.raw_bytes)
    except TPDEError as exc:  # a step on the way is gone or damaged: info still describes it
        restore = {"error": str(exc)}
        restore_line = f"a restore of this step fails: {exc} (`tpde verify` says what to do)"
    if args.json:
        print(json.dumps({"run": chain.url, **show.step_row(m), "tensors": tensors,
                          "restore": restore, "at_rest": rest.as_dict()}))
        return 0
    sharded = (f", saved by {m.dcp.get('world_size')} ranks through "
               f"torch.distributed.checkpoint" if m.dcp is not None else "")
    table = Table(title=f"{chain.url} step {m.step} "
                        f"({'keyframe' if m.keyframe else f'delta against {m.parent}'}{sharded})")
    table.add_column("tensor", overflow="fold", min_width=24)
    bounded = any(t["bound"] for t in tensors)
    cols = ("dtype", "numel", "codec", "ref", "changed", "stored", "ratio") + (
        ("error bound",) if bounded else ())
    for col in cols:
        table.add_column(col, justify="left" if col in ("dtype", "codec", "error bound")
                         else "right", no_wrap=col != "error bound")
    for t, r in zip(tensors, m.records):
        table.add_row(t["name"] + (f" ({r.parts} tensors)" if r.parts else ""), t["dtype"],
                      str(t["numel"]),
                      t["codec"] + (f"/{t['residual'] or r.grid}" if t["residual"] or r.grid
                                    else ""),
                      "" if t["ref"] is None else str(t["ref"]), f"{t['density']:.2%}",
                      show.mb(t["stored_bytes"]), "-" if t["ratio"] is None else f"{t['ratio']:.2f}x",
                      *((show.bound_cell(r),) if bounded else ()))
    show.out().print(table)
    said = lossy_summary(m.records)
    if said:
        print(f"LOSSY step: {said}")
    print(restore_line)
    print(show.at_rest_line(rest))
    return 0


def _writable(path: str) -> None:
    """Fail before any decoding when ``--output`` cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise TPDEError(f"cannot write --output {path!r}: the folder {folder!r} does not exist; "
                        "create it first")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise TPDEError(f"cannot write --output {path!r}: "
                        + ("it is a folder; name a file" if os.path.isdir(path)
                           else f"the folder {folder!r} is not writable"))


def cmd_restore(chain: Chain, args: argparse.Namespace) -> int:
    _writable(args.output)
    if args.format == "safetensors":
        _safetensors()
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    key = args.key
    if key is None and args.format == "safetensors":
        key = weights_key(m.skeleton)  # a model's weights, with the keys load_state_dict takes
    key = key or None  # --key "": the whole checkpoint
    left = [k for k in tree.keys(m.skeleton) if k != key] if key is not None else []
    with _bar(m.raw_bytes, f"restoring step {step}", args.quiet) as advance, \
            warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LossyWarning)
        state, _ = chain.load(step, map_location="cpu", trusted=args.trusted, progress=advance,
                              keep_words=False, within=key)
    lossy = [str(w.message) for w in said if issubclass(w.category, LossyWarning)]
    for text in lossy[:1]:
        err.print(f"warning: LOSSY: {text}", markup=False, highlight=False, soft_wrap=True)
    if args.format == "torch":
        torch.save(state, args.output)
    else:
        left += _save_safetensors(state, args.output)
    if left and not args.json:
        err.print(f"warning: {args.output} leaves out "
                  + ", ".join(repr(k) for k in left[:8]) + (", ..." if len(left) > 8 else "")
                  + (" (not tensors)" if key is None else "")
                  + "; --key chooses another part, --key '' takes the whole checkpoint",
                  markup=False, highlight=False, soft_wrap=True)
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "output": args.output,
                          "format": args.format, "key": key, "left_out": left,
                          "raw_bytes": m.raw_bytes, "lossy": lossy[0] if lossy else None}))
    else:
        err.print(f"restored step {step} of {chain.url} to {args.output}")
    return 0


def _safetensors() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise TPDEError("--format safetensors needs the safetensors package: "
                        "pip install 'tpde[safetensors]'") from None
    return save_file


def _save_safetensors(state: Any, path: str) -> list[str]:
    """Write the tensors of ``state`` under dotted keys; returns the keys of what is not a
    tensor (safetensors holds tensors only)."""
    save_file = _safetensors()
    tensors: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    _dotted(state, "", tensors, dropped)
    save_file(tensors, path)
    return dropped


def _dotted(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], dropped: list[str]) -> None:
    """Copies of ``obj``'s tensors into ``tensors`` by dotted key, other keys into ``dropped``
    (a function of the module: a closure that calls itself would hold the copies in a cycle)."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().contiguous().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _dotted(v, f"{prefix}.{k}" if prefix else str(k), tensors, dropped)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _dotted(v, f"{prefix}.{i}" if prefix else str(i), tensors, dropped)
    else:
        dropped.append(prefix)


def cmd_verify(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()
    if args.against is not None:
        return _verify_against(chain, args)
    if args.step is not None and args.step not in chain.steps():
        raise StepNotFoundError(f"no step {args.step} in this run (it was never saved, or was "
                                f"removed); `tpde ls {args.run}` lists the steps",
                                run=chain.url, step=args.step)
    steps = [args.step] if args.step is not None else chain.steps()
    total = 0
    for s in steps:
        try:
            total += chain.manifest(s).raw_bytes
        except TPDEError:
            pass  # verify reports it below, with everything else
    with _bar(total, "verifying", args.quiet) as advance:
        problems = [p for s in steps for p in chain.verify(s, progress=advance)]
    damaged = sorted({p.needed_by for p in problems if p.step == p.needed_by})
    depend = sorted({p.needed_by for p in problems} - set(damaged))
    fine = [s for s in steps if s not in damaged and s not in depend]
    if args.json:
        print(json.dumps({"run": chain.url, "steps": steps, "ok": not problems, "fine": fine,
                          "damaged": damaged, "depend_on_damaged": depend,
                          "problems": [{k: v for k, v in vars(p).items() if k != "error"}
                                       for p in problems]}))
        return 1 if problems else 0
    if not problems:
        err.print(f"ok: {len(steps)} step(s) of {chain.url} restore bit-exactly")
        return 0
    if args.verbose:
        for p in problems:
            cause = f" (damage at step {p.step})" if p.step != p.needed_by else ""
            err.print(f"BAD step {p.needed_by}{cause}: {p.message}", markup=False,
                      highlight=False, soft_wrap=True)
    show.damage_summary(chain, args.run, problems, fine, damaged, depend)
    return 1


def _verify_against(chain: Chain, args: argparse.Namespace) -> int:
    """Hash-check one step, then measure it against a dense checkpoint of the same state."""
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    try:
        dense = torch.load(args.against, map_location="cpu", weights_only=not args.trusted)
    except Exception as exc:  # torch raises many kinds for a file that is not a checkpoint
        raise TPDEError(f"cannot read --against {args.against!r} with torch.load: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    with _bar(m.raw_bytes, f"verifying step {step}", args.quiet) as advance:
        problems = chain.verify(step, progress=advance)
    if problems:
        raise TPDEError(f"step {step} is damaged ({problems[0].message}); `tpde verify "
                        f"{args.run}` says more", run=chain.url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyWarning)  # the table below says it all
        restored, _ = chain.load(step, map_location="cpu", trusted=args.trusted,
                                 keep_words=False)
    found = distances(m, restored, dense)
    bad = [d.name for d in found if not d.within]
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "against": args.against,
                          "ok": not bad, "tensors": [d.as_dict() for d in found],
                          "max_abs": max((d.max_abs for d in found), default=0.0),
                          "max_rel": max((d.max_rel for d in found), default=0.0)}))
        return 1 if bad else 0
    table = Table(title=f"{chain.url} step {step} against {args.against}")
    for col in ("tensor", "bound", "max abs error", "max rel error", "differing", "within"):
        table.add_column(col, justify="left" if col in ("tensor", "bound") else "right")
    for d in found:
        if d.differing or d.bound or args.verbose:
            table.add_row(d.name, d.bound or "exact", f"{d.max_abs:.3g}", f"{d.max_rel:.3g}",
                          str(d.differing), "yes" if d.within else "NO")
    show.out().print(table)
    exact = sum(1 for d in found if not d.differing)
    err.print(f"{len(found)} tensors: {exact} bit-identical, {len(found) - exact - len(bad)} "
              f"within their bound, {len(bad)} outside it" + (f" ({', '.join(bad[:5])})" if bad
                                                            else ""))
    return 1 if bad else 0


def cmd_gc(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()  # a mistyped path: nothing is written where there is no run
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
        err.print(f"freed {show.mb(report.freed_bytes)} in {len(report.deleted)} object(s); "
                  f"purged steps: {report.purged_steps or 'none'}{note}")
    return 0


def cmd_export(chain: Chain, args: argparse.Namespace) -> int:
    """A step as the keyframe of a new run: mounting or loading it then decodes no deltas."""
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    if step in Chain(args.to, storage_options=args.options).steps():  # before decoding it
        raise StepExistsError(f"{args.to} already holds a step {step}; export into a run "
                              "that does not (a new --to folder)", run=chain.url, step=step)
    with _bar(m.raw_bytes, f"exporting step {step}", args.quiet) as advance:
        words = chain.materialize(step, progress=advance)
    # The skeleton is copied as stored: nothing is unpickled on the way.
    spans = []
    for recs in m.spans():
        data = span_words([r.name for r in recs], words).view(torch.uint8)
        spans.append(tree.Span(recs[0].span, data.view(dtypes.by_name(recs[0].dtype).torch_dtype),
                               recs[0].device, recs[0].parts or 0))
    with Checkpointer(args.to, storage_options=args.options) as out:
        info = out.save(step, Snapshot(tree.Flat(m.skeleton, spans), m.raw_bytes))
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "to": args.to,
                          "raw_bytes": info.raw_bytes, "stored_bytes": info.stored_bytes}))
    else:
        err.print(f"exported step {step} of {chain.url} to {args.to} as a keyframe "
                  f"({show.mb(info.stored_bytes)})")
    return 0


STEP_HELP = ("a step number, or in a checkpoint folder the file name of a checkpoint "
             "(e.g. last.ckpt; `tpde ls FOLDER` lists them)")


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
    c.add_argument("--step", help=STEP_HELP + " (default: the entry's, else the latest)")
    c = command("restore", "Write a step as a file that plain torch.load (or safetensors) reads.")
    c.add_argument("--step", help=STEP_HELP + " (default: the latest)")
    c.add_argument("--output", required=True, help="file to write")
    c.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    c.add_argument("--key", help="write only this top-level part of the checkpoint (default: "
                   "torch: all of it; safetensors: the model's weights, state_dict or model; "
                   "'' for all)")
    c.add_argument("--trusted", action="store_true",
                   help="allow unpickling objects outside torch's weights-only allowlist")
    c = command("verify", "Rebuild steps and check every hash; exit 1 with a summary of the "
                "damaged steps, the steps that depend on them, and what to do.")
    c.add_argument("--step", help=STEP_HELP + " (default: every visible step)")
    c.add_argument("-v", "--verbose", action="store_true", help="print every problem found")
    c.add_argument("--against", metavar="FILE", help="a dense checkpoint (torch.save) of the same "
                   "step: report each tensor's largest error against it and whether it holds "
                   "the recorded error bound")
    c.add_argument("--trusted", action="store_true",
                   help="allow unpickling objects outside torch's weights-only allowlist")
    c = command("export", "Write a step as the keyframe of another run (fast to mount).")
    c.add_argument("--step", help=STEP_HELP + " (default: the latest)")
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
    given = getattr(args, "step", None)
    if given is None:
        args.step = step
    elif given.lstrip("-").isdigit():
        args.step = int(given)
    else:  # a checkpoint file's name
        named = {} if folder is None else entries.listing(folder, chain, options)
        if given not in named:
            raise TPDEError(f"--step {given!r} is neither a step number nor a checkpoint file "
                            + (f"in {folder!r} (it has: {', '.join(named) or 'none'})"
                               if folder is not None else "(name the checkpoint folder as RUN)"))
        args.step = named[given].step
    return chain, folder


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        args.options = _options(args.storage_option)
    except ValueError as exc:
        p.error(str(exc))  # wrong usage: exit status 2
    try:
        chain, args.entries = _resolve(args, args.options)
        return COMMANDS[args.command](chain, args)
    except BrokenPipeError:
        # The reader stopped early (`tpde ls RUN | head`): what it read is all it wanted. The
        # rest of the output goes nowhere, so that the exit's flush raises nothing either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TPDEError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        err.print(f"tpde: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
