"""Train a small GPT-2 with Hugging Face's ``Trainer`` and checkpoint it with ``tpde.hf.attach``.

The model is built from a config (nothing is downloaded) and trained on this package's own
documentation, byte by byte. The same seeded run is trained twice with ``save_total_limit=2``:
once by the stock ``Trainer``, once attached to tpde. It prints what each output folder holds,
stops the tpde run halfway and resumes it with ``train(resume_from_checkpoint=True)``, checks
that it ends bit-identical to the stock run, and turns a checkpoint back into a plain
``checkpoint-N`` folder with the ``tpde`` CLI.

    python examples/hf_trainer.py [ROOT]     # default: runs/hf (examples/hf_lora.py: LoRA)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

import tpde.hf
from tpde.plugins.hf_folders import held_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import corpus  # noqa: E402


class StopAt(TrainerCallback):
    """Ends training after ``step``, as an interruption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(out: str, lora: bool, attach: bool, stop_at: int | None = None) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=4,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"],
                                                 fan_in_fan_out=True))
    text = corpus()
    windows = text[: (text.numel() // 64) * 64].reshape(-1, 64).long()
    data = [{"input_ids": w, "labels": w} for w in windows[:512]]
    args = TrainingArguments(out, max_steps=40, save_steps=10, save_total_limit=2,
                             per_device_train_batch_size=16,
                             learning_rate=1e-3 if lora else 3e-4, logging_steps=10, seed=0,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model, args, train_dataset=data)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    return tpde.hf.attach(trainer) if attach else trainer


def main(root: str, lora: bool) -> None:
    shutil.rmtree(root, ignore_errors=True)
    stock = make_trainer(os.path.join(root, "stock"), lora, attach=False)
    stock.train()
    out = os.path.join(root, "tpde")
    make_trainer(out, lora, attach=True, stop_at=20).train()  # interrupted after step 20
    resumed = make_trainer(out, lora, attach=True)
    resumed.train(resume_from_checkpoint=True)  # the newest committed checkpoint: 20
    same = all(torch.equal(a, b) for a, b in zip(stock.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))
    print(f"\nstock output folder: {held_bytes(os.path.join(root, 'stock')) / 1e6:.1f} MB; "
          f"tpde: {held_bytes(out) / 1e6:.1f} MB, {sorted(os.listdir(out))}")
    print(f"resumed run bit-identical to the stock one: {same}")
    for r in resumed.tpde.reports:
        print(f"  {r.path}: {r.raw_bytes / 1e6:.2f} MB -> {r.stored_bytes / 1e6:.2f} MB, "
              f"training waited {r.stall_ms:.0f} ms")
    plain = os.path.join(root, "plain-checkpoint-40")
    subprocess.run([sys.executable, "-m", "tpde.cli", "restore",
                    os.path.join(out, "checkpoint-40"), "--output", plain, "-q"], check=True)
    print(f"tpde restore wrote a plain checkpoint folder: {sorted(os.listdir(plain))}")
    if not same:
        raise SystemExit("the resumed run differs from the stock one")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("runs", "hf"), lora=False)
