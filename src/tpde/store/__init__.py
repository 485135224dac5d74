"""Bytes over fsspec, and the only layer that does I/O: ``store`` (reads, atomic writes,
retries and deadlines), ``exclusive`` (writes that succeed only where no other did),
``lease`` (one writer per run) and ``resident`` (a mount's reads served from memory)."""
