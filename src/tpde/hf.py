"""Hugging Face's ``Trainer`` (and TRL's trainers built on it) and Accelerate's
``save_state``/``load_state`` with tpde checkpoints: ``trainer = tpde.hf.attach(Trainer(...))``,
``accelerator = tpde.hf.attach(Accelerator(...))``; see ``docs/hf.md``."""

from tpde.plugins.hf import AcceleratorCheckpoints, Checkpoints, attach

__all__ = ["AcceleratorCheckpoints", "Checkpoints", "attach"]
