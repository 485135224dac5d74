"""The commands that write: restore and export a step, gc and repair a run."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch

from tpde.api import Checkpointer, Snapshot
from tpde.chain import Chain, span_words
from tpde.cli import show
from tpde.codec import dtypes
from tpde.entries import checkpoint_folder, folder_checkpoint
from tpde.entries import entry as entries
from tpde.errors import LossyWarning, StepExistsError, TPDEError
from tpde.state import tree
from tpde.state.keys import weights_key
from tpde.store.lease import Lease

err = show.err


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
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    if args.format is None:  # a folder checkpoint's step, whole, is a folder again
        args.format = "folder" if args.key is None \
            and folder_checkpoint.is_folder_state(m.skeleton) else "torch"
    if args.format == "folder":
        _restore_folder(chain, step, args)
        return 0
    _writable(args.output)
    if args.format == "safetensors":
        _safetensors()
    key = args.key
    if key is None and args.format == "safetensors":
        key = weights_key(m.skeleton)  # a model's weights, with the keys load_state_dict takes
    key = key or None  # --key "": the whole checkpoint
    left = [k for k in tree.keys(m.skeleton) if k != key] if key is not None else []
    state, lossy = _load(chain, step, args, key)
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
    _said(chain, step, args, {"format": args.format, "key": key, "left_out": left,
                              "raw_bytes": m.raw_bytes, "lossy": lossy})
    return 0


def _load(chain: Chain, step: int, args: argparse.Namespace, key: str | None
          ) -> tuple[Any, str | None]:
    """The step (or its part ``key``) with a progress bar, and the text of its lossy warning
    (None: lossless), which is printed."""
    with show.bar(chain.manifest(step).raw_bytes, f"restoring step {step}", args.quiet) \
            as advance, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LossyWarning)
        state, _ = chain.load(step, map_location="cpu", trusted=args.trusted, progress=advance,
                              keep_words=False, within=key)
    lossy = [str(w.message) for w in said if issubclass(w.category, LossyWarning)]
    for text in lossy[:1]:
        err.print(f"warning: LOSSY: {text}", markup=False, highlight=False, soft_wrap=True)
    return state, lossy[0] if lossy else None


def _said(chain: Chain, step: int, args: argparse.Namespace, facts: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps({"run": chain.url, "step": step, "output": args.output, **facts}))
    else:
        err.print(f"restored step {step} of {chain.url} to {args.output}")


def _restore_folder(chain: Chain, step: int, args: argparse.Namespace) -> None:
    """A folder checkpoint's step as the plain folder its framework wrote: the weight files
    and the optimizer's from the chain, the other files from the checkpoint folder RUN names
    (where RUN is one)."""
    m = chain.manifest(step)
    if not folder_checkpoint.is_folder_state(m.skeleton):
        raise TPDEError(f"--format folder: step {step} of {chain.url} is not a checkpoint "
                        "folder's (tpde.hf); choose --format torch or safetensors")
    if args.key is not None:
        raise TPDEError("--format folder writes the whole checkpoint; leave out --key")
    _safetensors()
    output = args.output.rstrip("/") or args.output
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise TPDEError(f"cannot write --output {output!r}: the folder {parent!r} "
                        + ("is not writable" if os.path.isdir(parent) else
                           "does not exist; create it first"))
    if os.path.exists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise TPDEError(f"cannot write --output {output!r}: it exists and is not an empty "
                        "folder; name a new folder")
    source = args.run if entries.holds_folder_entry(args.run, args.options) else None
    state, lossy = _load(chain, step, args, None)
    written = folder_checkpoint.write_plain(state, source, output, args.options)
    if not args.json and source is None:
        err.print(f"warning: {output} holds the weight and optimizer files only: name the "
                  "checkpoint folder as RUN to copy its other files too", markup=False,
                  highlight=False, soft_wrap=True)
    _said(chain, step, args, {"format": "folder", "files": written, "raw_bytes": m.raw_bytes,
                              "lossy": lossy})


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


def cmd_gc(chain: Chain, args: argparse.Namespace) -> int:
    chain.require_run()  # a mistyped path: nothing is written where there is no run
    lease = Lease(chain.store)
    lease.acquire(takeover=args.force)  # gc must not race a live writer's next delta
    hidden: list[int] = []
    try:
        if args.entries is not None:  # a checkpoint folder: steps no entry names go first
            hidden = checkpoint_folder.orphans(chain, args.entries, args.options)
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


def cmd_repair(chain: Chain, args: argparse.Namespace) -> int:
    """Damaged checkpoint files of a folder, written again from the chain."""
    if args.entries is None:
        raise TPDEError(f"{args.run} is not a checkpoint folder: repair writes the checkpoint "
                        "files of a TPDECheckpointIO folder again (name the folder)")
    lease = Lease(chain.store)
    lease.acquire(takeover=args.force)  # the run's writer may be rewriting the same files
    try:
        done, left = checkpoint_folder.repair(args.entries, chain, args.options, name=args.entry,
                                    step=args.step)
    finally:
        lease.release()
    if args.json:
        print(json.dumps({"repaired": done, "unresolved": left}))
    for name, step in done.items():
        err.print(f"rewrote {name}: step {step}")
    for name, named in left.items():
        err.print(f"{name}: " + (f"may name steps {named}" if named else
                  "names no step that can be found in what is left of it") +
                  f"; choose with `tpde repair {args.run} --entry {name} --step N` "
                  f"(`tpde ls {args.run}` lists the steps), or delete the file")
    if not done and not left:
        err.print("no damaged checkpoint file")
    return 1 if left else 0


def cmd_export(chain: Chain, args: argparse.Namespace) -> int:
    """A step as the keyframe of a new run: mounting or loading it then decodes no deltas."""
    step = args.step if args.step is not None else chain.latest()
    m = chain.manifest(step)
    if step in Chain(args.to, storage_options=args.options).steps():  # before decoding it
        raise StepExistsError(f"{args.to} already holds a step {step}; export into a run "
                              "that does not (a new --to folder)", run=chain.url, step=step)
    with show.bar(m.raw_bytes, f"exporting step {step}", args.quiet) as advance:
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
