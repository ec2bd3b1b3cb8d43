"""Element-wise ops (every aten op tagged ``pointwise``, plus a few untagged ones), with broadcasting.

* ``S(d)`` of the output: each input splits its matching dim, or is broadcast where it has no such dim or
  has size 1 there (torch broadcasting);
* ``B``: everything broadcast;
* partial signatures only where the op commutes with the reduction (table ``PARTIAL_KINDS``):
  sums pass through ``add``/``sub``/``neg`` (with a finite ``alpha``); scaling by a broadcast factor keeps any
  partial sum; copies keep every partial; non-decreasing functions (``clamp``, ``relu``, ``exp``, ...) keep a partial
  max or min.

Scaling is linear only by a finite factor and a finite, nonzero divisor: parts of 1 and 0 times inf give inf and
nan, whose sum is nan where the sum's product is inf; over 0 they give inf and nan. A rule that keeps a partial
through a number therefore reads it (its ``NumberClass``, which the call key holds) and keeps the partial only where
the number allows. A broadcast tensor factor's values are not read (that would wait for them): it is taken to be
finite, and a partial sum times a tensor holding an infinity, or over one holding 0, gives nan where one process
gives an infinity.
"""

import torch

from .core import (
    P_MAX,
    P_MIN,
    B,
    NumberClass,
    OpCall,
    P,
    Partial,
    S,
    Signature,
    TensorInfo,
    finite,
    finite_nonzero,
    operand_sbp,
    register_family,
)

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
#   "monotone": the first input P(max) or P(min), any others B -> the same partial: a non-decreasing function of
#            the first input commutes with max and min, and maps the parts' identities (-inf, +inf) in order
PARTIAL_KINDS = {
    **dict.fromkeys([aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor], "sum"),
    **dict.fromkeys([aten.neg.default, aten.neg_.default, aten._neg_view.default], "sum"),
    **dict.fromkeys([aten._conj.default, aten.conj_physical.default, aten.copy_.default], "sum"),
    **dict.fromkeys([aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar, aten.mul_.Scalar], "scale"),
    **dict.fromkeys([aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div_.Scalar], "scale_first"),
    **dict.fromkeys([aten.clone.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default], "copy"),
    **dict.fromkeys([aten.positive.default, aten._to_copy.default], "copy"),
    aten.zero_.default: "copy",  # zero is the identity of sum, and a max/min of zeros is zero
    **dict.fromkeys(
        [
            *(getattr(aten, name).default for name in ("clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max")),
            *(getattr(aten, name).Tensor for name in ("clamp", "clamp_", "clamp_min", "clamp_max")),
            aten.clamp_max_.default,
            *(getattr(aten, name).default for name in ("relu", "relu_", "exp", "exp_", "sigmoid", "tanh")),
            *(getattr(aten, name).default for name in ("floor", "ceil", "trunc", "hardtanh", "hardtanh_")),
        ],
        "monotone",
    ),
}


def is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func in EXTRA_POINTWISE


def _partial_signatures(call: OpCall, tensors: dict) -> list[Signature]:
    """``tensors``: every Tensor-typed argument by name (a global or plain tensor's TensorInfo, or a number)."""
    kind = PARTIAL_KINDS.get(call.func)
    out = call.outputs[0]
    infos = {n: t for n, t in tensors.items() if isinstance(t, TensorInfo)}
    if kind is None or any(t.shape != out.shape for n, t in infos.items() if n in call.global_names):
        return []
    names = list(infos)
    # the numbers a partial is scaled by (or that scale its addend): in tensor slots by value, Scalar ones by class
    numbers = [v for n, v in tensors.items() if n not in infos]
    numbers += [v for v in call.arguments.values() if isinstance(v, NumberClass)]
    if call.func is aten.copy_.default and not _keeps_sums(infos["src"].dtype, infos["self"].dtype):
        return []  # (a narrowing copy, converted part by part, is not the conversion of the sum)
    if kind == "sum" and len(infos) == len(tensors) and all(map(finite, numbers)):
        return [Signature(tuple((n, P) for n in names), P)]  # (a number in a tensor slot: added on every rank)
    if kind == "scale" and all(map(finite, numbers)):
        return [Signature(tuple((n, P if n == k else B) for n in names), P) for k in names]
    if kind == "scale_first" and "self" in infos and all(map(finite_nonzero, numbers)):
        return [Signature(tuple((n, P if i == 0 else B) for i, n in enumerate(names)), P)]
    if kind == "monotone":
        return [Signature(tuple((n, op if i == 0 else B) for i, n in enumerate(names)), op) for op in (P_MAX, P_MIN)]
    if kind == "copy" and len(names) == 1:
        source = infos[names[0]].dtype
        kinds = (["sum"] if _keeps_sums(source, out.dtype) else []) + (
            ["max", "min"] if _keeps_order(source, out.dtype) else []
        )
        return [Signature(((names[0], Partial(op)),), Partial(op)) for op in kinds]
    return []


def _keeps_sums(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether converting the parts of a partial sum from ``source`` to ``target`` and summing gives the
    conversion of their sum: the same dtype, or a floating (or complex) ``target`` that holds every ``source``
    value as type promotion does. A narrowing conversion (float32 to float16, a float to an integer) rounds or
    truncates each part alone: parts of 1000.3 and -1000.0 become 1000.5 and -1000.0 in float16, where their sum
    0.3 stays 0.3."""
    if source == target:
        return True
    return (target.is_floating_point or target.is_complex) and torch.promote_types(source, target) == target


def _keeps_order(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether converting ``source`` to ``target`` keeps the order of values and maps the identities of max and min
    (-inf and +inf, or an integer type's bounds) to values no part can beat: the same dtype, to a floating dtype from
    a real one, or to an integer type that holds every value of the source (bools included). Not from floats to
    integers (an infinity has no integer value) nor to bools (3 and -3 are both True)."""
    if source == target:
        return True
    if source.is_complex or target.is_complex or target == torch.bool:
        return False
    if target.is_floating_point:
        return True
    if source.is_floating_point:
        return False
    if source == torch.bool:
        return True
    low, high = torch.iinfo(source), torch.iinfo(target)
    return high.min <= low.min and low.max <= high.max


def _tensor_arguments(call: OpCall) -> dict:
    """Every Tensor-typed argument that is present, by name: TensorInfo, or the number passed in its place."""
    return {
        a.name: call.arguments[a.name]
        for a in call.func._schema.arguments
        if str(a.type) in ("Tensor", "Optional[Tensor]") and call.arguments.get(a.name) is not None
    }


@register_family(is_pointwise)
def pointwise(call: OpCall) -> list[Signature]:
    if not call.outputs:
        return []
    out_shape = call.outputs[0].shape
    tensors = _tensor_arguments(call)
    names = [n for n, t in tensors.items() if isinstance(t, TensorInfo)]
    signatures = [
        Signature(tuple((n, operand_sbp(out_shape, tensors[n], d)) for n in names), S(d)) for d in range(len(out_shape))
    ]
    return signatures + _partial_signatures(call, tensors)
