"""``_foreach_*`` ops (the multi-tensor kernels that optimizers use).

A foreach op applies one element-wise op to the tensors at each list index, and the tensors at different
indices may have different layouts (a split weight, a broadcast bias). The dispatcher therefore runs a foreach
call index by index (``split_foreach_call``); each single-index call is decided here like an element-wise op
of equally shaped tensors, with the same partial kinds: sums of partial sums, scaling of a partial sum.
"""

from __future__ import annotations

import torch

from .._sbp import Partial
from .core import B, P, OpCall, S, Signature, register_family
from .pointwise import operand_sbp

aten = torch.ops.aten

PARTIAL_KINDS = {
    aten._foreach_add.List: "sum",
    aten._foreach_add_.List: "sum",
    aten._foreach_sub.List: "sum",
    aten._foreach_sub_.List: "sum",
    aten._foreach_neg.default: "sum",
    aten._foreach_neg_.default: "sum",
    aten._foreach_copy_.default: "sum",
    aten._foreach_mul.Scalar: "scale",
    aten._foreach_mul_.Scalar: "scale",
    aten._foreach_mul.ScalarList: "scale",
    aten._foreach_mul_.ScalarList: "scale",
    aten._foreach_div.Scalar: "scale",
    aten._foreach_div_.Scalar: "scale",
    aten._foreach_div.ScalarList: "scale",
    aten._foreach_div_.ScalarList: "scale",
    aten._foreach_mul.Tensor: "scale",  # by one 0-dim tensor (clip_grad_norm_'s clip coefficient)
    aten._foreach_mul_.Tensor: "scale",
    aten._foreach_div.Tensor: "scale",
    aten._foreach_div_.Tensor: "scale",
    aten._foreach_zero_.default: "copy",
}

# Foreach ops that are not element-wise: they go to the broadcast fallback, index by index.
NOT_ELEMENTWISE = {"_foreach_norm", "_foreach_max"}


def is_foreach(func) -> bool:
    return func._schema.name.startswith("aten::_foreach_")


def _elementwise_foreach(func) -> bool:
    return is_foreach(func) and func._schema.name.split("::")[1] not in NOT_ELEMENTWISE


def split_foreach_call(func, args, kwargs) -> list[tuple[tuple, dict]]:
    """The single-index calls (args, kwargs) a foreach call is made of; lists become one-element lists."""
    schema = func._schema.arguments
    lengths = [len(a) for a, s in zip(args, schema) if str(s.type).startswith("List[")]
    n = lengths[0] if lengths else 0

    def at(value, s, i):
        return [value[i]] if str(s.type).startswith("List[") and value is not None else value

    names = {s.name: s for s in schema}
    return [
        (
            tuple(at(a, s, i) for a, s in zip(args, schema)),
            {k: at(v, names[k], i) for k, v in kwargs.items()},
        )
        for i in range(n)
    ]


@register_family(_elementwise_foreach)
def foreach(call: OpCall) -> list[Signature]:
    shape = call.inputs[0].shape
    n_in = len(call.inputs)
    n_out = len(call.outputs)
    signatures = [
        Signature(tuple(operand_sbp(shape, x, d) for x in call.inputs), (S(d),) * n_out) for d in range(len(shape))
    ]
    signatures.append(Signature((B,) * n_in, (B,) * n_out))
    kind = PARTIAL_KINDS.get(call.func)
    if kind == "sum":
        signatures.append(Signature((P,) * n_in, (P,) * n_out))
    elif kind == "scale":  # a partial sum times (or over) numbers or a broadcast tensor
        signatures.append(Signature((P,) + (B,) * (n_in - 1), (P,) * n_out))
    elif kind == "copy":
        signatures += [Signature((Partial(op),), (Partial(op),) * n_out) for op in ("sum", "max", "min")]
    return signatures
