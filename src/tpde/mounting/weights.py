"""A mounted model's weights in place: decoded tensors set on their modules as read-only
parameters and buffers, placeholders (meta tensors) put back when they are let go, and a write
in place since the mount set them refused."""

from __future__ import annotations

import torch

from tpde.errors import TPDEError
from tpde.mounting import slots


class Weights:
    """Sets and takes back the tensors of a mount's units (``slots.Layout.units``).

    Args:
        run: the run's URL, for errors.
        step: the mounted step, for errors.
        model: the mounted model.
        units: each unit's tensors and where they live.
        side: the stream decodes ahead are made on (CUDA), or None.
    """

    def __init__(self, run: str, step: int, model: torch.nn.Module,
                 units: dict[str, list[slots.Owned]], *, side: torch.cuda.Stream | None) -> None:
        self.run, self.step, self.units, self.side = run, step, units, side
        #: Each owner's module, and each tensor's placeholder, looked up and made once: every
        #: forward at budget 0 sets and releases every tensor.
        self.modules = {owner: model.get_submodule(owner)
                        for owned in units.values() for owner, *_ in owned}
        self.ghosts: dict[str, torch.Tensor] = {}
        #: Each stored dtype's dtype in the model (``model.to(torch.bfloat16)``, ``.half()``).
        self.cast: dict[torch.dtype, torch.dtype] = {}
        #: Each stored tensor's version counter as the mount left it: a write in place since
        #: is refused at the next forward (``unchanged``).
        self._versions: dict[str, int] = {}

    def assign(self, name: str, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Set unit ``name``'s decoded tensors on their modules."""
        for owner, attr, is_param, s in self.units[name]:
            module, t = self.modules[owner], tensors[s.key]
            if self.side is not None:  # made on the side stream, read on this one
                t.record_stream(torch.cuda.current_stream(device))
            if is_param:
                t = module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
            else:
                module._buffers[attr] = t
            self._versions[s.key] = t._version

    def release(self, name: str) -> None:
        """Put shape-and-dtype placeholders (meta tensors, made once) back; the weights are
        freed."""
        for owner, attr, is_param, s in self.units[name]:
            ghost = self.ghosts.get(s.key)
            if ghost is None:
                ghost = torch.empty(s.shape, dtype=self.cast.get(s.dtype, s.dtype),
                                    device="meta")
                if is_param:
                    ghost = torch.nn.Parameter(ghost, requires_grad=False)
                self.ghosts[s.key] = ghost
            if is_param:
                self.modules[owner]._parameters[attr] = ghost
            else:
                self.modules[owner]._buffers[attr] = ghost
            self._versions[s.key] = ghost._version

    def unchanged(self, name: str) -> None:
        """Refuse to compute with weights written in place since the mount set them: held
        ones would give outputs of weights the step does not hold, and placeholders' writes
        are lost at the next decode."""
        for owner, attr, is_param, s in self.units[name]:
            held = self.modules[owner]._parameters if is_param else self.modules[owner]._buffers
            t = held.get(attr)
            if t is None or t._version != self._versions.get(s.key):
                raise TPDEError(
                    f"the mounted weights are read-only, and {s.key!r} was changed in place "
                    "(or replaced): for weights of your own, load the step with "
                    "tpde.load_state_dict(run, step, model=...) instead of mounting it",
                    run=self.run, step=self.step, tensor=s.key)
