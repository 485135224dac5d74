"""The ``tpde`` command line. ``main`` parses the arguments and runs one command: ``inspect``
holds the commands that only read a run, ``write`` those that write files or the run."""

from tpde.cli.main import main

__all__ = ["main"]
