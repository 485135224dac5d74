"""Small, seeded Hugging Face trainings for the tests of ``tpde.hf``: a GPT-2 built from a
config (nothing is downloaded), as a full fine-tune, a LoRA adapter (PEFT) or TRL's
``SFTTrainer``, stopped at a step by a callback (so that the interrupted run's schedule is the
uninterrupted one's) and resumed.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Trainer,
                          TrainerCallback, TrainingArguments)

import tpde.hf

VOCAB = 128
KINDS = ("full", "lora", "sft")


class StopAt(TrainerCallback):
    """Ends training after ``step`` as a crash would, without changing ``max_steps``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def gpt2(dtype: torch.dtype | None = None) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                       n_head=2, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1))
    return model.to(dtype) if dtype is not None else model


def rows(n: int = 64, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r} for r in ids]


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<eos>": VOCAB - 1}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                   eos_token="<eos>", pad_token="<eos>")


def build(out: str, kind: str = "full", *, attach: dict[str, Any] | None = None,
          stop_at: int | None = None, steps: int = 12, **args: Any) -> Trainer:
    """A trainer of ``kind`` writing to ``out``; ``attach``: ``tpde.hf.attach``'s settings
    (None: the stock trainer). ``args`` override the ``TrainingArguments``."""
    settings: dict[str, Any] = dict(max_steps=steps, per_device_train_batch_size=4, save_steps=4,
                                    logging_steps=1000, report_to=[], seed=0, save_total_limit=2,
                                    use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(args)
    model = gpt2()
    if kind == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        g = torch.Generator().manual_seed(0)
        texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (15,), generator=g))
                 for _ in range(64)]
        trainer: Trainer = SFTTrainer(model=model, args=SFTConfig(out, max_length=32, **settings),
                                      train_dataset=Dataset.from_dict({"text": texts}),
                                      processing_class=tokenizer())
    else:
        if kind == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"],
                                                     lora_dropout=0.0, fan_in_fan_out=True))
        data = rows()
        evaluating = settings.get("eval_strategy", "no") != "no"
        trainer = Trainer(model, TrainingArguments(out, **settings), train_dataset=data,
                          eval_dataset=data[:8] if evaluating else None)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    return tpde.hf.attach(trainer, **attach) if attach is not None else trainer


def outcome(trainer: Trainer) -> dict[str, Any]:
    """What a resumed run must end with exactly as an uninterrupted one: weights, optimizer and
    scheduler state, the step and the random state."""
    return {"weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "global_step": trainer.state.global_step, "rng": torch.get_rng_state()}
