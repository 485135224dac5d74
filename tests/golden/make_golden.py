"""Write the golden chains once: `python tests/golden/make_golden.py` writes those missing. Never
regenerate one to make a test pass: a decoder that cannot read it has broken the format.

* ``chain-v1``: format 1, every span stored whole;
* ``chain-v2``: format 2, the same states with every span above 8 KiB stored in pieces;
* ``chain-v3``: format 3, the same states as steps 1, 3, 5, 7, 9, each saved after a detour step
  (0, 2, 4, 6, 8) that is then removed, so every kept step is re-based (copied, re-coded and
  re-pointed records).
* ``chain-v4``: format 4, ``lossy_states()`` saved with ``LOSSY_BOUNDS``: error-bounded
  records on both grids, dense and sparse codes, exactly stored fixes, bounded keyframes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tpde  # noqa: E402
from states import LOSSY_BOUNDS, detour, golden_states, lossy_states  # noqa: E402

HERE = os.path.dirname(__file__)
BOUNDS = {k: tpde.Abs(v) if how == "abs" else tpde.Rel(v) for k, (how, v) in LOSSY_BOUNDS.items()}
CHAINS = {"chain-v1": {}, "chain-v2": {"max_inflight_bytes": 16384}, "chain-v3": {},
          "chain-v4": {"error_bound": BOUNDS}}

if __name__ == "__main__":
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
            for step, state in enumerate(lossy_states() if name == "chain-v4"
                                         else golden_states()):
                print(name, ck.save(step, state))
