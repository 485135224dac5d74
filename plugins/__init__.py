"""Framework adapters for tpde: the plain-PyTorch optimizer hook (``hook``), Lightning's
checkpoint I/O (``lightning``, with ``pending``, ``worker`` and ``writers`` behind it) and its
sharded strategies (``lightning_sharded``), the storage layer under
``torch.distributed.checkpoint`` (``dcp``, ``dcp_read``, ``dcp_metadata``), and Hugging Face's
``Trainer`` (``hf``, with ``folder_saves`` and ``hf_folders`` behind it).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``, ``tpde.store``, ``tpde.chain``, ``tpde.api``,
``tpde.entries``, ``tpde.mounting``, ``tpde.cli``, ``tpde.dcp``.
"""
