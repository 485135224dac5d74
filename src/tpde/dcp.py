"""``tpde.dcp``: tpde as the storage layer under ``torch.distributed.checkpoint``.

``dcp.save(state, storage_writer=tpde.dcp.Writer(run, step))`` and
``dcp.load(state, storage_reader=tpde.dcp.Reader(run))``; ``load_full(run, step)`` gives a
sharded step as one ordinary state dict. The adapter lives in ``tpde.plugins.dcp`` (saving)
and ``tpde.plugins.dcp_read`` (loading).
"""

from tpde.plugins.dcp import Writer
from tpde.plugins.dcp_read import Reader, load_full

__all__ = ["Reader", "Writer", "load_full"]
