"""A checkpoint that is a folder (Hugging Face's ``checkpoint-N/``): its small files as the
framework wrote them, and an entry (``entry.FOLDER_ENTRY``) naming the step that holds its large
ones, the weight files' tensors and the optimizer's state.

That step's state is ``{"model": {name: tensor}, "optimizer": <its state dict>, LAYOUT:
{"weights": {file: {"tensors": [names], "metadata": {...}}}, "optimizer": file}}``: the model's
tensors by the names its weight files give them (one dict, so ``tpde.mount`` and
``load_state_dict`` find the weights as in any checkpoint), and which file held which
(``docs/format.md`` §10). ``"optimizer"`` is absent where the framework saved no optimizer.
``write_plain`` writes the folder back as the framework would have written it.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from tpde.entries.entry import FOLDER_ENTRY
from tpde.errors import TPDEError
from tpde.state import tree

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


def is_folder_state(skeleton: Any) -> bool:
    """Whether a step's skeleton is a folder checkpoint's."""
    return LAYOUT in tree.keys(skeleton)


def write_plain(state: dict[str, Any], out: str, source: str | None = None) -> list[str]:
    """Write the folder checkpoint ``state`` into the folder ``out`` as the framework would
    have: every file of ``source`` (the checkpoint folder, when there is one) but its entry,
    each weight file as safetensors with its metadata, and the optimizer's state with
    ``torch.save``. Returns the files written, by name.

    Example:
        >>> write_plain(tpde.load_checkpoint("out/checkpoint-10"), "plain/checkpoint-10",
        ...             source="out/checkpoint-10")
    """
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    written = []
    if source is not None:
        for name in sorted(os.listdir(source)):
            if name != FOLDER_ENTRY and os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(out, name))
                written.append(name)
    layout = state[LAYOUT]
    for file, spec in layout["weights"].items():
        save_file({n: state["model"][n].contiguous() for n in spec["tensors"]},
                  os.path.join(out, file), metadata=spec["metadata"] or None)
        written.append(file)
    if layout.get("optimizer") and "optimizer" in state:
        torch.save(state["optimizer"], os.path.join(out, layout["optimizer"]))
        written.append(layout["optimizer"])
    return sorted(set(written))
