"""GPU code for tpde, each piece with a CPU path: nvCOMP batched zstd glue and Triton kernels
(byte-plane unshuffle, residual application, Elias-delta position decoding).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``.
"""
