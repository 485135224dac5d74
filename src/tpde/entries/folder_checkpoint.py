"""A checkpoint that is a folder (Hugging Face's ``checkpoint-N/``): its small files as the
framework wrote them, and an entry (``entry.FOLDER_ENTRY``) naming the step that holds its large
ones, the weight files' tensors and the optimizer's state.

That step's state is ``{"model": {name: tensor}, "optimizer": <its state dict>, LAYOUT:
{"weights": {file: {"tensors": [names], "metadata": {...}}}, "optimizer": file}}``: the model's
tensors by the names its weight files give them (one dict, so ``tpde.mount`` and
``load_state_dict`` find the weights as in any checkpoint), and which file held which.
``"optimizer"`` is absent where the framework saved no optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from tpde.errors import TPDEError

#: The state's key for where each tensor came from.
LAYOUT = "checkpoint_folder"

#: A weight file as the framework handed it over: its tensors, and its header's metadata.
WeightFile = tuple[dict[str, torch.Tensor], dict[str, str] | None]


def state_of(weights: dict[str, WeightFile], optimizer: Any | None,
             optimizer_file: str) -> dict[str, Any]:
    """The state a folder checkpoint's step stores, from the weight files (by file name) and
    the optimizer's state dict (None: not saved)."""
    model: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for file, (tensors, metadata) in weights.items():
        clash = model.keys() & tensors.keys()
        if clash:
            raise TPDEError(f"the weight files name tensor {sorted(clash)[0]!r} twice ({file} "
                            "and another); this checkpoint cannot be stored as one model")
        model.update(tensors)
        layout[file] = {"tensors": list(tensors), "metadata": dict(metadata or {})}
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        state["optimizer"] = optimizer
    state[LAYOUT] = {"weights": layout, "optimizer": optimizer_file if optimizer is not None
                     else None}
    return state
