"""Checkpoint entries, the small files at checkpoint paths that name a chain's steps
(``entry``), and a folder of them as one whole (``checkpoint_folder``).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``, ``tpde.store``, ``tpde.chain``, ``tpde.api``,
``tpde.mounting``.
"""
