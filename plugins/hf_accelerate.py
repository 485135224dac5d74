"""``tpde.hf.attach(accelerator)``: Accelerate's ``save_state``/``load_state`` storing the
models' weights and the optimizers' state in one tpde chain.

Each ``save_state`` folder keeps every file Accelerate writes (schedulers, samplers, scaler,
RNG states, custom objects) and holds an entry, ``checkpoint.tpde``, in place of the weight
files (``model.safetensors``, ``pytorch_model.bin``, ``model_1.safetensors``, ...) and the first
optimizer's ``optimizer.bin``; their tensors are a step of the chain (``folder_saves``). With
automatic checkpoint naming the chain is ``project_dir/.tpde``, beside ``checkpoints/`` (whose
every entry Accelerate takes for a checkpoint); otherwise ``.tpde`` beside the first folder
saved. Folders saved elsewhere later are written as Accelerate writes them.

How it hooks in, on the accelerator object itself: while ``save_state`` runs, the files that
``accelerate.checkpointing.save`` would write into the folder are taken instead, in this thread
only; while ``load_state`` runs, the files it would read are served from the chain. FSDP,
DeepSpeed, Megatron-LM and XLA states are left to Accelerate. Accelerate's rotation
(``ProjectConfiguration(total_limit=...)``) deletes the oldest folder *before* it writes the
next, so its own peak is ``total_limit`` checkpoints: re-coding a delta whose keyframe went
would need room beyond that, so with a ``total_limit`` each step is written whole (compressed)
unless ``keyframe_every`` is given.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types
from typing import Any, Callable, Iterator

import torch

from tpde.entries import entry as entries
from tpde.entries import folder_checkpoint
from tpde.errors import TPDEError
from tpde.plugins import folder_saves, hf_folders, writers
from tpde.plugins.ledger import Ledger, SaveReport
from tpde.state import keys

#: The optimizer file a step holds (Accelerate's first optimizer); further ones stay files.
OPTIMIZER = "optimizer.bin"
_SAVER, _CHECKPOINTING = "save", "accelerate.checkpointing"


def _weights_file(name: str) -> bool:
    """Whether ``name`` is a model's weight file in a ``save_state`` folder."""
    stem, ext = os.path.splitext(name)
    base = stem.rsplit("_", 1)[0] if stem.rsplit("_", 1)[-1].isdigit() else stem
    return (base, ext) in {("model", ".safetensors"), ("pytorch_model", ".bin")}


def _stem(name: str) -> str:
    """A weight file's model, whichever format it was saved in: ``model`` for
    ``model.safetensors`` and ``pytorch_model.bin``, ``model_1`` for the second model's."""
    stem = os.path.splitext(name)[0]
    return stem.removeprefix("pytorch_")


