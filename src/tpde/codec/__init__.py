"""The codec: pure functions between a tensor's words and the bytes stored for them, no I/O.

``encoder`` and ``decoder`` code a record and rebuild it; below them ``transform`` (words, byte
planes, residuals), ``elias`` (changed positions), ``frames`` and ``unframe`` (chunked zstd,
written and read back), ``quant`` (the opt-in error-bounded coding) and ``dtypes`` (the stored
dtype table), with their optional C extensions (``_elias``, ``_planes``, ``_zframes``,
``_rebuild``).

May import: ``tpde.errors``, ``tpde.runtime``.
"""
