"""Element-wise ops (every aten op tagged ``pointwise``, plus a few untagged ones), with broadcasting.

* ``S(d)`` of the output: each input splits its matching dim, or is broadcast where it has no such dim or
  has size 1 there (torch broadcasting);
* ``B``: everything broadcast;
* partial signatures only where the op commutes with the reduction (table ``PARTIAL_KINDS``):
  sums pass through ``add``/``sub``/``neg``; scaling by a broadcast factor keeps any partial sum; copies keep
  every partial.
"""

import torch

from .core import B, OpCall, P, Partial, S, Signature, TensorInfo, operand_sbp, register_family

aten = torch.ops.aten

# Untagged ops that are element-wise all the same.
EXTRA_POINTWISE = {
    aten._to_copy.default,
    aten.copy_.default,
    aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.hardtanh_backward.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.contiguous.default if hasattr(aten, "contiguous") else aten.clone.default,
    aten._conj.default,  # conj / neg views: their local parts are materialized (see GlobalTensor.__new__)
    aten._neg_view.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
}

# op -> which partial signatures it has:
#   "sum":   every global input P(sum) → P(sum) (additive; numbers in tensor slots are not allowed)
#   "scale": one global input P(sum), the others B → P(sum) ("first" = only the first input may be partial)
#   "copy":  one input, any partial kept (the value is not changed)
PARTIAL_KINDS = {
    **dict.fromkeys([aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor], "sum"),
    **dict.fromkeys([aten.neg.default, aten.neg_.default, aten._neg_view.default], "sum"),
    **dict.fromkeys([aten._conj.default, aten.conj_physical.default, aten.copy_.default], "sum"),
    **dict.fromkeys([aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar, aten.mul_.Scalar], "scale"),
    **dict.fromkeys([aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div_.Scalar], "scale_first"),
    **dict.fromkeys([aten.clone.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default], "copy"),
    **dict.fromkeys([aten.positive.default, aten._to_copy.default], "copy"),
    aten.zero_.default: "copy",  # zero is the identity of sum, and a max/min of zeros is zero
}


def is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func in EXTRA_POINTWISE


def _tensor_slots_hold_globals(call: OpCall) -> bool:
    """Every Tensor-typed argument is a global tensor (not a number or plain scalar tensor)."""
    for a in call.func._schema.arguments:
        if str(a.type) in ("Tensor", "Optional[Tensor]") and a.name in call.bound:
            value = call.bound[a.name]
            if value is not None and not isinstance(value, TensorInfo):
                return False
    return True


def _partial_signatures(call: OpCall) -> list[Signature]:
    kind = PARTIAL_KINDS.get(call.func)
    n_in, n_out = len(call.inputs), len(call.outputs)
    same_shape = all(x.shape == call.outputs[0].shape for x in call.inputs)
    if kind is None or not same_shape:
        return []
    if kind == "sum" and _tensor_slots_hold_globals(call):
        return [Signature((P,) * n_in, (P,) * n_out)]
    if kind == "scale":
        return [Signature(tuple(P if i == k else B for i in range(n_in)), (P,) * n_out) for k in range(n_in)]
    if kind == "scale_first":
        return [Signature((P,) + (B,) * (n_in - 1), (P,) * n_out)]
    if kind == "copy" and n_in == 1:
        out_dtype = call.outputs[0].dtype
        keeps_sums = out_dtype.is_floating_point or out_dtype.is_complex or out_dtype == call.inputs[0].dtype
        kinds = ["sum", "max", "min"] if keeps_sums else ["max", "min"]
        return [Signature((Partial(op),), (Partial(op),) * n_out) for op in kinds]
    return []


@register_family(is_pointwise)
def pointwise(call: OpCall) -> list[Signature]:
    if not call.outputs:
        return []
    out_shape, n_out = call.outputs[0].shape, len(call.outputs)
    signatures = [
        Signature(tuple(operand_sbp(out_shape, x, d) for x in call.inputs), (S(d),) * n_out)
        for d in range(len(out_shape))
    ]
    signatures.append(Signature((B,) * len(call.inputs), (B,) * n_out))
    return signatures + _partial_signatures(call)
