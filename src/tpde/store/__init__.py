"""Bytes, and the only layer that does I/O: ``protocol`` (``ByteStore``, what every layer
above reads and writes through), ``store`` (any fsspec location: reads, atomic writes, retries
and deadlines), ``blob`` (a blob written as a stream, made durable before it is named),
``exclusive`` (writes that succeed only where no other did), ``lease`` (one writer per run)
and ``resident`` (a mount's read-only view, its reads served from memory).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``.
"""
