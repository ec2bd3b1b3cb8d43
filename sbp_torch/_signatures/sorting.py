"""Ops that order or select values along one dim: ``sort`` (``argsort`` and ``msort`` reach dispatch as it),
``topk``, ``kthvalue``, ``cummax`` and ``cummin``, each giving values and their indices along that dim.

Each slice along the dim is handled alone, and the indices count positions within the slice, so a split of
any other dim passes through to both outputs (renumbered where ``kthvalue`` drops the dim); uneven and empty
parts included. The dim itself cannot be split (a rank would rank its values against values it does not
hold), and no partial passes: the order of a sum of parts is not an order of the parts. Ties are ordered
within a slice as the kernel orders them, which torch leaves unspecified for an unstable sort; the values
are exact either way.
"""

import torch

from .core import OpCall, S, Signature, register, sig

aten = torch.ops.aten


ALONG_DIM = [aten.sort.default, aten.sort.stable, aten.topk.default, aten.cummax.default, aten.cummin.default]


@register(*ALONG_DIM, reads=("dim",))
def along_dim(call: OpCall) -> list[Signature]:
    x = call["self"]
    ordered = call.dim("dim", default=-1)
    return [sig(S(d), self=S(d)) for d in range(x.ndim) if d != ordered]


@register(aten.kthvalue.default, reads=("dim", "keepdim"))
def kthvalue(call: OpCall) -> list[Signature]:
    x = call["self"]
    selected, keepdim = call.dim("dim", default=-1), call.get("keepdim", False)
    return [sig(S(d if keepdim or d < selected else d - 1), self=S(d)) for d in range(x.ndim) if d != selected]
