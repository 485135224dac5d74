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

import os
import shutil
from typing import Any

import torch

from tpde.entries.entry import FOLDER_ENTRY
from tpde.errors import TPDEError
from tpde.store import store

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
    """Whether a step's skeleton is a folder checkpoint's (``state_of``'s layout)."""
    return isinstance(skeleton, dict) and LAYOUT in skeleton


def files_of(state: dict[str, Any]) -> tuple[dict[str, WeightFile], str | None]:
    """``state_of``'s inverse: the weight files by name, as they were handed over, and the
    optimizer's file name (None: no optimizer was saved)."""
    layout = state[LAYOUT]
    model = state["model"]
    weights = {file: ({name: model[name] for name in part["tensors"]}, part["metadata"] or None)
               for file, part in layout["weights"].items()}
    return weights, layout.get("optimizer")


def _ours(name: str) -> bool:
    """Whether a file of a checkpoint folder is tpde's: the entry, its temporary files, and
    what tpde's plugins name ``.tpde*`` while they write."""
    return name == FOLDER_ENTRY or name.startswith((f"{FOLDER_ENTRY}.", ".tpde"))


def write_plain(state: dict[str, Any], source: str | None, output: str,
                storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write a plain checkpoint folder at ``output`` (a new folder, made whole or not at all):
    the weight files (safetensors, or ``torch.save`` for a ``.bin`` one) and the optimizer's
    file from ``state``, and every other file of the
    checkpoint folder ``source`` (an fsspec URL; None: none) as it is there. The names of the
    files written, in order.
    """
    from safetensors.torch import save_file

    weights, optimizer_file = files_of(state)
    partial = f"{output.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    written: list[str] = []
    try:
        if source is not None:
            folder = store.Store(source, storage_options)
            for found in folder.contents("")[0]:
                name = found.path
                if not _ours(name):
                    with open(os.path.join(partial, name), "wb") as f:
                        f.write(folder.read(name, found.size))
                    written.append(name)
        for file, (tensors, metadata) in weights.items():
            if file.endswith(".safetensors"):
                save_file({k: v.contiguous() for k, v in tensors.items()},
                          os.path.join(partial, file), metadata=metadata)
            else:  # a torch.save weight file (``pytorch_model.bin``)
                torch.save(tensors, os.path.join(partial, file))
            written.append(file)
        if optimizer_file is not None:
            torch.save(state["optimizer"], os.path.join(partial, optimizer_file))
            written.append(optimizer_file)
        os.rename(partial, output)  # an empty folder at ``output`` is replaced, else refused
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return written
