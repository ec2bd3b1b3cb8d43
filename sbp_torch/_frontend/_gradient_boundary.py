"""Gradient reduction inside a compiled backward. While AOTAutograd traces a program, each use of a parameter
marked by ``mark_reduced_at_use`` (``Module.to_global`` marks the parameters whose gradients it reduces) goes
through ``sbp_torch::gradient_boundary``: the identity, whose backward boxes the gradient of that use to the
parameter's gradient layout (``gradient_sbp``). The reduction is then part of the traced backward, where the
compiler may bucket it and overlap it with the rest of the backward, and the gradient reaches ``.grad`` already
reduced, so the eager reducer's hook has nothing left to do.

Dynamo's pass is left alone: it records the calls as written, and AOTAutograd's run of them, on copies of the
tensors that keep the mark (``__tensor_flatten__``), inserts the boundary."""

import torch
from torch.compiler import is_dynamo_compiling

from .._signatures import GRADIENT_BOUNDARY
from .._tensor import GlobalTensor, gradient, reduced_at_use

_NOT_USES = {GRADIENT_BOUNDARY, GRADIENT_BOUNDARY.overloadpacket}


def _setup(ctx, inputs, output):
    ctx.meta = inputs[0]._meta


def _backward(ctx, grad):
    return gradient(grad, ctx.meta, None)


torch.library.register_autograd("sbp_torch::gradient_boundary", _backward, setup_context=_setup)


def _aot_tracing() -> bool:
    # AOTAutograd traces under functionalization; Dynamo's own pass and its reads of real tensors do not.
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def _marked(a) -> bool:
    return isinstance(a, GlobalTensor) and reduced_at_use(a)


def at_uses(func, args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
    """``args`` and ``kwargs`` with each marked parameter passed through the boundary, while AOTAutograd traces
    with grad on. (Keywords count: ``F.layer_norm`` hands its weight and bias to torch functions as keywords.)"""
    if func in _NOT_USES or is_dynamo_compiling() or not torch.is_grad_enabled() or not _aot_tracing():
        return args, kwargs
    if any(_marked(a) for a in args):
        args = tuple(GRADIENT_BOUNDARY(a) if _marked(a) else a for a in args)
    if kwargs and any(_marked(v) for v in kwargs.values()):
        kwargs = {k: GRADIENT_BOUNDARY(v) if _marked(v) else v for k, v in kwargs.items()}
    return args, kwargs
