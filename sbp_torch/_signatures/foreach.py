"""``_foreach_*`` ops (the multi-tensor kernels that optimizers use).

A foreach op applies one element-wise op to the tensors at each list index, and the tensors at different
indices may have different layouts (a split weight, a broadcast bias). The dispatcher therefore decides a
foreach call index by index; each single-index call is decided here like an element-wise op of equally shaped
tensors, with the same partial kinds: sums of partial sums (a finite ``alpha``), scaling of a partial sum (by
finite numbers, or over finite nonzero ones).
"""

import torch

from .core import (
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

PARTIAL_KINDS = {
    **dict.fromkeys([aten._foreach_add.List, aten._foreach_add_.List], "sum"),
    **dict.fromkeys([aten._foreach_sub.List, aten._foreach_sub_.List], "sum"),
    **dict.fromkeys([aten._foreach_neg.default, aten._foreach_neg_.default], "sum"),
    aten._foreach_copy_.default: "sum",
    **dict.fromkeys([aten._foreach_mul.Scalar, aten._foreach_mul_.Scalar], "scale"),
    **dict.fromkeys([aten._foreach_mul.ScalarList, aten._foreach_mul_.ScalarList], "scale"),
    **dict.fromkeys([aten._foreach_div.Scalar, aten._foreach_div_.Scalar], "scale"),
    **dict.fromkeys([aten._foreach_div.ScalarList, aten._foreach_div_.ScalarList], "scale"),
    # The Tensor overloads scale by one 0-dim tensor (clip_grad_norm_'s clip coefficient).
    **dict.fromkeys([aten._foreach_mul.Tensor, aten._foreach_mul_.Tensor], "scale"),
    **dict.fromkeys([aten._foreach_div.Tensor, aten._foreach_div_.Tensor], "scale"),
    aten._foreach_zero_.default: "copy",
}

# Foreach ops that are not element-wise: they go to the broadcast fallback, index by index.
NOT_ELEMENTWISE = {"_foreach_norm", "_foreach_max"}


def is_foreach(func) -> bool:
    return func._schema.name.startswith("aten::_foreach_")


def _elementwise_foreach(func) -> bool:
    return is_foreach(func) and func._schema.name.split("::")[1] not in NOT_ELEMENTWISE


@register_family(_elementwise_foreach)
def foreach(call: OpCall) -> list[Signature]:
    """One index of a foreach call: its lists hold one tensor each."""
    lists = {n: v[0] for n, v in call.arguments.items() if isinstance(v, (list, tuple)) and v}
    singles = dict(call.tensors())
    tensors = {n: t for n, t in {**lists, **singles}.items() if isinstance(t, TensorInfo)}
    first, shape = next(iter(tensors)), next(iter(tensors.values())).shape
    signatures = [
        Signature(tuple((n, operand_sbp(shape, t, d)) for n, t in tensors.items()), S(d)) for d in range(len(shape))
    ]
    kind = PARTIAL_KINDS.get(call.func)
    # the Scalar numbers (alpha, the factors or divisors at this index), by class: see pointwise.py's linearity
    numbers = [c for v in call.arguments.values() for c in (v if isinstance(v, tuple) else (v,))]
    numbers = [c for c in numbers if isinstance(c, NumberClass)]
    divides = call.func._schema.name.startswith("aten::_foreach_div")
    if kind == "sum" and all(map(finite, numbers)):
        signatures.append(Signature(tuple((n, P) for n in tensors), P))
    elif kind == "scale" and all(map(finite_nonzero if divides else finite, numbers)):
        # a partial sum times (or over) numbers or a broadcast tensor
        signatures.append(Signature(tuple((n, P if n == first else B) for n in tensors), P))
    elif kind == "copy":
        signatures += [Signature(((first, Partial(op)),), Partial(op)) for op in ("sum", "max", "min")]
    return signatures
