"""The commands that read a run: ls, info, verify."""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch
from rich.table import Table

from tpde.chain import KEYFRAME, Chain, lossy_summary
from tpde.cli import show
from tpde.cli.against import distances
from tpde.entries import checkpoint_folder
from tpde.errors import LossyWarning, StepNotFoundError, TPDEError

err = show.err


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
    broken = [] if named is None else [r for r in named if r["state"] == "damaged"]
    if args.json:
        print(json.dumps({"run": chain.url, "steps": rows, "damaged_steps": damaged,
                          **({} if named is None else {"entries": named}),
                          "raw_bytes": raw, "stored_bytes": stored,
                          "ratio": round(raw / max(1, stored), 3),
                          "deltas_against": chain.deltas_against(),
                          "at_rest": rest.as_dict()}))
        return 1 if damaged or broken else 0
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
    if broken:
        print(f"{len(broken)} damaged checkpoint file(s) keep the steps they may name (gc frees "
              f"none of them): `tpde repair {args.run}` writes them again from the chain")
    return 1 if damaged or broken else 0


def _entries(chain: Chain, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The checkpoint files of a folder (``TPDECheckpointIO``'s entries) and their steps;
    damaged ones with the steps still named in them, and first saves still pending."""
    visible = set(chain.steps())
    found = checkpoint_folder.survey(args.entries, chain, args.options)
    rows = [{"name": name, "epoch": e.meta.get("epoch"), "global_step": e.meta.get("global_step"),
             "step": e.step, "restores": e.step in visible and chain.manifest(e.step).id == e.blob,
             "state": "ok"} for name, e in found.entries.items()]
    for name, damaged in found.damaged.items():
        named = damaged.steps(chain)
        rows.append({"name": name, "epoch": None, "global_step": None,
                     "step": named[0] if len(named) == 1 else None, "steps": named,
                     "restores": False, "state": "damaged", "error": damaged.error})
    rows += [{"name": name, "epoch": None, "global_step": None, "step": None,
              "restores": False, "state": "pending", "writer": p.writer}
             for name, p in found.pending.items()]
    return sorted(rows, key=lambda r: r["name"])


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
    with show.bar(total, "verifying", args.quiet) as advance:
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
    with show.bar(m.raw_bytes, f"verifying step {step}", args.quiet) as advance:
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
