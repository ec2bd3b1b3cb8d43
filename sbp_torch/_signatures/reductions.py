"""Reductions over ``dim`` (with ``keepdim``) and the ``cumsum`` scan.

A split on a dim that is kept stays a split (renumbered when ``keepdim`` is False); broadcast stays
broadcast. A split on a reduced dim gives what the table ``REDUCTIONS`` says:

    op                          split of a reduced dim     partial input kept
    sum, count_nonzero          P(sum)                      P(sum) (sum only)
    mean                        P(sum), kernel "mean"       P(sum)
    amax, max()                 P(max)                      P(max)
    amin, min()                 P(min)                      P(min)
    any                         P(max) (or)                 P(max) of bools
    all                         P(min) (and)                P(min) of bools
    linalg_vector_norm, norm    B, kernel "vector_norm"     -
    max.dim, min.dim, argmax, argmin, prod, var, std, var_mean, std_mean, logsumexp, nansum: none (boxed)

The "mean" kernel divides the local sum by the *logical* count of reduced elements, so the parts still sum to
the mean. The "vector_norm" kernel all-reduces the local sums of ``|x|**ord`` (max/min of ``|x|`` for infinite
orders, counts of non-zeros for order 0) over the splitting axes, then takes the root. Max/min reductions need
every rank to hold at least one element of each reduced dim (``check_nd``): an empty max has no value.

``cumsum`` keeps a split on any dim but the scanned one, and a partial sum (it is linear).
"""

from __future__ import annotations

import math

import torch
from torch.fx.operator_schemas import normalize_function

from .._sbp import Partial
from .core import B, P, P_MAX, P_MIN, OpCall, S, Signature, register, smallest_part

aten = torch.ops.aten

MEAN = "mean"
VECTOR_NORM = "vector_norm"

# op -> (what a split of a reduced dim gives: a Partial, a kernel name or None; partials passed through)
REDUCTIONS = {
    aten.sum.default: (P, (P,)),
    aten.sum.dim_IntList: (P, (P,)),
    aten.count_nonzero.default: (P, ()),
    aten.count_nonzero.dim_IntList: (P, ()),
    aten.mean.default: (MEAN, (P,)),
    aten.mean.dim: (MEAN, (P,)),
    aten.amax.default: (P_MAX, (P_MAX,)),
    aten.max.default: (P_MAX, (P_MAX,)),
    aten.amin.default: (P_MIN, (P_MIN,)),
    aten.min.default: (P_MIN, (P_MIN,)),
    aten.any.default: (P_MAX, (P_MAX,)),
    aten.any.dim: (P_MAX, (P_MAX,)),
    aten.any.dims: (P_MAX, (P_MAX,)),
    aten.all.default: (P_MIN, (P_MIN,)),
    aten.all.dim: (P_MIN, (P_MIN,)),
    aten.all.dims: (P_MIN, (P_MIN,)),
    aten.linalg_vector_norm.default: (VECTOR_NORM, ()),
    aten.norm.Scalar: (VECTOR_NORM, ()),
    aten.norm.ScalarOpt_dim: (VECTOR_NORM, ()),
    aten.norm.ScalarOpt_dim_dtype: (VECTOR_NORM, ()),
    aten.norm.ScalarOpt_dtype: (VECTOR_NORM, ()),
    aten.max.dim: (None, ()),
    aten.min.dim: (None, ()),
    aten.argmax.default: (None, ()),
    aten.argmin.default: (None, ()),
    aten.prod.default: (None, ()),
    aten.prod.dim_int: (None, ()),
    aten.var.default: (None, ()),
    aten.var.dim: (None, ()),
    aten.var.correction: (None, ()),
    aten.std.default: (None, ()),
    aten.std.dim: (None, ()),
    aten.std.correction: (None, ()),
    aten.var_mean.default: (None, ()),
    aten.var_mean.dim: (None, ()),
    aten.var_mean.correction: (None, ()),
    aten.std_mean.default: (None, ()),
    aten.std_mean.dim: (None, ()),
    aten.std_mean.correction: (None, ()),
    aten.logsumexp.default: (None, ()),
    aten.nansum.default: (None, ()),
}

