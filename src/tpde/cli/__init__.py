"""The ``tpde`` command line. ``main`` parses the arguments and runs one command: ``inspect``
holds the commands that only read a run, ``write`` those that write files or the run.

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``, ``tpde.store``, ``tpde.chain``, ``tpde.api``,
``tpde.entries``, ``tpde.mounting``, ``tpde.plugins``, ``tpde.dcp``.
"""

from tpde.cli.main import main

__all__ = ["main"]
