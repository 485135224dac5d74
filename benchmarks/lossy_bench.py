"""The error-bounded mode on real training chains: ratio against the bound, against lossless
tpde and against thresholding without error feedback (the method as first proposed), and what
the restored steps are worth as models.

For each workload and bound the model's weights are saved with ``error_bound`` (the optimizer
state stays exact) and every step is restored. Reported per bound:

* the weights' ratio (raw bytes over stored bytes of the model's records, every step summed),
  and its gain over lossless tpde on the same chain;
* the largest error of any restored element at any step, relative to the saved value;
* the eval loss of every restored step against the exact step's (B: masked-LM loss of
  all-MiniLM-L6-v2 on 8 fixed batches of held-out sentences; A: next-byte loss on 64 fixed
  windows);
* the baseline: changes smaller than the bound (relative to the true previous value) are
  dropped and the others stored as they are (Elias-delta positions, XOR values, zstd), as the
  method was first proposed; its bytes and the error it reaches by the last step;
* B only: a fine-tune resumed for 20 steps from the last step restored at Rel(1e-3), against
  the same resumed from the exact step (eval loss after it).

    python benchmarks/lossy_bench.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads  # noqa: E402

import tpde  # noqa: E402
from tpde.codec import elias, transform  # noqa: E402

BOUNDS = {"B-minilm-finetune": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
          "C-minilm-bf16": [1e-3, 1e-2, 3e-2],
          "A-gpt-pretrain": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]}
PATTERN = {"B-minilm-finetune": "model/*", "A-gpt-pretrain": "model/*", "C-minilm-bf16": "*"}


def weights(state: dict, name: str) -> dict[str, torch.Tensor]:
    d = state["model"] if "model" in state else state
    return {k: v for k, v in d.items() if v.is_floating_point()}


def model_bytes(ck: tpde.Checkpointer, steps: list[int], prefix: str) -> tuple[int, int]:
    raw = stored = 0
    for s in steps:
        for r in ck.chain.manifest(s).records:
            if r.name.startswith(prefix) and r.dtype in ("float32", "bfloat16"):
                raw += r.raw_bytes
                stored += r.stored_bytes
    return raw, stored


def max_rel_error(saved: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, x in saved.items():
        x64, y64 = x.double(), got[k].double()
        nz = x64 != 0
        if bool(nz.any()):
            worst = max(worst, float(((y64 - x64).abs()[nz] / x64.abs()[nz]).max()))
        if bool((~nz).any()):
            worst = max(worst, math.inf if bool((y64[~nz] != 0).any()) else 0.0)
    return worst


def threshold_baseline(states: list[dict], name: str, rel: float) -> tuple[int, float]:
    """Drop changes below ``rel`` of the true previous value; store the rest exactly; the
    reader applies them to what it has. Returns (stored bytes, worst relative error)."""
    cctx = zstandard.ZstdCompressor(level=3)
    prev_true: dict[str, torch.Tensor] = {}
    have: dict[str, torch.Tensor] = {}
    stored, worst = 0, 0.0
    for state in states:
        w = weights(state, name)
        for k, x in w.items():
            words = transform.to_words(x, torch.int16 if x.element_size() == 2 else torch.int32)
            if k not in prev_true:
                stored += len(cctx.compress(transform.shuffle(words).numpy().tobytes()))
                have[k] = x.clone()
            else:
                p = prev_true[k]
                changed = ((x.double() - p.double()).abs() > rel * p.double().abs()).reshape(-1)
                at = torch.nonzero(changed).reshape(-1)
                stored += len(elias.encode(at.numpy())) if at.numel() else 0
                vals = transform.shuffle(words[at] ^ transform.to_words(have[k], words.dtype)[at])
                stored += len(cctx.compress(vals.numpy().tobytes())) if at.numel() else 0
                flat = have[k].reshape(-1).clone()
                flat[at] = x.reshape(-1)[at]
                have[k] = flat.reshape(x.shape)
            prev_true[k] = x.clone()
        worst = max(worst, max_rel_error(w, have))
    return stored, worst


# ---------------------------------------------------------------- eval losses
def minilm_eval() -> Callable[[dict], float]:
    tok, model = workloads._minilm()
    sentences = [s.strip() for s in workloads.english_text().replace("\n", " ").split(". ")
                 if len(s) > 20]
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(8):
        idx = torch.randint(0, len(sentences), (16,), generator=g).tolist()
        b = tok([sentences[i] for i in idx], return_tensors="pt", padding=True, truncation=True,
                max_length=64)
        labels = b["input_ids"].clone()
        mask = (torch.rand(labels.shape, generator=g) < 0.15) & (b["attention_mask"] == 1)
        labels[~mask] = -100
        b["input_ids"][mask] = tok.mask_token_id
        batches.append((b, labels))

    def loss(state: dict) -> float:
        model.load_state_dict(state["model"])
        model.eval()
        with torch.no_grad():
            return float(np.mean([model(**b, labels=lab).loss.item() for b, lab in batches]))
    return loss


def gpt_eval() -> Callable[[dict], float]:
    model = workloads.TinyGPT(256, 4)
    data = workloads.corpus()
    windows = data[: (data.numel() // 65) * 65].reshape(-1, 65)
    rows = torch.randperm(len(windows), generator=torch.Generator().manual_seed(1234))[:64]
    batch = windows[rows]

    def loss(state: dict) -> float:
        model.load_state_dict(state["model"])
        model.eval()
        with torch.no_grad():
            out = model(batch[:, :-1]).reshape(-1, 256)
            return float(torch.nn.functional.cross_entropy(out, batch[:, 1:].reshape(-1)))
    return loss


def resumed_minilm(state: dict, steps: int = 20) -> float:
    tok, model = workloads._minilm()
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    opt.load_state_dict(state["optimizer"])
    torch.manual_seed(7)
    for _ in workloads._mlm_steps(model, tok, opt, steps):
        pass
    return minilm_eval()({"model": model.state_dict()})


# ---------------------------------------------------------------- the run
def chain(states: list[dict], folder: str, bound: float | None, pattern: str
          ) -> tuple[tpde.Checkpointer, float]:
    shutil.rmtree(folder, ignore_errors=True)
    ck = tpde.Checkpointer(folder, error_bound={pattern: tpde.Rel(bound)} if bound else None)
    started = time.perf_counter()
    for step, state in enumerate(states):
        ck.save(step, state)
    return ck, time.perf_counter() - started


def run(name: str, quick: bool, root: str) -> dict[str, Any]:
    states = workloads.load(name, quick)
    evaluate = {"B-minilm-finetune": minilm_eval, "A-gpt-pretrain": gpt_eval}.get(name)
    loss_of = evaluate() if evaluate else None
    steps = list(range(len(states)))
    prefix = "model/" if PATTERN[name] == "model/*" else ""
    exact_ck, exact_s = chain(states, os.path.join(root, "exact"), None, PATTERN[name])
    raw, exact_stored = model_bytes(exact_ck, steps, prefix)
    exact_loss = [loss_of(s) for s in states] if loss_of else []
    out: dict[str, Any] = {"workload": name, "checkpoints": len(states), "weights_raw": raw,
                           "lossless": {"stored": exact_stored, "ratio": raw / exact_stored,
                                        "save_s": exact_s, "eval_loss": exact_loss},
                           "bounds": []}
    print(f"{name}: {len(states)} checkpoints, weights {raw / 1e6:.1f} MB raw, lossless "
          f"{raw / exact_stored:.2f}x", file=sys.stderr)
    for rel in BOUNDS[name]:
        ck, seconds = chain(states, os.path.join(root, f"rel{rel:g}"), rel, PATTERN[name])
        _, stored = model_bytes(ck, steps, prefix)
        restored = [tpde.Checkpointer(ck.chain.url).load(s) for s in steps]
        worst = max(max_rel_error(weights(a, name), weights(b, name))
                    for a, b in zip(states, restored))
        losses = [loss_of(r) for r in restored] if loss_of else []
        base_stored, base_worst = threshold_baseline(states, name, rel)
        row = {"rel": rel, "stored": stored, "ratio": raw / stored,
               "gain_vs_lossless": exact_stored / stored, "worst_rel_error": worst,
               "save_s": seconds, "eval_loss": losses,
               "eval_loss_change": [abs(a - b) / b for a, b in zip(losses, exact_loss)],
               "baseline": {"stored": base_stored, "ratio": raw / base_stored,
                            "worst_rel_error": base_worst}}
        if name == "B-minilm-finetune" and rel == 1e-3:
            row["resumed_eval_loss"] = resumed_minilm(restored[-1])
            out["resumed_exact_eval_loss"] = resumed_minilm(states[-1])
        out["bounds"].append(row)
        print(f"  Rel({rel:g}): {raw / stored:.2f}x ({exact_stored / stored:.2f}x lossless), "
              f"worst error {worst:.3g}; eval loss change "
              f"{max(row['eval_loss_change'], default=0):.3%}; baseline "
              f"{raw / base_stored:.2f}x with worst error {base_worst:.3g}", file=sys.stderr)
        del restored
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    for ax, res in zip(np.atleast_1d(axes), results):
        rels = [b["rel"] for b in res["bounds"]]
        ax.plot(rels, [b["ratio"] for b in res["bounds"]], "o-", label="tpde, error-bounded")
        ax.plot(rels, [b["baseline"]["ratio"] for b in res["bounds"]], "s--",
                label="threshold, no error feedback\n(breaks the bound)")
        ax.axhline(res["lossless"]["ratio"], color="grey", ls=":", label="tpde lossless")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("relative bound")
        ax.set_ylabel("weights: raw / stored")
        ax.set_title(res["workload"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick-sized workloads")
    p.add_argument("--workloads", nargs="*", default=list(BOUNDS))
    p.add_argument("--json", default=os.path.join(HERE, "results", "lossy_bench.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "results", "lossy_bench.png"))
    args = p.parse_args()
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="tpde-lossy-")
    try:
        results = [run(name, args.quick, os.path.join(root, name)) for name in args.workloads]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "quick": args.quick,
                   "results": results}, f, indent=1)
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
