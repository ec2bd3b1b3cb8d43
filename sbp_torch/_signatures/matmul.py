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

from .core import B, OpCall, P, Partial, S, Signature, TensorInfo, finite, floats_only, operand_sbp, register, sig

aten = torch.ops.aten


def _product_signatures(batch_dims: int, a: str = "self", b: str = "mat2") -> list[Signature]:
    """Signatures of (a[..., m, k], b[..., k, n]) -> out[..., m, n] with ``batch_dims`` leading batch dims."""
    m, k = batch_dims, batch_dims + 1
    return [sig(S(d), **{a: S(d), b: S(d)}) for d in range(batch_dims)] + [
        sig(S(m), **{a: S(m), b: B}),
        sig(S(k), **{a: B, b: S(k)}),
        sig(P, **{a: S(k), b: S(m)}),
        sig(P, **{a: P, b: B}),
        sig(P, **{a: B, b: P}),
    ]


def _mm_outputs(call: OpCall) -> list[TensorInfo] | None:
    x, y = call["self"], call["mat2"]
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[0] or x.dtype != y.dtype:
        return None
    return [TensorInfo((x.shape[0], y.shape[1]), x.dtype)]


def _addmm_outputs(call: OpCall) -> list[TensorInfo] | None:
    x, y, bias = call["mat1"], call["mat2"], call["self"]
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[0] or not x.dtype == y.dtype == bias.dtype:
        return None
    out = (x.shape[0], y.shape[1])
    try:
        if tuple(torch.broadcast_shapes(bias.shape, out)) != out:
            return None
    except RuntimeError:
        return None
    return [TensorInfo(out, x.dtype)]


@register(aten.mm, outputs=floats_only(_mm_outputs))
def mm(call: OpCall) -> list[Signature]:
    return _product_signatures(0)


@register(aten.bmm)
def bmm(call: OpCall) -> list[Signature]:
    return _product_signatures(1)


@register(aten.matmul)
def batched_matmul(call: OpCall) -> list[Signature]:
    """Same-batch-shape ``matmul`` of >= 3-D tensors, sent here whole by ``_frontend/_batched_matmul.py``."""
    a, b = call["self"], call["other"]
    if a.ndim != b.ndim or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]:
        return []
    return _product_signatures(a.ndim - 2, "self", "other")


def _with_bias(call: OpCall, batch_dims: int, a: str, b: str) -> list[Signature]:
    """addmm(bias, a, b) = beta * bias + alpha * a @ b: the bias takes the layout the product has, after broadcasting
    (a partial product gets a partial bias, made locally: the bias on one rank, zeros elsewhere). Partial only where
    ``alpha`` and ``beta`` are finite: a part of 0 times inf is nan (``pointwise.py``'s linearity)."""
    bias, out = call["self"], call.outputs[0]
    linear = finite(call.get("alpha", 1)) and finite(call.get("beta", 1))
    signatures = []
    for product in _product_signatures(batch_dims, a, b):
        layout = product.outputs
        if isinstance(layout, Partial) and not linear:
            continue
        bias_sbp = operand_sbp(out.shape, bias, layout.dim) if isinstance(layout, S) else layout
        signatures.append(Signature((("self", bias_sbp),) + product.inputs, layout))
    return signatures


@register(aten.addmm, outputs=floats_only(_addmm_outputs))
def addmm(call: OpCall) -> list[Signature]:
    return _with_bias(call, 0, "mat1", "mat2")


@register(aten.baddbmm)
def baddbmm(call: OpCall) -> list[Signature]:
    return _with_bias(call, 1, "batch1", "batch2")
