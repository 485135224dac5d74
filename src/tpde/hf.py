"""Hugging Face's ``Trainer`` (and TRL's trainers built on it) with tpde checkpoints:
``trainer = tpde.hf.attach(Trainer(...))``; see ``docs/hf.md``."""

from tpde.plugins.hf import Checkpoints, attach

__all__ = ["Checkpoints", "attach"]
