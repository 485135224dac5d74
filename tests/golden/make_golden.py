"""Write the golden chains once: `python tests/golden/make_golden.py` writes those missing. Never
regenerate one to make a test pass: a decoder that cannot read it has broken the format.

* ``chain-v1``: format 1, every span stored whole;
* ``chain-v2``: format 2, the same states with every span above 8 KiB stored in pieces;
* ``chain-v3``: format 3, the same states as steps 1, 3, 5, 7, 9, each saved after a detour step
  (0, 2, 4, 6, 8) that is then removed, so every kept step is re-based (copied, re-coded and
  re-pointed records).
* ``chain-v4``: format 4, ``lossy_states()`` saved with ``LOSSY_BOUNDS``: error-bounded
  records on both grids, dense and sparse codes, exactly stored fixes, bounded keyframes.
* ``chain-v6``: format 6, ``golden_states()`` with XXH3-128 record hashes.
* ``chain-v6-keyframe``: format 6, ``golden_states()`` with each delta coded against its
  tensor's keyframe record (``deltas_against="keyframe"``, recorded in ``tpde.json``): records
  whose ``ref`` names an earlier step than the one before.
* ``chain-v7``: format 7, ``packed_states()``: small tensors saved in packs (an fp32 and an
  int64 one), coded whole, as deltas and unchanged.
* ``chain-v5``: format 5, ``sharded_states()`` saved by two ranks (gloo) through
  ``torch.distributed.checkpoint`` as steps 0-3, then step 1 removed: step 2 is re-based into
  one blob, step 3 keeps one blob per rank.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tpde  # noqa: E402
from states import (LOSSY_BOUNDS, detour, golden_states, lossy_states,  # noqa: E402
                    packed_states, sharded_states)

HERE = os.path.dirname(__file__)
BOUNDS = {k: tpde.Abs(v) if how == "abs" else tpde.Rel(v) for k, (how, v) in LOSSY_BOUNDS.items()}
CHAINS = {"chain-v1": {}, "chain-v2": {"max_inflight_bytes": 16384}, "chain-v3": {},
          "chain-v4": {"error_bound": BOUNDS}, "chain-v6": {},
          "chain-v6-keyframe": {"deltas_against": "keyframe"}, "chain-v7": {}}

def sharded_rank(rank: int, out: str, port: int) -> None:
    """One of chain-v5's two ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import tpde.dcp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for step, state in enumerate(sharded_states()):
        model = state["model"]
        sharded = {"model": {"rows": distribute_tensor(model["rows"], mesh, [Shard(0)]),
                             "cols": distribute_tensor(model["cols"], mesh, [Shard(1)]),
                             "rep": distribute_tensor(model["rep"], mesh, [Replicate()])},
                   "meta": state["meta"]}
        dcp.save(sharded, storage_writer=tpde.dcp.Writer(out, step, keyframe_every=8,
                                                         chunk_bytes=4096))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    v5 = os.path.join(HERE, "chain-v5")
    if not os.path.exists(v5):
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(sharded_rank, args=(v5, port), nprocs=2)
        with tpde.Checkpointer(v5, keyframe_every=8, chunk_bytes=4096) as ck:
            print("chain-v5", ck.remove(1))
    for name, options in CHAINS.items():
        out = os.path.join(HERE, name)
        if os.path.exists(out):
            continue
        with tpde.Checkpointer(out, keyframe_every=3, chunk_bytes=4096, **options) as ck:
            if name == "chain-v3":
                for i, state in enumerate(golden_states()):
                    ck.save(2 * i, detour(state))
                    ck.save(2 * i + 1, state)
                print(name, ck.remove(*range(0, 10, 2)))
                continue
            states = {"chain-v4": lossy_states, "chain-v7": packed_states}.get(name, golden_states)
            for step, state in enumerate(states()):
                print(name, ck.save(step, state))
