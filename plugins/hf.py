"""``tpde.hf.attach``: Hugging Face's ``Trainer``, and every trainer built on it (TRL's
``SFTTrainer``, ...), storing its checkpoints' weights and optimizer state in one tpde chain.

Each ``checkpoint-N/`` folder keeps every small file as the ``Trainer`` writes it (config,
tokenizer, ``trainer_state.json``, scheduler, RNG states, adapter config) and holds an entry,
``checkpoint.tpde``, in place of the weight files and ``optimizer.pt``; their tensors are a step
of the chain in ``output_dir/.tpde`` (``entries.folder_checkpoint`` has the step's layout).

How it hooks in, on the trainer object itself (so that it works whatever else a subclass
overrides): while ``_save_checkpoint`` runs, the weight files that ``save_pretrained`` (or the
``Trainer``, or PEFT) would write are taken instead of written, in this thread only, as is the
optimizer's state; the rest of the checkpoint is written as before. The step is then saved
in the background, and the steps of folders that the ``Trainer``'s rotation deleted are hidden
and freed (``folder_saves``). Resuming,
``load_best_model_at_end`` and ``train(resume_from_checkpoint=True)`` read the entry; a
checkpoint without one (a plain Hugging Face checkpoint) is read by the ``Trainer`` as always.
DeepSpeed, FSDP, XLA and SageMaker checkpoints are left to the ``Trainer``: nothing of theirs is
taken.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tpde.entries import entry as entries
from tpde.entries import folder_checkpoint
from tpde.errors import TPDEError
from tpde.plugins import hf_folders, writers
from tpde.plugins.folder_saves import FolderSaves
from tpde.plugins.hf_accelerate import HOOKS as ACCELERATOR_HOOKS
from tpde.plugins.hf_accelerate import AcceleratorCheckpoints
from tpde.plugins.ledger import Ledger, SaveReport

#: The functions that write a weight file, by module: the ``Trainer``'s own (a model that is
#: not a ``PreTrainedModel``), ``save_pretrained``'s, and PEFT's.
WRITERS = (("safetensors.torch", "save_file"), ("transformers.modeling_utils", "safe_save_file"),
           ("peft.peft_model", "safe_save_file"))
#: The ``Trainer``'s file names.
OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"


@dataclass
class _Taken:
    """What one ``_save_checkpoint`` handed over instead of writing."""

    weights: dict[str, folder_checkpoint.WeightFile] = field(default_factory=dict)
    optimizer: Any = None
    folder: str | None = None


class _Hooked:
    """The weight-file writers of ``WRITERS``, replaced while a checkpoint is saved: a file
    that the saving thread writes into the checkpoint folder is taken, any other is written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taking(self, folder: str, taken: _Taken) -> Iterator[None]:
        thread, folder = threading.get_ident(), os.path.abspath(folder)
        replaced = []
        with self._lock:
            for module, name in WRITERS:
                mod = sys.modules.get(module)
                real = getattr(mod, name, None)
                if real is None:
                    continue

                def take(tensors: dict[str, torch.Tensor], filename: str,
                         metadata: dict[str, str] | None = None, *, _real: Callable = real
                         ) -> None:
                    path = os.path.abspath(str(filename))
                    if threading.get_ident() != thread or os.path.dirname(path) != folder:
                        return _real(tensors, filename, metadata=metadata)
                    taken.weights[os.path.basename(path)] = (dict(tensors), metadata)

                setattr(mod, name, take)
                replaced.append((mod, name, real))
            try:
                yield
            finally:
                for mod, name, real in replaced:
                    setattr(mod, name, real)


_HOOKED = _Hooked()


def _trainer_module() -> types.ModuleType:
    return importlib.import_module("transformers.trainer")


def _plain(trainer: Any) -> bool:
    """Whether the ``Trainer`` saves plain files, which tpde takes over (not DeepSpeed, FSDP,
    XLA or SageMaker checkpoints)."""
    utils = importlib.import_module("transformers.utils")
    return not (getattr(trainer, "is_deepspeed_enabled", False)
                or getattr(trainer, "is_fsdp_enabled", False)
                or utils.is_torch_xla_available() or utils.is_sagemaker_mp_enabled())


