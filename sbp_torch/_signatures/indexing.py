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
boxing of the inputs does instead. Ops whose output shape depends on the data (``masked_select``,
``nonzero``, ``unique``, boolean-mask indexing) cannot run on meta tensors and take the broadcast fallback.
"""

import torch

from .core import P_MAX, P_MIN, PARTIALS, B, OpCall, P, S, Signature, Split, TensorInfo, operand_sbp, register

aten = torch.ops.aten


def _layouts(call: OpCall, names: tuple[str, ...], layouts: dict) -> tuple:
    """The input SBPs of a signature, for the named arguments that are global tensors (schema order)."""
    return tuple(layouts[n] for n in names if isinstance(call.bound.get(n), TensorInfo))


def _dim(call: OpCall) -> int:
    n = call.bound["self"].ndim
    return call.arg("dim") % n if n else 0


@register(aten.index_select.default)
def index_select(call: OpCall) -> list[Signature]:
    names, dim = ("self", "index"), _dim(call)
    x, index = call.bound["self"], call.bound["index"]
    signatures = [
        Signature(_layouts(call, names, {"self": S(d), "index": B}), (S(d),)) for d in range(x.ndim) if d != dim
    ]
    if isinstance(index, TensorInfo) and index.ndim == 1:
        signatures.append(Signature((B, S(0)), (S(dim),)))
    signatures += [Signature(_layouts(call, names, {"self": s, "index": B}), (s,)) for s in (B, *PARTIALS)]
    return signatures


@register(aten.gather.default)
def gather(call: OpCall) -> list[Signature]:
    names, dim = ("self", "index"), _dim(call)
    x, index = call.bound["self"], call.bound["index"]
    signatures = [Signature((S(d), S(d)), (S(d),)) for d in range(x.ndim) if d != dim and x.shape[d] == index.shape[d]]
    if index.ndim:
        signatures.append(Signature((B, S(dim)), (S(dim),)))
    signatures += [Signature(_layouts(call, names, {"self": s, "index": B}), (s,)) for s in (B, *PARTIALS)]
    return signatures


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


@register(*SCATTERS)
def scatter(call: OpCall) -> list[Signature]:
    names, dim = ("self", "index", "src"), _dim(call)
    tensors = [call.bound[n] for n in names if isinstance(call.bound.get(n), TensorInfo)]
    n_in = len(tensors)
    signatures = [
        Signature((S(d),) * n_in, (S(d),))
        for d in range(call.bound["self"].ndim)
        if d != dim and len({t.shape[d] for t in tensors}) == 1
    ]
    for s in (*SCATTERS[call.func], B):
        signatures.append(Signature(_layouts(call, names, {"self": s, "index": B, "src": s}), (s,)))
    return signatures


@register(aten.index_add.default, aten.index_add_.default)
def index_add(call: OpCall) -> list[Signature]:
    names, dim = ("self", "index", "source"), _dim(call)
    signatures = [
        Signature(_layouts(call, names, {"self": S(d), "index": B, "source": S(d)}), (S(d),))
        for d in range(call.bound["self"].ndim)
        if d != dim
    ]
    return signatures + [Signature(_layouts(call, names, {"self": s, "index": B, "source": s}), (s,)) for s in (P, B)]


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


@register(aten.index.Tensor)
def index(call: OpCall) -> list[Signature]:
    x, indices = call.bound["self"], list(call.bound["indices"])
    global_indices = [t for t in indices if isinstance(t, TensorInfo)]
    n_idx = len(global_indices)
    passing = [Signature((s,) + (B,) * n_idx, (s,)) for s in (B, *PARTIALS)]
    if _masks(indices):
        return passing
    kept, start, index_shape = index_result_dims(x.ndim, indices)
    signatures = [Signature((S(d),) + (B,) * n_idx, (S(e),)) for d, e in kept.items()]
    for j in range(len(index_shape)):
        layouts = tuple(operand_sbp(index_shape, t, j) for t in global_indices)
        if any(isinstance(s, Split) for s in layouts):
            signatures.append(Signature((B,) + layouts, (S(start + j),)))
    return signatures + passing


@register(aten.index_put.default, aten.index_put_.default, aten.index_put.hacked_twin, aten.index_put_.hacked_twin)
def index_put(call: OpCall) -> list[Signature]:
    x, indices, values = call.bound["self"], list(call.bound["indices"]), call.bound["values"]
    global_values = isinstance(values, TensorInfo)
    n_idx = len([t for t in indices if isinstance(t, TensorInfo)])

    def signature(x_sbp, values_sbp, out):
        return Signature((x_sbp,) + (B,) * n_idx + ((values_sbp,) if global_values else ()), (out,))

    if global_values:
        partials = (P,) if call.arg("accumulate", False) else PARTIALS
    else:  # a plain number is written on every rank
        partials = () if call.arg("accumulate", False) else (P_MAX, P_MIN)
    passing = [signature(s, s, s) for s in partials] + [signature(B, B, B)]
    if _masks(indices):
        return passing
    kept, start, index_shape = index_result_dims(x.ndim, indices)
    result_shape = [0] * (x.ndim - len([t for t in indices if t is not None]) + len(index_shape))
    for d, e in kept.items():
        result_shape[e] = x.shape[d]
    result_shape[start : start + len(index_shape)] = index_shape
    splits = [
        signature(S(d), operand_sbp(tuple(result_shape), values, e) if global_values else B, S(d))
        for d, e in kept.items()
    ]
    return splits + passing
