"""Embedding lookup (``embedding(weight [V, D], indices)`` → [..., D]) and its dense backward.

    weight B,    indices S(d) → S(d)        each rank looks up its own indices
    weight S(1), indices B    → S(last)     each rank holds some features of every row
    weight S(0), indices B    → P(sum)      vocabulary-parallel, local function "vocab": a rank looks up the indices
                                            in its row range and gives zeros for the others
    weight P,    indices B    → P           the lookup is linear in the weight
    B, B → B

``embedding_dense_backward(grad [..., D], indices)`` → grad_weight [V, D], mirroring the forward:

    grad S(d), indices S(d) → P(sum)        (not with scale_grad_by_freq: frequencies are global)
    grad S(last), indices B → S(1)
    grad B, indices B       → S(0)          local function "vocab": each rank accumulates only its rows
    grad P, indices B       → P
    B, B → B

``padding_idx`` rows get no gradient either way. With a broadcast gradient and broadcast indices the
vocabulary-split gradient comes first (the inputs cost the same): no rank builds the whole [V, D] gradient
of a large table, and a broadcast table gets its gradient gathered when it is accumulated.
"""

import torch

from .core import B, LocalContext, OpCall, P, S, Signature, register, sig

aten = torch.ops.aten

VOCAB = "vocab"


def _rows(ctx: LocalContext, layout) -> tuple[int, int]:
    """(first, count) of this rank's rows (dim 0) of a tensor laid out as ``layout``."""
    starts, lengths = ctx.region(layout)
    return starts[0], lengths[0]


def _lookup_rows_in_range(func, ctx: LocalContext) -> torch.Tensor:
    """Lookup in this rank's rows of the table: indices outside them give zeros."""
    weight, indices = ctx.arguments["weight"], ctx.arguments["indices"]
    first, count = _rows(ctx, ctx.inputs[0])
    mine = (indices >= first) & (indices < first + count)
    if count == 0:
        return weight.new_zeros(indices.shape + weight.shape[1:])
    found = ctx.call(func, indices=torch.where(mine, indices - first, 0))
    return torch.where(mine.unsqueeze(-1), found, 0)


def _accumulate_rows_in_range(func, ctx: LocalContext) -> torch.Tensor:
    """Gradient of this rank's rows of the table. Indices outside them (and the padding index) go to one
    extra row, which is the local padding row and is dropped afterwards."""
    indices = ctx.arguments["indices"]
    first, count = _rows(ctx, ctx.outputs[0])
    mine = (indices >= first) & (indices < first + count) & (indices != ctx.arguments["padding_idx"])
    local = torch.where(mine, indices - first, count)
    return ctx.call(func, indices=local, num_weights=count + 1, padding_idx=count)[:count]


@register(aten.embedding, local_fns={VOCAB: _lookup_rows_in_range})
def embedding(call: OpCall) -> list[Signature]:
    weight, indices = call["weight"], call["indices"]
    if weight.ndim != 2:
        return []
    signatures = [sig(S(d), weight=B, indices=S(d)) for d in range(indices.ndim)]
    return signatures + [
        sig(S(indices.ndim), weight=S(1), indices=B),
        sig(P, VOCAB, weight=S(0), indices=B),
        sig(P, weight=P, indices=B),
    ]


@register(aten.embedding_dense_backward, reads=("scale_grad_by_freq",), local_fns={VOCAB: _accumulate_rows_in_range})
def embedding_dense_backward(call: OpCall) -> list[Signature]:
    grad, indices = call["grad_output"], call["indices"]
    signatures = []
    if not call.get("scale_grad_by_freq", False):
        signatures += [sig(P, grad_output=S(d), indices=S(d)) for d in range(indices.ndim)]
    return signatures + [
        sig(S(1), grad_output=S(grad.ndim - 1), indices=B),
        sig(S(0), VOCAB, grad_output=B, indices=B),
        sig(P, grad_output=P, indices=B),
    ]
