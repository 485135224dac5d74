"""Write the golden chain once: `python tests/golden/make_golden.py`. Never regenerate it to make
a test pass: a decoder that cannot read it has broken the format."""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tpde  # noqa: E402
from states import golden_states  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "chain-v1")

if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    with tpde.Checkpointer(OUT, keyframe_every=3, chunk_bytes=4096) as ck:
        for step, state in enumerate(golden_states()):
            print(ck.save(step, state))
