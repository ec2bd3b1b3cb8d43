"""Indexing ops: ``index_select``, ``gather``, ``scatter*``, ``index_add``, ``index.Tensor`` (``x[i]``),
``index_put`` (``x[i] = v``), with the backward ops autograd makes of them.

Index values are absolute positions along the indexed dim, so:

* the data may be split on a dim that is not indexed, with the index broadcast (``index_select``,
  ``index.Tensor``, ``index_put``), or split alike where the op pairs index and data position by position
  (``gather``, ``scatter``: only where both have the same size on that dim);
* broadcast data may be indexed by a split index: each rank picks its share of the result
  (``index_select``, ``gather`` along ``dim``, ``index.Tensor``);
* picking or overwriting values commutes with the partial reductions: partial data with a broadcast index
  stays partial (sum, max and min for selections and overwrites; only sum where values are added).

The indexed dim itself cannot be split: a rank would have to resolve positions held by others, which the
boxing of the inputs does instead; but one value written through a boolean mask (``x[x < 0] = 0``) lands where
each rank's part of the mask holds, so the data and the mask may be split alike. Ops whose output shape depends on
the data (``masked_select``, ``nonzero``, ``unique``, reading through a boolean mask) cannot run on meta tensors
and take the broadcast fallback.
"""

import math

import torch

from .core import P_MAX, P_MIN, PARTIALS, B, OpCall, P, S, Signature, Split, TensorInfo, operand_sbp, register, sig

aten = torch.ops.aten


@register(aten.index_select.default, reads=("dim",))
def index_select(call: OpCall) -> list[Signature]:
    x, index, dim = call["self"], call["index"], call.dim()
    signatures = [sig(S(d), self=S(d), index=B) for d in range(x.ndim) if d != dim]
    if index.ndim == 1:
        signatures.append(sig(S(dim), self=B, index=S(0)))
    return signatures + [sig(s, self=s, index=B) for s in PARTIALS]


@register(aten.gather.default, reads=("dim",))
def gather(call: OpCall) -> list[Signature]:
    x, index, dim = call["self"], call["index"], call.dim()
    signatures = [sig(S(d), self=S(d), index=S(d)) for d in range(x.ndim) if d != dim and x.shape[d] == index.shape[d]]
    if index.ndim:
        signatures.append(sig(S(dim), self=B, index=S(dim)))
    return signatures + [sig(s, self=s, index=B) for s in PARTIALS]


# Ops that write ``src`` (or a number) into ``self`` at ``index`` positions along ``dim``, pairing index and
# src position by position on the other dims -> the partials of self (and src) that survive.
SCATTERS = {
    aten.scatter.src: PARTIALS,
    aten.scatter_.src: PARTIALS,
    aten.scatter.value: (P_MAX, P_MIN),  # the number is written on every rank: a max/min of it is itself
    aten.scatter_.value: (P_MAX, P_MIN),
    aten.scatter_add.default: (P,),
    aten.scatter_add_.default: (P,),
}


@register(*SCATTERS, reads=("dim",))
def scatter(call: OpCall) -> list[Signature]:
    dim = call.dim()
    tensors = {n: call.get(n) for n in ("self", "index", "src") if isinstance(call.get(n), TensorInfo)}
    signatures = [
        Signature(tuple((n, S(d)) for n in tensors), S(d))
        for d in range(call["self"].ndim)
        if d != dim and len({t.shape[d] for t in tensors.values()}) == 1
    ]
    return signatures + [sig(s, self=s, index=B, src=s) for s in SCATTERS[call.func]]


@register(aten.index_add.default, aten.index_add_.default, reads=("dim",))
def index_add(call: OpCall) -> list[Signature]:
    dim = call.dim()
    signatures = [sig(S(d), self=S(d), index=B, source=S(d)) for d in range(call["self"].ndim) if d != dim]
    return signatures + [sig(P, self=P, index=B, source=P)]


def index_result_dims(ndim: int, indices: list) -> tuple[dict[int, int], int, tuple[int, ...]]:
    """For ``x[indices]`` (advanced indexing, ``indices[d]`` None where dim ``d`` is not indexed): where each
    non-indexed dim of ``x`` lands in the result, where the broadcast index dims start, and their shape. The
    index dims replace the indexed dims in place when those are adjacent, else they come first."""
    indexed = [d for d, t in enumerate(indices) if t is not None]
    index_shape = tuple(torch.broadcast_shapes(*(tuple(indices[d].shape) for d in indexed)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    rest = [d for d in range(ndim) if d not in indexed]
    before = [d for d in rest if adjacent and d < indexed[0]]
    after = [d for d in rest if d not in before]
    kept = {d: i for i, d in enumerate(before)}
    kept.update({d: len(before) + len(index_shape) + i for i, d in enumerate(after)})
    return kept, len(before), index_shape


def _masks(indices: list) -> bool:
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


def _one_value_under_a_mask(x: TensorInfo, indices: list, values: TensorInfo) -> list[Signature]:
    """``x[mask] = v`` of one value through one mask over ``x``'s leading dims: each rank writes the value where its
    own part of the mask holds, whichever dim splits ``x``, the mask split alike where it covers that dim. (Several
    values go to the masked positions in their order over the whole tensor, which no rank alone knows.)"""
    if len(indices) != 1 or values is None or math.prod(values.shape) != 1:
        return []
    mask = indices[0]
    if mask.ndim > x.ndim or tuple(mask.shape) != tuple(x.shape[: mask.ndim]):
        return []
    return [sig(S(d), self=S(d), indices=(S(d) if d < mask.ndim else B,), values=B) for d in range(x.ndim)]


@register(aten.index.Tensor)
def index(call: OpCall) -> list[Signature]:
    x, indices = call["self"], list(call["indices"])
    passing = [sig(s, self=s, indices=B) for s in PARTIALS]
    if _masks(indices):
        return passing
    kept, start, index_shape = index_result_dims(x.ndim, indices)
    signatures = [sig(S(e), self=S(d), indices=B) for d, e in kept.items()]
    for j in range(len(index_shape)):
        layouts = tuple(None if t is None else operand_sbp(index_shape, t, j) for t in indices)
        if any(isinstance(s, Split) for s in layouts):
            signatures.append(sig(S(start + j), self=B, indices=layouts))
    return signatures + passing


@register(
    aten.index_put.default,
    aten.index_put_.default,
    aten.index_put.hacked_twin,
    aten.index_put_.hacked_twin,
    reads=("accumulate",),
)
def index_put(call: OpCall) -> list[Signature]:
    x, indices, values = call["self"], list(call["indices"]), call["values"]
    accumulate = call.get("accumulate", False)
    passing = [sig(s, self=s, indices=B, values=s) for s in ((P,) if accumulate else PARTIALS)]
    if not accumulate:  # the same values written on every rank: their max and min are themselves
        passing += [sig(s, self=s, indices=B, values=B) for s in (P_MAX, P_MIN)]
    if _masks(indices):
        return _one_value_under_a_mask(x, indices, values) + passing
    kept, start, index_shape = index_result_dims(x.ndim, indices)
    result_shape = [0] * (x.ndim - len([t for t in indices if t is not None]) + len(index_shape))
    for d, e in kept.items():
        result_shape[e] = x.shape[d]
    result_shape[start : start + len(index_shape)] = index_shape
    splits = [
        sig(S(d), self=S(d), indices=B, values=operand_sbp(tuple(result_shape), values, e)) for d, e in kept.items()
    ]
    return splits + passing
