"""The ``tpde`` command line: ls, info, restore, verify, export, gc, repair.

Exit status: 0 success, 1 a tpde error or damaged data, 2 wrong usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from tpde import __version__
from tpde.errors import TPDEError

if TYPE_CHECKING:
    from tpde.chain import Chain


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


STEP_HELP = ("a step number, or in a checkpoint folder the file name of a checkpoint "
             "(e.g. last.ckpt; `tpde ls FOLDER` lists them)")


class _Version(argparse.Action):
    """``--version``: the extensions are looked at only when it is asked for."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from tpde.runtime import extensions

        print(f"tpde {__version__} ({extensions.note()})")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpde", description="Inspect, restore, verify and clean "
                                "tpde checkpoint chains in any fsspec location.")
    p.add_argument("--version", action=_Version, nargs=0,
                   help="show the version and which C extensions are built, and exit")
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
    c.add_argument("--output", required=True, help="file to write (a folder for a "
                   "checkpoint folder's step: tpde.hf's checkpoint-N)")
    c.add_argument("--format", choices=("torch", "safetensors", "folder"), default=None,
                   help="default: folder for a checkpoint folder's step (the plain folder "
                   "its framework wrote), else torch")
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
    c = command("repair", "Write the damaged checkpoint files of a folder again from the "
                "chain (each names the step whose blob name survives in it).")
    c.add_argument("--entry", metavar="NAME", help="only this file (e.g. last.ckpt)")
    c.add_argument("--step", help="the step it names, where what is left of it does not tell "
                   "(needs --entry)")
    c.add_argument("--force", action="store_true",
                   help="take the writer lease from a job that died without releasing it")
    return p


def command(name: str) -> Callable[[Chain, argparse.Namespace], int]:
    """The function of command ``name``. The commands (and torch) are imported once one runs:
    ``--help`` and ``--version`` answer without them."""
    from tpde.cli import inspect, write

    return {"ls": inspect.cmd_ls, "info": inspect.cmd_info, "restore": write.cmd_restore,
            "verify": inspect.cmd_verify, "export": write.cmd_export, "gc": write.cmd_gc,
            "repair": write.cmd_repair}[name]


def _resolve(args: argparse.Namespace, options: dict[str, Any]) -> tuple[Chain, str | None]:
    """The chain RUN names and, for a checkpoint folder, the folder; an entry sets ``--step``."""
    from tpde.entries import checkpoint_folder, entry

    chain, step, folder = entry.resolve(args.run, options)
    given = getattr(args, "step", None)
    if given is None:
        args.step = step
    elif given.lstrip("-").isdigit():
        args.step = int(given)
    else:  # a checkpoint file's name
        named = {} if folder is None else checkpoint_folder.listing(folder, chain, options)
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
        return command(args.command)(chain, args)
    except BrokenPipeError:
        # The reader stopped early (`tpde ls RUN | head`): what it read is all it wanted. The
        # rest of the output goes nowhere, so that the exit's flush raises nothing either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except TPDEError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        from tpde.cli.show import err

        err.print(f"tpde: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 1
