"""Boundary pins: the layout a plan fixes for the hidden state at each unit's input and output.

Inside a unit the dispatcher chooses each op's signature as it always does; at the unit's edges the plan has
decided, so the hidden state is converted there to the plan's layout (a no-op when it already has it). That
makes every unit start from the layout the planner costed it from, and the costs of units add up."""

from __future__ import annotations

import torch
from torch import nn

from .._tensor import GlobalTensor

_ATTRIBUTE = "_sbp_torch_boundary_pin"


def _pinned(x, sbp):
    if isinstance(x, GlobalTensor) and x.dim() > 0 and tuple(x.sbp) != sbp:
        return x.to_global(sbp=sbp)
    return x


class BoundaryPin:
    """Forward hooks holding a unit's hidden state (its first tensor argument, or ``hidden_states``, and its
    output or the output's first element) to ``sbp``."""

    def __init__(self, sbp: tuple):
        self.sbp = tuple(sbp)
        self.handles: list = []

    @classmethod
    def install(cls, module: nn.Module, sbp: tuple) -> BoundaryPin:
        """Pin ``module``'s edges to ``sbp``, replacing a pin installed before."""
        old = getattr(module, _ATTRIBUTE, None)
        if old is not None:
            old.remove()
        pin = cls(sbp)
        pin.handles = [
            module.register_forward_pre_hook(pin.enter, with_kwargs=True),
            module.register_forward_hook(pin.leave),
        ]
        setattr(module, _ATTRIBUTE, pin)
        return pin

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def enter(self, module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (_pinned(args[0], self.sbp), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": _pinned(kwargs["hidden_states"], self.sbp)}
        return None

    def leave(self, module, args, output):
        if isinstance(output, torch.Tensor):
            return _pinned(output, self.sbp)
        if type(output) is tuple and output and isinstance(output[0], torch.Tensor):
            return (_pinned(output[0], self.sbp), *output[1:])
        return None