class _Swapped:
    """``accelerate.checkpointing``'s functions, replaced while this thread saves or loads
    (another thread calling them gets the real ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def swapped(self, module: types.ModuleType, name: str,
                make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        thread = threading.get_ident()
        with self._lock:
            real = getattr(module, name)
            mine = make(real)

            def either(*args: Any, **kwargs: Any) -> Any:
                return (mine if threading.get_ident() == thread else real)(*args, **kwargs)

            setattr(module, name, either)
            try:
                yield
            finally:
                setattr(module, name, real)


_SWAPPED = _Swapped()


class AcceleratorCheckpoints:
    """An ``Accelerator``'s ``save_state`` folders in a tpde chain (``accelerator.tpde``).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        chain: where the chain lives (default: as the module's docstring says); any fsspec URL.
        storage_options: fsspec's options for the chain's store.
        async_save: save in a background thread (``save_state`` waits only for a copy of the
            state); every save is committed by ``wait``, ``close``, ``end_training`` or the
            interpreter's exit.
        max_pending: saves that may wait behind the running one before training waits.
        link_unchanged: hard-link files unchanged since the previous checkpoint folder.
        **options: the save settings, ``Checkpointer``'s (``SaveOptions`` lists them).
    """

    def __init__(self, accelerator: Any, *, chain: str | None = None,
                 storage_options: dict[str, Any] | None = None, async_save: bool = True,
                 max_pending: int = 1, link_unchanged: bool = True, **options: Any) -> None:
        self.accelerator = accelerator
        self._settings = dict(chain=chain, storage_options=storage_options,
                              async_save=async_save, max_pending=max_pending,
                              link_unchanged=link_unchanged)
        config = accelerator.project_configuration
        if config.automatic_checkpoint_naming and config.total_limit is not None:
            options.setdefault("keyframe_every", 1)  # see the module's docstring
        self._options = options
        folder_saves.options_of(options, "tpde.hf.attach")  # bad settings fail here
        if max_pending < 0:
            raise ValueError("max_pending must be >= 0")
        self.saves: folder_saves.FolderSaves | None = None

    # ------------------------------------------------------------------ what users read
    @property
    def reports(self) -> list[SaveReport]:
        """Every save's report, in the order they were committed."""
        return self.saves.reports if self.saves is not None else []

    @property
    def ledger(self) -> Ledger | None:
        return self.saves.ledger if self.saves is not None else None

    def wait(self) -> None:
        """Block until queued saves are done; raise the first that failed."""
        if self.saves is not None:
            self.saves.wait()

    def close(self) -> None:
        """Wait for every save, free what removed checkpoints still hold and give up the
        writer lease (``end_training`` does this too)."""
        if self.saves is not None:
            self.saves.close()

    def run_for(self) -> writers.Run:
        """This process's writer of the chain (after the first ``save_state``)."""
        if self.saves is None:
            raise TPDEError("nothing was saved through this accelerator yet")
        return self.saves.run_for()

    def last_checkpoint(self) -> str | None:
        """The newest ``checkpoints/checkpoint_<n>`` folder a resume can read (automatic
        naming), or None."""
        acc = self.accelerator
        if not acc.project_configuration.automatic_checkpoint_naming:
            return None
        return hf_folders.last_checkpoint(os.path.join(acc.project_dir, "checkpoints"),
                                          hf_folders.ACCELERATE_CHECKPOINT,
                                          hf_folders.ACCELERATE_STATE)

    # ------------------------------------------------------------------ where a run lives
    def _root(self, output_dir: str | None) -> tuple[str, str]:
        """The folder that holds the checkpoint folders of a save into ``output_dir``, and
        the chain's default URL."""
        acc = self.accelerator
        if acc.project_configuration.automatic_checkpoint_naming:
            project = os.path.abspath(acc.project_dir)
            return os.path.join(project, "checkpoints"), os.path.join(project, entries.CHAIN_DIR)
        root = os.path.dirname(os.path.abspath(os.path.expanduser(str(output_dir))))
        return root, os.path.join(root, entries.CHAIN_DIR)

    def _saves_for(self, output_dir: str | None) -> folder_saves.FolderSaves | None:
        """The saves of the run a save into ``output_dir`` belongs to; None for a folder
        outside it (written as Accelerate writes it)."""
        root, chain = self._root(output_dir)
        if self.saves is None:
            self.saves = folder_saves.FolderSaves(root, self._settings["chain"] or chain,
                                     self._settings["storage_options"],
                                     async_save=self._settings["async_save"],
                                     max_pending=self._settings["max_pending"],
                                     link_unchanged=self._settings["link_unchanged"],
                                     options=self._options, who="tpde.hf.attach",
                                     pattern=hf_folders.ACCELERATE_CHECKPOINT)
        return self.saves if root == self.saves.output_dir else None

    def _plain(self) -> bool:
        """Whether Accelerate saves plain files here (not FSDP, DeepSpeed, Megatron-LM, XLA)."""
        kind = str(self.accelerator.distributed_type).rsplit(".", 1)[-1]
        return kind not in {"FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}

    # ------------------------------------------------------------------ saving
    def save_state(self, original: Callable[..., Any], output_dir: str | None = None,
                   *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.save_state`` with the weight files and the first optimizer's state
        taken, then saved as one step of the chain."""
        saves = self._saves_for(output_dir) if self._plain() else None
        if saves is None:
            return original(output_dir, *args, **kwargs)
        saves.raise_deferred()
        weights: dict[str, folder_checkpoint.WeightFile] = {}
        taken: dict[str, Any] = {}
        module = importlib.import_module(_CHECKPOINTING)
        from accelerate.state import PartialState
        from accelerate.utils.other import clean_state_dict_for_safetensors

        def make(real: Callable[..., Any]) -> Callable[..., Any]:
            def save(obj: Any, f: Any, save_on_each_node: bool = False,
                     safe_serialization: bool = False) -> None:
                state = PartialState()
                name, folder = os.path.basename(str(f)), os.path.dirname(os.path.abspath(str(f)))
                writes_here = state.is_main_process and not save_on_each_node
                if writes_here and _weights_file(name) and isinstance(obj, dict):
                    tensors = dict(clean_state_dict_for_safetensors(obj)
                                   if safe_serialization else obj)
                    if not any(tensors.keys() & w[0].keys() for w in weights.values()):
                        weights[name] = (tensors, {"format": "pt"} if safe_serialization
                                         else None)
                        taken["folder"] = folder
                        return
                elif writes_here and name == OPTIMIZER:
                    taken["optimizer"], taken["folder"] = obj, folder
                    return
                real(obj, f, save_on_each_node=save_on_each_node,
                     safe_serialization=safe_serialization)
            return save

        with saves.writing(), _SWAPPED.swapped(module, _SAVER, make):
            location = original(output_dir, *args, **kwargs)
        if "folder" in taken:
            state = folder_checkpoint.state_of(weights, taken.get("optimizer"), OPTIMIZER)
            acc = self.accelerator
            saves.save(taken["folder"], state, {"step": int(acc.step),
                                                "iteration": int(acc.save_iteration) - 1})
        return location

    # ------------------------------------------------------------------ loading
    def load_state(self, original: Callable[..., Any], input_dir: str | None = None,
                   **kwargs: Any) -> Any:
        """``Accelerator.load_state``: the files a folder's entry stands for are read from
        the chain; with automatic naming and no ``input_dir``, the newest folder whose save
        committed is loaded."""
        if input_dir is None and self._plain():
            input_dir = self.last_checkpoint()
            if input_dir is None and self.accelerator.project_configuration \
                    .automatic_checkpoint_naming:
                raise ValueError("no checkpoint to load in "
                                 f"{os.path.join(self.accelerator.project_dir, 'checkpoints')}")
        if input_dir is None or not self._plain():
            return original(input_dir, **kwargs)
        folder = os.path.abspath(os.path.expanduser(str(input_dir)))
        saves = self._saves_for(folder)
        at = folder_saves.entry_at(folder, self._settings["storage_options"])
        if at is None:
            return original(input_dir, **kwargs)
        state = saves.load(at, resuming=self.accelerator.is_main_process) \
            if saves is not None else folder_saves.read(at)
        files, _ = folder_checkpoint.files_of(state)
        served = {_stem(name): tensors for name, (tensors, _) in files.items()}
        models = list(self.accelerator._models)
        for i, model in enumerate(models):  # a tied weight saved once, under both its names
            stem = "model" if i == 0 else f"model_{i}"
            if stem in served:
                served[stem] = _with_ties(served[stem], model)
        module = importlib.import_module(_CHECKPOINTING)

        def make(real: Callable[..., Any]) -> Callable[..., Any]:
            def load(f: Any, map_location: Any = None, **more: Any) -> Any:
                name = os.path.basename(str(f))
                if os.path.dirname(os.path.abspath(str(f))) == folder:
                    if _weights_file(name) and _stem(name) in served:
                        return served[_stem(name)]
                    if name == OPTIMIZER and state.get("optimizer") is not None:
                        return state["optimizer"]
                return real(f, map_location=map_location, **more)
            return load

        with _SWAPPED.swapped(module, "load", make):
            return original(input_dir, **kwargs)

    def end_training(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.end_training``: every save is committed first."""
        self.close()
        return original(*args, **kwargs)


def _with_ties(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """``weights`` with each of ``model``'s tied weights that was saved under one name only
    (Accelerate's safetensors files hold a shared tensor once) under its other names too."""
    out = dict(weights)
    for name, others in keys.tied(model.state_dict(keep_vars=True)).items():
        alias = next((o for o in others if o in out), None)
        if name not in out and alias is not None:
            out[name] = out[alias]
    return out


#: The ``Accelerator`` methods ``attach`` wraps, and the method each goes through.
HOOKS = {"save_state": "save_state", "load_state": "load_state",
         "end_training": "end_training"}
