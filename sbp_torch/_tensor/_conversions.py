"""Differentiable boxing of a global tensor: to another SBP on its placement, or to another placement.
Backward boxes the gradient back to ``gradient_sbp`` of the input's layout (see ``_gradient.py``)."""

import torch

from .. import _comm as comm
from .._boxing import box_local, plan_cross, run_cross
from .._layout import GlobalMeta, partials_as_broadcast
from ._global_tensor import GlobalTensor, gradient
from ._gradient import has_extreme

_CONVERSION, _GRADIENT = "to_global to another layout", "gradient of to_global"


class _Box(torch.autograd.Function):
    @staticmethod
    @comm.naming_cause(lambda *_: _CONVERSION)
    def forward(ctx, src: GlobalTensor, dst_sbp):
        ctx.meta = src._meta
        ctx.saved_local = src._local if has_extreme(src._meta) else None
        return GlobalTensor(box_local(src._local, src._meta, dst_sbp), src._meta.with_sbp(dst_sbp))

    @staticmethod
    @comm.naming_cause(lambda *_: _GRADIENT)
    def backward(ctx, grad):
        return gradient(grad, ctx.meta, ctx.saved_local), None


class _CrossBox(torch.autograd.Function):
    """Boxing to another placement. Backward moves the gradient back across, to the input's gradient layout
    with broadcast on its partial axes, where ``gradient`` keeps tie shares."""

    @staticmethod
    @comm.naming_cause(lambda *_: _CONVERSION)
    def forward(ctx, src: GlobalTensor, dst: GlobalMeta):
        ctx.meta = src._meta
        ctx.saved_local = src._local if has_extreme(src._meta) else None
        return GlobalTensor(run_cross(src._local, plan_cross(src._meta, dst)), dst)

    @staticmethod
    @comm.naming_cause(lambda *_: _GRADIENT)
    def backward(ctx, grad):
        if not isinstance(grad, GlobalTensor):
            raise TypeError(f"expected a global gradient for a global tensor, got a plain {type(grad).__name__}")
        back = GlobalMeta(
            grad._meta.shape,
            grad._meta.dtype,
            ctx.meta.placement,
            partials_as_broadcast(ctx.meta.sbp),
            grad._meta.strides,
        )
        moved = GlobalTensor(run_cross(grad._local, plan_cross(grad._meta, back)), back)
        return gradient(moved, ctx.meta, ctx.saved_local), None


def to_sbp(x: GlobalTensor, sbp: tuple) -> GlobalTensor:
    """``x`` laid out as ``sbp`` (validated) on its placement, with the cheapest collectives."""
    return x if sbp == x.sbp else _Box.apply(x, sbp)


def to_placement(x: GlobalTensor, dst: GlobalMeta) -> GlobalTensor:
    """``x`` moved to the placement and SBP of ``dst`` (validated; same shape and dtype)."""
    return _CrossBox.apply(x, dst)
