"""Matrix products. The worked example of docs/signatures.md.

For ``mm(a[m, k], b[k, n])`` the valid 1-D signatures are:

    S(0)·B → S(0)     rows of a, all of b: rows of the product
    B·S(1) → S(1)     all of a, columns of b: columns of the product
    S(1)·S(0) → P     a slice of the contraction dim on each rank: partial sums
    P·B → P, B·P → P  the product is linear in each factor
    B·B → B

``bmm`` (and ``matmul`` of same-batch tensors, see ``_frontend/_batched_matmul.py``) add batch dims;
``addmm``/``baddbmm`` add a bias that follows the product's layout.
"""

import torch

from .core import B, OpCall, P, S, Signature, operand_sbp, register

aten = torch.ops.aten


def _product_signatures(batch_dims: int) -> list[Signature]:
    """Signatures of (a[..., m, k], b[..., k, n]) → out[..., m, n] with ``batch_dims`` leading batch dims."""
    m, k = batch_dims, batch_dims + 1
    return [Signature((S(d), S(d)), (S(d),)) for d in range(batch_dims)] + [
        Signature((S(m), B), (S(m),)),
        Signature((B, S(k)), (S(k),)),
        Signature((S(k), S(m)), (P,)),
        Signature((P, B), (P,)),
        Signature((B, P), (P,)),
        Signature((B, B), (B,)),
    ]


@register(aten.mm)
def mm(call: OpCall) -> list[Signature]:
    return _product_signatures(0)


@register(aten.bmm)
def bmm(call: OpCall) -> list[Signature]:
    return _product_signatures(1)


@register(aten.matmul)
def batched_matmul(call: OpCall) -> list[Signature]:
    """Same-batch-shape ``matmul`` of >= 3-D tensors, sent here whole by ``_frontend/_batched_matmul.py``."""
    a, b = call.inputs
    if a.ndim != b.ndim or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]:
        return []
    return _product_signatures(a.ndim - 2)


def _with_bias(call: OpCall, batch_dims: int) -> list[Signature]:
    """addmm(bias, a, b) = bias + a @ b: the bias takes the layout the product has, after broadcasting
    (a partial product gets a partial bias, made locally: the bias on one rank, zeros elsewhere)."""
    bias, out = call.inputs[0], call.outputs[0]
    signatures = []
    for product in _product_signatures(batch_dims):
        (layout,) = product.outputs
        bias_sbp = operand_sbp(out.shape, bias, layout.dim) if isinstance(layout, S) else layout
        signatures.append(Signature((bias_sbp,) + product.inputs, product.outputs))
    return signatures


@register(aten.addmm)
def addmm(call: OpCall) -> list[Signature]:
    return _with_bias(call, 0) if len(call.inputs) == 3 else []


@register(aten.baddbmm)
def baddbmm(call: OpCall) -> list[Signature]:
    return _with_bias(call, 1) if len(call.inputs) == 3 else []
