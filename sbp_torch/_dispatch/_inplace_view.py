"""In-place view ops (``squeeze_``, ``transpose_``, ...): they change the shape of ``self`` itself. The
out-of-place view runs as any op; its part and metadata then move into ``self``, whose wrapper is
restrided to the new logical shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._tensor import GlobalTensor
from ._bound import BoundCall

aten = torch.ops.aten


def out_of_place(func):
    """The view op with the arguments of in-place ``func`` (``transpose_.default`` → ``transpose.int``), or None."""
    packet = getattr(aten, func._schema.name.split("::")[1].rstrip("_"), None)
    signature = [(a.name, str(a.type)) for a in func._schema.arguments]
    for name in packet.overloads() if packet is not None else ():
        overload = getattr(packet, name)
        if [(a.name, str(a.type)) for a in overload._schema.arguments] == signature:
            return overload
    return None


@dataclass(frozen=True)
class InplaceView:
    """An in-place view op and the out-of-place view it runs (see the module docstring)."""

    func: object
    view: object
    dispatch_one: Callable  # (BoundCall) -> (result, cache entry) of one call
    as_is = False

    @staticmethod
    def of(bound: BoundCall, dispatch_one) -> InplaceView:
        view = out_of_place(bound.func)
        if view is None or not isinstance(bound.args[0], GlobalTensor):
            raise NotImplementedError(f"sbp_torch: {bound.func} on a global tensor is not supported")
        return InplaceView(bound.func, view, dispatch_one)

    def run(self, func, args, kwargs):
        self_ = args[0]
        result, _ = self.dispatch_one(BoundCall(self.view, args, kwargs))
        self_._local, self_._meta = result._local, result._meta
        with torch._C._DisableTorchDispatch():  # set the wrapper's own sizes; no data to move
            torch.Tensor.as_strided_(self_, result.shape, result.stride())
        return self_
