"""``tpde.mount``: a model whose stored weights are decoded just in time (``model``), and
which stored records each of its modules needs (``slots``).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``, ``tpde.store``, ``tpde.chain``, ``tpde.api``,
``tpde.entries``.
"""