class Checkpoints:
    """A ``Trainer``'s checkpoints in a tpde chain (``trainer.tpde`` after ``attach``).

    Args:
        trainer: the ``transformers.Trainer`` (or subclass) whose checkpoints these are.
        chain: where the chain lives (default: ``.tpde`` in the trainer's ``output_dir``); any
            fsspec URL. The ``checkpoint-N/`` folders stay in ``output_dir``.
        storage_options: fsspec's options for the chain's store.
        async_save: save in a background thread while training goes on (the training thread
            waits only for a copy of the state).
        max_pending: saves that may wait behind the running one before training waits.
        link_unchanged: make each file that is byte for byte the previous checkpoint's (config,
            tokenizer, ...) a hard link to it, so that it is held once (``hf_folders``).
        **options: the save settings, ``Checkpointer``'s (``SaveOptions`` lists them).
    """

    def __init__(self, trainer: Any, *, chain: str | None = None,
                 storage_options: dict[str, Any] | None = None, async_save: bool = True,
                 max_pending: int = 1, link_unchanged: bool = True, **options: Any) -> None:
        output_dir = os.path.abspath(trainer.args.output_dir)
        self.saves = FolderSaves(output_dir, chain or os.path.join(output_dir, entries.CHAIN_DIR),
                                 storage_options, async_save=async_save, max_pending=max_pending,
                                 link_unchanged=link_unchanged, options=options,
                                 who="tpde.hf.attach")
        self.trainer = trainer
        self.output_dir = output_dir
        self._taken: _Taken | None = None
        self._resumed: tuple[str, Any] | None = None  # a resume's optimizer state, by folder

    # ------------------------------------------------------------------ what users read
    @property
    def reports(self) -> list[SaveReport]:
        """Every save's report, in the order they were committed."""
        return self.saves.reports

    @property
    def ledger(self) -> Ledger:
        """The saves' reports and the bytes at rest and freed, as the Lightning plugin's."""
        return self.saves.ledger

    def wait(self) -> None:
        """Block until queued saves are done; raise the first that failed."""
        self.saves.wait()

    def close(self) -> None:
        """Wait for every save, free what removed checkpoints still hold and give up the
        writer lease (``train`` does this as it returns)."""
        self.saves.close()

    def run_for(self) -> writers.Run:
        """This process's writer of the chain, which this trainer uses until ``close``."""
        return self.saves.run_for()

    def last_checkpoint(self) -> str | None:
        """The newest ``checkpoint-N`` folder a resume can read (``hf_folders``)."""
        return hf_folders.last_checkpoint(self.output_dir)

    # ------------------------------------------------------------------ saving
    def save_checkpoint(self, original: Callable[..., Any], model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint`` with the weights and the optimizer's state taken, then
        saved as one step of the chain."""
        self.saves.raise_deferred()
        t = self.trainer
        # A step saved again writes into its folder: no other checkpoint may change with it.
        hf_folders.unshare(os.path.join(t._get_output_dir(trial=trial),
                                        f"checkpoint-{t.state.global_step}"))
        taken = self._taken = _Taken()
        try:
            with self.saves.writing():
                original(model, trial)
        finally:
            self._taken = None
        if taken.folder is None or not (taken.weights or taken.optimizer is not None):
            return  # nothing taken: a checkpoint the Trainer wrote in full
        state = folder_checkpoint.state_of(taken.weights, taken.optimizer, OPTIMIZER)
        self.saves.save(taken.folder, state, {"global_step": int(t.state.global_step),
                                              "epoch": t.state.epoch})

    def save_weights(self, original: Callable[..., Any], output_dir: str | None = None,
                     state_dict: Any = None) -> None:
        """``Trainer._save``: within a checkpoint, its weight files are taken."""
        taken = self._taken
        if taken is None or not self.trainer.args.should_save or not _plain(self.trainer):
            return original(output_dir, state_dict)
        folder = output_dir if output_dir is not None else self.trainer.args.output_dir
        taken.folder = os.path.abspath(folder)
        with _HOOKED.taking(folder, taken):
            return original(output_dir, state_dict)

    def save_optimizer(self, original: Callable[..., Any], output_dir: str) -> None:
        """``Trainer._save_optimizer_and_scheduler``: within a checkpoint, the optimizer's
        state is taken; the scheduler's is written as the ``Trainer`` writes it."""
        taken, t = self._taken, self.trainer
        if taken is None or not t.args.should_save or not _plain(t):
            return original(output_dir)
        taken.folder = os.path.abspath(output_dir)
        taken.optimizer = t.optimizer.state_dict()
        with warnings.catch_warnings(record=True) as caught:
            torch.save(t.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))
        importlib.import_module("transformers.trainer_pt_utils").reissue_pt_warnings(caught)

    # ------------------------------------------------------------------ loading
    def load_weights(self, original: Callable[..., Any], checkpoint: str,
                     model: Any = None) -> None:
        """``Trainer._load_from_checkpoint``: a checkpoint with an entry is read from the chain
        (by this process's writer, so that the next save is a delta against it)."""
        at = self.saves.entry_at(checkpoint)
        if at is None or not _plain(self.trainer):
            return original(checkpoint, model)
        state = self.saves.load(at, resuming=self.trainer.args.should_save)
        self._resumed = (os.path.abspath(checkpoint), state.get("optimizer"))
        self._apply(model if model is not None else self.trainer.model, state["model"])

    def load_optimizer(self, original: Callable[..., Any], checkpoint: str | None) -> None:
        """``Trainer._load_optimizer_and_scheduler``: the optimizer's state from the chain,
        the scheduler's from its file, as the ``Trainer`` loads both (only where both are)."""
        resumed, self._resumed = self._resumed, None
        if checkpoint is None or not _plain(self.trainer):
            return original(checkpoint)
        if resumed is not None and resumed[0] == os.path.abspath(str(checkpoint)):
            optimizer = resumed[1]  # read with the weights: the entry is not read again
        else:
            at = self.saves.entry_at(checkpoint)
            if at is None:
                return original(checkpoint)
            optimizer = self.saves.load(at, resuming=False, within="optimizer")
        scheduler = os.path.join(str(checkpoint), SCHEDULER)
        if optimizer is None or not os.path.isfile(scheduler):
            return  # the Trainer loads neither then
        t = self.trainer
        t.optimizer.load_state_dict(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            t.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        importlib.import_module("transformers.trainer_pt_utils").reissue_pt_warnings(caught)

    def load_best(self, original: Callable[..., Any]) -> None:
        """``Trainer._load_best_model``: the best checkpoint's weights from the chain. Every
        save commits first: the ``Trainer`` deletes checkpoints right after this returns."""
        self.saves.wait()
        at = self.saves.entry_at(self.trainer.state.best_model_checkpoint)
        if at is None or not _plain(self.trainer):
            return original()
        self._apply(self.trainer.model, self.saves.load(at, resuming=False, within="model"))

    def _apply(self, model: Any, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` into ``model`` as the ``Trainer`` loads a weight file: an adapter
        into a PEFT model's active adapter, else ``load_state_dict(..., strict=False)``."""
        if _trainer_module()._is_peft_model(model):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, weights, adapter_name=model.active_adapters[0])
            return
        self.trainer._issue_warnings_after_load(model.load_state_dict(weights, False))

    def train(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``: ``resume_from_checkpoint=True`` resumes from the newest
        checkpoint whose save committed; every save is committed when it returns."""
        if _plain(self.trainer):  # else the Trainer finds its own checkpoints
            if args and args[0] is True:
                args = (self._resume_point(), *args[1:])
            elif kwargs.get("resume_from_checkpoint") is True:
                kwargs["resume_from_checkpoint"] = self._resume_point()
        try:
            out = original(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(BaseException):  # the training error is the one to see
                self.close()
            raise
        self.close()
        return out

    def _resume_point(self) -> str:
        found = self.last_checkpoint()
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({self.output_dir})")
        return found


#: The ``Trainer`` methods ``attach`` wraps, and the ``Checkpoints`` method each goes through.
HOOKS = {"_save_checkpoint": "save_checkpoint", "_save": "save_weights",
         "_save_optimizer_and_scheduler": "save_optimizer",
         "_load_from_checkpoint": "load_weights",
         "_load_optimizer_and_scheduler": "load_optimizer", "_load_best_model": "load_best",
         "train": "train"}


def attach(trainer: Any, **settings: Any) -> Any:
    """Store the checkpoints of a ``Trainer`` or an ``Accelerator`` in a tpde chain; returns
    the object.

    Works for ``transformers.Trainer`` and its subclasses (TRL's ``SFTTrainer``, ...),
    whatever else they override, and for ``accelerate.Accelerator``'s ``save_state`` and
    ``load_state``: the hooks wrap the object's own methods. ``save_model()`` and
    ``push_to_hub()`` still write plain Hugging Face files.

    Args:
        trainer: the trainer (before ``train``) or the accelerator.
        **settings: ``Checkpoints``' (``chain``, ``storage_options``, ``async_save``,
            ``max_pending``, ``link_unchanged``) and the save settings of ``Checkpointer``.

    Returns:
        ``trainer``, with ``trainer.tpde`` (its ``Checkpoints``, or for an accelerator its
        ``AcceleratorCheckpoints``: reports, ``wait``).

    Example:
        >>> trainer = tpde.hf.attach(Trainer(model, args, train_dataset=data))
        >>> trainer.train()
        >>> trainer.train(resume_from_checkpoint=True)  # in a later run
        >>> accelerator = tpde.hf.attach(Accelerator(project_config=config))
    """
    if isinstance(getattr(trainer, "tpde", None), (Checkpoints, AcceleratorCheckpoints)):
        raise TPDEError("this object is attached already; attach it once")
    accelerate = sys.modules.get("accelerate")
    if accelerate is not None and isinstance(trainer, accelerate.Accelerator):
        hooks: Any = AcceleratorCheckpoints(trainer, **settings)
        wrapped = ACCELERATOR_HOOKS
    else:
        hooks, wrapped = Checkpoints(trainer, **settings), HOOKS
    for name, through in wrapped.items():
        original = getattr(trainer, name)
        setattr(trainer, name, types.MethodType(_hooked(getattr(hooks, through), original),
                                                trainer))
    trainer.tpde = hooks
    return trainer


def _hooked(through: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def hooked(_trainer: Any, *args: Any, **kwargs: Any) -> Any:
        return through(original, *args, **kwargs)

    hooked.__doc__ = through.__doc__
    return hooked


__all__ = ["AcceleratorCheckpoints", "Checkpoints", "attach"]
