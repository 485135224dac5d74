"""Checkpoint a plain PyTorch loop from an optimizer step post-hook."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from tpde.api import Checkpointer, StepInfo
from tpde.errors import StepExistsError, UnsupportedError


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's random states (CUDA's where it is in use), as tensors and
    plain values: a step holding them loads without ``trusted=True``."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``rng_state`` took."""
    py, nps = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((nps["kind"], nps["keys"].cpu().numpy().astype(np.uint32), nps["pos"],
                         nps["has_gauss"], nps["cached"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


class AttachHandle:
    """Returned by ``attach``: saves every N optimizer steps until ``remove()`` is called.

    With a scheduler or a scaler, step N is saved as the loop goes on from it: the loop steps
    them after ``optimizer.step()``, so the save waits for the next optimizer step to begin
    (or for ``save_now()`` / ``remove()``), with the model's buffers and the random states as
    they were at step N (a forward since may have changed batch-norm statistics and drawn
    numbers)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpointer: Checkpointer, every_n_steps: int, step: int, *,
                 scheduler: Any = None, scaler: Any = None, rng: bool = True) -> None:
        self.model, self.optimizer, self.checkpointer = model, optimizer, checkpointer
        self.every_n_steps, self.step = every_n_steps, step
        self.scheduler, self.scaler, self.rng = scheduler, scaler, rng
        self.saved: list[StepInfo] = []
        #: A step taken, to be saved once the scheduler and scaler have stepped: its buffers
        #: and random states as they were.
        self._due: tuple[dict[str, torch.Tensor], dict[str, Any] | None] | None = None
        #: Whether a step is saved at the next step's start, once the scheduler and scaler
        #: have stepped, rather than at once.
        self._deferred = scheduler is not None or scaler is not None
        self._hooks = [optimizer.register_step_post_hook(self._after_step)]
        if self._deferred:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self.step % self.every_n_steps:
            return
        if not self._deferred:
            self.save_now()
            return
        buffers = {n for n, _ in self.model.named_buffers()}
        self._due = ({k: v.clone() for k, v in self.model.state_dict().items() if k in buffers},
                     rng_state() if self.rng else None)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._due is not None:
            self.save_now()

    def _state(self) -> dict[str, Any]:
        buffers, rng = self._due if self._due is not None else \
            ({}, rng_state() if self.rng else None)
        weights = self.model.state_dict()  # an OrderedDict with its _metadata: kept so
        weights.update(buffers)
        state: dict[str, Any] = {"model": weights, "optimizer": self.optimizer.state_dict(),
                                 "step": self.step}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if rng is not None:
            state["rng"] = rng
        return state

    def save_now(self) -> StepInfo:
        """Save the current optimizer step: ``model``, ``optimizer``, ``step``, and the
        ``scheduler``, ``scaler`` and random states where attached."""
        info = self.checkpointer.save(self.step, self._state())
        self._due = None
        self.saved.append(info)
        return info

    def remove(self) -> None:
        """Save a step still due, stop saving and release the run's writer lease; the run and
        its steps stay."""
        if self._due is not None:
            self.save_now()
        for hook in self._hooks:
            hook.remove()
        self.checkpointer.close()


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: str, *,
           every_n_steps: int, step: int = 0, resume: bool = False, scheduler: Any = None,
           scaler: Any = None, rng: bool = True, checkpointer: Checkpointer | None = None,
           **options: Any) -> AttachHandle:
    """Save a plain loop's state to ``run`` every ``every_n_steps`` optimizer steps, so that a
    resumed loop goes on as if it had never stopped.

    Args:
        model, optimizer: saved as ``model`` and ``optimizer`` (their ``state_dict()``).
        run: the chain's location (a path or an fsspec URL).
        every_n_steps: optimizer steps between saves.
        step: the optimizer steps taken before this call.
        resume: load the run's latest step into everything attached first, and count steps
            on from it; the next save is a delta against it.
        scheduler, scaler: an LR scheduler and a ``torch.amp.GradScaler``, saved and resumed
            with the rest (anything with ``state_dict``/``load_state_dict``).
        rng: save Python's, NumPy's and torch's random states too (CUDA's where in use).
        checkpointer: a ``Checkpointer`` to save through, instead of one made here.
        options: ``Checkpointer``'s (``keyframe_every``, ``storage_options``, ...).

    Returns:
        The handle: ``save_now()``, ``remove()``, ``saved`` (each save's ``StepInfo``).

    Example:
        >>> handle = tpde.attach(model, opt, "runs/exp1", every_n_steps=100,
        ...                      scheduler=sched, scaler=scaler)
        >>> ...  # the loop: opt.step() (or scaler.step(opt)), scaler.update(), sched.step()
        >>> handle.remove()
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
        wanted = ["model", "optimizer", "step"] + \
            [k for k, v in (("scheduler", scheduler), ("scaler", scaler)) if v is not None]
        missing = [k for k in wanted if not isinstance(state, dict) or k not in state]
        if missing:
            if checkpointer is None:
                ckpt.close()
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise UnsupportedError(
                f"tpde.attach(resume=True) needs the step's {' and '.join(map(repr, missing))}, "
                f"and it holds only {found}: it was not saved by tpde.attach with them. Load "
                "it with Checkpointer.load, then attach with step= the step after it",
                run=ckpt.chain.url, step=latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for part, name in ((scheduler, "scheduler"), (scaler, "scaler")):
            if part is not None:
                part.load_state_dict(state[name])
        if rng and "rng" in state:
            set_rng_state(state["rng"])
        step = int(state["step"])
    return AttachHandle(model, optimizer, ckpt, every_n_steps, step, scheduler=scheduler,
                        scaler=scaler, rng=rng)
