"""``_foreach_*`` ops (the multi-tensor kernels that optimizers use).

A foreach op applies one element-wise op to the tensors at each list index, and the tensors at different
indices may have different layouts (a split weight, a broadcast bias). The dispatcher therefore decides a
foreach call index by index; each single-index call is decided here like an element-wise op of equally shaped
tensors, with the same partial kinds: sums of partial sums, scaling of a partial sum.
"""

import torch

from .core import B, OpCall, P, Partial, S, Signature, operand_sbp, register_family

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
    shape, n_in, n_out = call.inputs[0].shape, len(call.inputs), len(call.outputs)
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
