"""Checkpoint a plain PyTorch loop from an optimizer step post-hook."""

from __future__ import annotations

from typing import Any

import torch

from tpde.api import Checkpointer, StepInfo
from tpde.errors import StepExistsError, UnsupportedError


class AttachHandle:
    """Returned by ``attach``: saves every N optimizer steps until ``remove()`` is called."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpointer: Checkpointer, every_n_steps: int, step: int) -> None:
        self.model, self.optimizer, self.checkpointer = model, optimizer, checkpointer
        self.every_n_steps, self.step = every_n_steps, step
        self.saved: list[StepInfo] = []
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self.step % self.every_n_steps == 0:
            self.save_now()

    def save_now(self) -> StepInfo:
        """Save ``{model, optimizer, step}`` as the current optimizer step."""
        info = self.checkpointer.save(self.step, {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        })
        self.saved.append(info)
        return info

    def remove(self) -> None:
        """Stop saving and release the run's writer lease; the run and its steps stay."""
        self._hook.remove()
        self.checkpointer.close()


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: str, *,
           every_n_steps: int, step: int = 0, resume: bool = False,
           checkpointer: Checkpointer | None = None, **options: Any) -> AttachHandle:
    """Save ``{model, optimizer, step}`` to ``run`` every ``every_n_steps`` optimizer steps.

    With ``resume=True`` the latest step of the run is loaded into ``model`` and ``optimizer``
    first, the step counter continues from it, and the next save is a delta against it.
    ``options`` go to ``Checkpointer`` (``keyframe_every``, ``storage_options``, ...).
    """
    if every_n_steps < 1:
        raise ValueError("every_n_steps must be >= 1")
    ckpt = checkpointer or Checkpointer(run, **options)
    latest = ckpt.latest()
    if not resume and latest is not None and step <= latest:
        if checkpointer is None:
            ckpt.close()
        raise StepExistsError(
            f"the run already holds steps up to {latest}, and saving from step {step} would "
            f"write them again: pass resume=True to continue from step {latest}, or attach "
            "to a new run", run=ckpt.chain.url)
    if resume and latest is not None:
        state = ckpt.load(map_location=next(model.parameters()).device)
        missing = [k for k in ("model", "optimizer", "step")
                   if not isinstance(state, dict) or k not in state]
        if missing:
            if checkpointer is None:
                ckpt.close()
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise UnsupportedError(
                f"tpde.attach(resume=True) needs the step's {' and '.join(map(repr, missing))}, "
                f"and it holds only {found}: it was not saved by tpde.attach. Load it with "
                "Checkpointer.load, then attach with step= the step after it",
                run=ckpt.chain.url, step=latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    return AttachHandle(model, optimizer, ckpt, every_n_steps, step)
