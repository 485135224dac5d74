"""Peak memory of a forward through a mount at budget 0, against a dense load of the same step,
measured from outside: each case runs in a fresh process, which resets its peak resident set
(``/proc/self/clear_refs``) once the model is built and tpde, torch and the model's code are
imported, then reports how far the peak rose above that point.

Models: causal transformer LMs of two sizes (27.7 and 141 MiB in fp32), in fp32 and in bf16,
each saved as a 4-step chain of small dense updates (plus a ``torch.save`` file of the last
step). A mount at budget 0 holds one module's weights at a time, so its floor is the largest
module plus what the forward itself allocates (the head's output and the GEMM's workspace):
the larger model shows how far below a dense load that floor sits once weights dominate.
Each mount is measured as it is made by default (``resident`` not given), then with
``resident="store"`` and ``"host"``, and ("ahead") by default with torch on one thread fewer
than the CPUs, which leaves the mount's worker a CPU to decode the next modules on while they
fit in the largest module's room (where torch's threads already leave one, every mount does).

    python benchmarks/mount_memory.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


#: The models measured: (vocab, width, layers).
SIZES = {"small": (8000, 256, 4), "large": (16000, 512, 6)}


class LM(torch.nn.Module):
    """A small causal LM: embeddings, encoder layers (fused fast path in eval) and a head."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.body(self.emb(x), mask=mask, is_causal=True))


def build(folder: str, dtype: torch.dtype, size: str) -> None:
    import tpde

    torch.manual_seed(0)
    model = LM(*SIZES[size]).to(dtype)
    with tpde.Checkpointer(os.path.join(folder, "run")) as ck:
        for step in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_((1e-3 * torch.randn_like(p, dtype=torch.float32)).to(dtype))
            ck.save(step, {"model": model.state_dict()})
    torch.save(model.state_dict(), os.path.join(folder, "dense.pt"))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def measure(folder: str, case: str, dtype: str, size: str) -> None:
    """In a fresh process: the peak rise of resident memory over one forward."""
    import tpde
    from tpde import mount  # noqa: F401  (imported before the baseline, as a user's script has it)
    from tpde.runtime.frame_threads import usable_cpus

    torch.manual_seed(1)
    x = torch.randint(0, SIZES[size][0], (2, 64))
    model = LM(*SIZES[size]).to(getattr(torch, dtype)).eval()
    if case != "dense":
        model = model.to("meta")  # a mount needs shapes only
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kb("VmRSS:")
    with torch.no_grad():
        if case == "dense":
            model.load_state_dict(torch.load(os.path.join(folder, "dense.pt"), weights_only=True))
            model(x)
        else:
            if case == "ahead":
                torch.set_num_threads(usable_cpus() - 1)
            how = {} if case in ("default", "ahead") else {"resident": case}
            mounted = tpde.mount(os.path.join(folder, "run"), model=model, budget=0, **how)
            mounted(x)
    print(json.dumps({"peak_extra_mb": (_rss_kb("VmHWM:") - base) / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", default=os.path.join(HERE, "results", "mount_memory.json"))
    p.add_argument("--measure", nargs=4, metavar=("FOLDER", "CASE", "DTYPE", "SIZE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(*args.measure)
        return
    from tpde.runtime.frame_threads import usable_cpus

    # "default": no ``resident`` given (the store, read by range, for a local run at budget 0).
    cases = ["dense", "default", "store", "host"]
    if 1 < usable_cpus() <= torch.get_num_threads():
        cases.append("ahead")
    rows = []
    for size in SIZES:
        for dtype in ("float32", "bfloat16"):
            with tempfile.TemporaryDirectory(prefix="tpde-mount-memory-") as folder:
                build(folder, getattr(torch, dtype), size)
                weights = os.path.getsize(os.path.join(folder, "dense.pt")) / 2**20
                for case in cases:
                    out = subprocess.run([sys.executable, __file__, "--measure", folder, case,
                                          dtype, size], capture_output=True, text=True,
                                         check=True)
                    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mb"]
                    rows.append({"size": size, "dtype": dtype, "case": case,
                                 "weights_mb": weights, "peak_extra_mb": peak})
                    print(f"{size:5s} {dtype:9s} {case:7s} weights {weights:6.1f} MiB  "
                          f"peak extra {peak:6.1f} MiB", file=sys.stderr)
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