# Partials of bools only: "or" of ors is an "or", but any() of a max of numbers is not an "or" of any()s.
BOOL_ONLY_KEPT = {aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims}


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """The dims a ``dim`` argument reduces: None or an empty list mean all of them."""
    if ndim == 0:
        return ()
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else dim
    return tuple(sorted({d % ndim for d in dims}))


def _order(call_or_args) -> float:
    order = call_or_args.get("ord", call_or_args.get("p"))
    return 2.0 if order is None else float(order)


def _needs_nonempty(call: OpCall) -> bool:
    """Whether the local reduction fails on an empty part: max/min, and norms of infinite order."""
    split_gives, _ = REDUCTIONS[call.func]
    if split_gives == VECTOR_NORM:
        return math.isinf(_order(call.bound))
    return split_gives in (P_MAX, P_MIN)


def _every_part_nonempty(call: OpCall, combo: tuple[Signature, ...]) -> bool:
    if not _needs_nonempty(call):
        return True
    dims = reduced_dims(call.bound.get("dim"), call.inputs[0].ndim)
    return all(smallest_part(call, combo, 0, d) > 0 for d in dims)


def _mean(func, ctx, args, kwargs) -> torch.Tensor:
    """Local sum / logical count: the parts are partial sums of the mean."""
    a = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
    x = a["input"]
    dims = reduced_dims(a.get("dim"), x.dim())
    count = math.prod(ctx.inputs[0].shape[d] for d in dims)
    return x.sum(dims, a.get("keepdim", False), dtype=ctx.outputs[0].dtype).div_(count)


def _vector_norm(func, ctx, args, kwargs) -> torch.Tensor:
    """The norm over dims split across ``ctx.kernel_axes``: local power sums (or extremes), all-reduced."""
    a = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
    x = a["input"] if a.get("dtype") is None else a["input"].to(a["dtype"])
    dims, keepdim, order = reduced_dims(a.get("dim"), x.dim()), a.get("keepdim", False), _order(a)
    magnitude = x.abs()
    if order == math.inf:
        local, op = magnitude.amax(dims, keepdim), "max"
    elif order == -math.inf:
        local, op = magnitude.amin(dims, keepdim), "min"
    elif order == 0:
        local, op = (magnitude != 0).sum(dims, keepdim, dtype=magnitude.dtype), "sum"
    else:
        local, op = magnitude.pow(order).sum(dims, keepdim), "sum"
    local = ctx.all_reduce(local, op)
    return local if op != "sum" or order == 0 else local.pow(1.0 / order)


@register(*REDUCTIONS, check_nd=_every_part_nonempty, kernels={MEAN: _mean, VECTOR_NORM: _vector_norm})
def reduction(call: OpCall) -> list[Signature]:
    x = call.inputs[0]
    n_out = len(call.outputs)
    reduced = reduced_dims(call.bound.get("dim"), x.ndim)
    keepdim = call.arg("keepdim", False)
    split_gives, kept = REDUCTIONS[call.func]
    signatures = []
    for d in range(x.ndim):
        if d not in reduced:
            out_dim = d if keepdim else d - sum(r < d for r in reduced)
            signatures.append(Signature((S(d),), (S(out_dim),) * n_out))
        elif isinstance(split_gives, Partial):
            signatures.append(Signature((S(d),), (split_gives,) * n_out))
        elif split_gives == MEAN:
            signatures.append(Signature((S(d),), (P,) * n_out, kernel=MEAN))
        elif split_gives == VECTOR_NORM:
            signatures.append(Signature((S(d),), (B,) * n_out, kernel=VECTOR_NORM))
    signatures.append(Signature((B,), (B,) * n_out))
    if call.func not in BOOL_ONLY_KEPT or x.dtype == torch.bool:
        signatures += [Signature((p,), (p,) * n_out) for p in kept]
    return signatures


@register(aten.cumsum.default)
def cumsum(call: OpCall) -> list[Signature]:
    x = call.inputs[0]
    scanned = call.bound["dim"] % x.ndim if x.ndim else None
    signatures = [Signature((S(d),), (S(d),)) for d in range(x.ndim) if d != scanned]
    return signatures + [Signature((B,), (B,)), Signature((P,), (P,))]
