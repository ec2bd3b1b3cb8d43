"""``torch.matmul`` of batched global tensors without flattening the batch dims.

Above ``__torch_dispatch__``, torch turns ``a @ b`` of 4-D attention tensors ``[batch, heads, T, D]`` into ``expand``, a
reshape to ``[batch * heads, T, D]``, ``bmm`` and a reshape back; the merged dim cannot hold a split of the heads (not
its outer dim), so with tensor parallelism every attention product would gather q and k. Here ``torch.matmul`` of two
global tensors with the same batch shape goes to the dispatcher as one ``aten.matmul``, whose rule splits any batch dim;
an autograd function gives it its gradient's two matmuls."""

import torch

from .._dispatch import dispatch
from .._tensor import GlobalTensor

aten = torch.ops.aten

MATMUL_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def applies(func, args, kwargs) -> bool:
    """Whether the call is a batched matmul this module handles (both global, same batch shape, >= 3-D)."""
    if func not in MATMUL_FUNCS or kwargs or len(args) != 2:
        return False
    a, b = args
    if not (isinstance(a, GlobalTensor) and isinstance(b, GlobalTensor)):
        return False
    # Shapes from the metadata: Tensor.dim() and .shape would re-enter __torch_function__.
    a_shape, b_shape = a._meta.shape, b._meta.shape
    return len(a_shape) == len(b_shape) >= 3 and a_shape[:-2] == b_shape[:-2]


class BatchedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return dispatch(aten.matmul.default, (a, b), {})

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = _matmul(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        grad_b = _matmul(a.transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _matmul(x, y):
    """``x @ y`` for the gradient, as one ``aten.matmul`` where this module applies: backward from ``Tensor.backward``
    runs with ``__torch_function__`` off (entered through it), so torch would flatten a ``torch.matmul`` here."""
    if applies(torch.matmul, (x, y), {}):
        return BatchedMatmul.apply(x, y)
    return torch.matmul(x, y)
