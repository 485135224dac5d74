"""GPU code for tpde, each piece with a CPU path: nvCOMP batched zstd glue."""
