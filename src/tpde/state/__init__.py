"""A checkpoint's structure: ``tree`` splits a state into a JSON skeleton and tensor spans
and back; ``keys`` finds where a model's state dict sits in a stored checkpoint.

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``.
"""
