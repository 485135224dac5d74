"""Worker processes started by fork from a server that imported torch and tpde once.

A multi-process test starts a fresh interpreter per rank and launch; each spent seconds
importing ``torch.distributed`` and ``tpde.dcp`` before its first collective. Here a
forkserver (``multiprocessing``) imports them once, and every worker is forked from it: a real
process of its own (own pid, own gloo connections, killed by a real SIGKILL), whose script
runs as ``__main__`` with its own arguments and environment, and whose output goes to files
read back as a subprocess's would be.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import weakref
from typing import Any

#: What the server imports before it forks anyone: the expensive part of a worker's start
#: (one that cannot be imported is left for the worker to import, as it would).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "tpde", "tpde.dcp", "lightning.pytorch",
           "tpde.plugins.lightning"]
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _run(script: str, argv: list[str], env: dict[str, str], out: str, err: str,
         cwd: str | None = None) -> None:
    """In the worker: the environment, folder and output a subprocess would have, then
    ``script`` (a path), or the module ``-m NAME`` names, as ``__main__``."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    threads = env.get("OMP_NUM_THREADS")
    if threads:  # read by torch when its thread pool starts, which the server never did
        import torch

        torch.set_num_threads(int(threads))
    if script.startswith("-m "):  # as ``python -m``: the current folder first on the path
        sys.argv = [script, *argv]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


class Forked:
    """A forked worker with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str],
                 cwd: str | None = None) -> None:
        self.args = [sys.executable, *script.split(" ", 1), *argv]
        self._dir = tempfile.mkdtemp(prefix="tpde-forked-")
        self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        self._proc = _context().Process(target=_run, args=(script, argv, env, self._out,
                                                           self._err, cwd))
        self._proc.start()
        self.pid = self._proc.pid
        weakref.finalize(self, shutil.rmtree, self._dir, True)

    @property
    def returncode(self) -> int | None:
        """As ``Popen.returncode``: negative for the signal that ended it."""
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the worker; what it wrote to its stdout and stderr."""
        self.wait(timeout)
        with open(self._out) as out, open(self._err) as err:
            return out.read(), err.read()


def run_module(module: str, *argv: str, cwd: str | None = None, timeout: float = 300
               ) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV...`` in a forked worker, as ``subprocess.run(...,
    capture_output=True, text=True)`` would give it: the exit status, stdout and stderr."""
    worker = Forked(f"-m {module}", list(argv), dict(os.environ), cwd)
    try:
        out, err = worker.communicate(timeout=timeout)
    finally:
        worker.kill()
    return subprocess.CompletedProcess(worker.args, worker.returncode, out, err)

