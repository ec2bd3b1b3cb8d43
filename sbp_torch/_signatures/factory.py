"""Tensor-creating ops that take a tensor argument: ``*_like`` and ``new_*``.

The input's values are never read, so any layout of it is accepted as it is (no boxing):

* ``zeros_like``, ``ones_like``, ``empty_like``, ``full_like`` keep the input's splits (each rank makes its
  part); a broadcast or partial input gives a broadcast output: every rank holds the whole constant (so
  ``ones_like`` of a partial scalar loss, autograd's first gradient, is a broadcast one).
* ``new_zeros``, ``new_ones``, ``new_empty``, ``new_full``, ``new_empty_strided`` make a tensor of the size
  they are given: when that size is the input's shape, laid out like the input (autograd's
  ``new_empty_strided`` then ``copy_`` of a split gradient stays local); else split where the input is split
  along a dim that keeps its index and size (a buffer of the same rows that the rows' parts are then copied
  into, as DeepSeek's attention builds its keys), broadcast otherwise. The split variants run through a local
  function that passes the local size (and strides dense in the order of the asked ones).

Factories without a tensor argument (``zeros``, ``empty_strided``, ``scalar_tensor``, ...) never reach a
global tensor's dispatch: ``sbp_torch.zeros`` and friends create global tensors.
"""

import torch

from .core import PARTIALS, B, LocalContext, OpCall, S, Signature, dense_strides, like_input, register, sig

aten = torch.ops.aten

LIKE = [aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default]
NEW = [
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
]


@register(*LIKE)
def like(call: OpCall) -> list[Signature]:
    return like_input(call)


def _local_size(func, ctx: LocalContext):
    shape = ctx.local_output_shape()
    if func == aten.new_empty_strided.default:
        # the part laid out in the order of the asked (logical) strides: autograd asks a gradient for its
        # parameter's, and a part in that order is what the optimizer's foreach kernels group with the parameter's
        logical = ctx.outputs[0]
        return ctx.call(
            func,
            size=shape,
            stride=logical.strides if shape == logical.shape else dense_strides(shape, logical.strides),
        )
    return ctx.call(func, size=shape)


# (the local function changes only the sizes and strides the op is told, to the output's local ones)
_local_size.sizes_only = True


@register(*NEW, local_fns={"local_size": _local_size})
def new(call: OpCall) -> list[Signature]:
    x, out = call["self"], call.outputs[0]
    if out.shape == x.shape:
        return like_input(call, "local_size")
    kept = [d for d in range(x.ndim) if d < out.ndim and out.shape[d] == x.shape[d]]
    split = [sig(S(d), self=S(d), local_fn="local_size") for d in kept]
    return (
        split + [sig(B, self=S(d)) for d in range(x.ndim) if d not in kept] + [sig(B, self=s) for s in (B, *PARTIALS)]
    )
