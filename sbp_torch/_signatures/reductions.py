"""Reductions over ``dim`` (with ``keepdim``) and the ``cumsum`` scan.

A split on a dim that is kept stays a split (renumbered when ``keepdim`` is False); broadcast stays
broadcast. A split on a reduced dim gives what the table ``REDUCTIONS`` says:

    op                          split of a reduced dim                  partial input kept
    sum, count_nonzero          P(sum)                                  P(sum) (sum only)
    mean                        P(sum), local function "mean"           P(sum)
    amax, max()                 P(max)                                  P(max)
    amin, min()                 P(min)                                  P(min)
    any                         P(max) (or)                             P(max) of bools
    all                         P(min) (and)                            P(min) of bools
    linalg_vector_norm, norm    B, local function "vector_norm"         -
    max.dim, min.dim, argmax, argmin, prod, var, std, var_mean, std_mean, logsumexp, nansum: none (boxed)

"mean" divides the local sum by the *logical* count of reduced elements, so the parts still sum to the mean.
"vector_norm" combines the local norms as ``norm_statistic`` says (sums of ``|x|**ord``, the largest or smallest
``|x|`` for infinite orders, counts of non-zeros for order 0) over the splitting axes, then takes the root.
Max/min reductions need every rank to hold at least one element of each reduced dim (``check_nd``): an empty
max has no value.

``cumsum`` keeps a split on any dim but the scanned one, and a partial sum (it is linear).

``histc`` with a range (``min < max``) counts each element into a bin by its value alone, so the histograms of a
split's parts are partial sums of the histogram, exactly while the dtype holds every count up to the number of
elements (2**8 in bfloat16, 2**11 in float16, 2**24 in float32): beyond, a count rounds one way in the whole and
another in the sum of the parts. Without a range (``min == max``) each rank would bin its part by its own data's
range. Either way the input is then gathered. ``bincount`` has no rule: its length, ``max(input) + 1``, is
data and differs between the parts (and no meta kernel can tell it), so it gathers.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .core import (
    P_MAX,
    P_MIN,
    B,
    LocalContext,
    OpCall,
    P,
    Partial,
    S,
    Signature,
    TensorInfo,
    floats_only,
    normalize_dims,
    register,
    sig,
    smallest_part,
)

aten = torch.ops.aten

MEAN = "mean"
VECTOR_NORM = "vector_norm"

# op -> (what a split of a reduced dim gives: a Partial, a local function's name or None; partials passed through)
REDUCTIONS = {
    **dict.fromkeys([aten.sum.default, aten.sum.dim_IntList], (P, (P,))),
    **dict.fromkeys([aten.count_nonzero.default, aten.count_nonzero.dim_IntList], (P, ())),
    **dict.fromkeys([aten.mean.default, aten.mean.dim], (MEAN, (P,))),
    **dict.fromkeys([aten.amax.default, aten.max.default], (P_MAX, (P_MAX,))),
    **dict.fromkeys([aten.amin.default, aten.min.default], (P_MIN, (P_MIN,))),
    **dict.fromkeys([aten.any.default, aten.any.dim, aten.any.dims], (P_MAX, (P_MAX,))),
    **dict.fromkeys([aten.all.default, aten.all.dim, aten.all.dims], (P_MIN, (P_MIN,))),
    **dict.fromkeys([aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim], (VECTOR_NORM, ())),
    **dict.fromkeys([aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype], (VECTOR_NORM, ())),
    **dict.fromkeys([aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default], (None, ())),
    **dict.fromkeys([aten.prod.default, aten.prod.dim_int], (None, ())),
    **dict.fromkeys([aten.var.default, aten.var.dim, aten.var.correction], (None, ())),
    **dict.fromkeys([aten.std.default, aten.std.dim, aten.std.correction], (None, ())),
    **dict.fromkeys([aten.var_mean.default, aten.var_mean.dim, aten.var_mean.correction], (None, ())),
    **dict.fromkeys([aten.std_mean.default, aten.std_mean.dim, aten.std_mean.correction], (None, ())),
    **dict.fromkeys([aten.logsumexp.default, aten.nansum.default], (None, ())),
}

# Partials of bools only: "or" of ors is an "or", but any() of a max of numbers is not an "or" of any()s.
BOOL_ONLY_KEPT = {aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims}


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """The dims a ``dim`` argument reduces: None or an empty list mean all of them (none of a 0-dim tensor)."""
    return () if ndim == 0 else normalize_dims(dim, ndim)


# Ops for which an empty list of dims reduces none of them (torch's any and all over dims), where sum and the others
# reduce every dim
EMPTY_DIMS_KEEP_ALL = {aten.any.dims, aten.all.dims}


def _reduced(call: OpCall) -> tuple[int, ...]:
    dim = call.get("dim")
    if call.func in EMPTY_DIMS_KEEP_ALL and dim is not None and len(dim) == 0:
        return ()
    return reduced_dims(dim, call["self"].ndim)


def _order(arguments) -> float:
    """The order of a vector norm (``ord`` or ``p``; 2 when not given)."""
    order = arguments.get("ord", arguments.get("p"))
    return 2.0 if order is None else float(order)


def _every_part_nonempty(call: OpCall, combo: tuple[Signature, ...]) -> bool:
    """Where the local reduction fails on an empty part (max/min, norms of infinite or negative order, which have
    no identity), no part is empty."""
    split_gives, _ = REDUCTIONS[call.func]
    order = _order(call) if split_gives == VECTOR_NORM else None
    fails_on_empty = (math.isinf(order) or order < 0) if order is not None else split_gives in (P_MAX, P_MIN)
    if not fails_on_empty:
        return True
    return all(smallest_part(call, combo, "self", d) > 0 for d in _reduced(call))


def _mean(func, ctx: LocalContext) -> torch.Tensor:
    """Local sum / logical count: the parts are partial sums of the mean."""
    a = ctx.arguments
    x = a["self"]
    dims = reduced_dims(a.get("dim"), x.dim())
    count = math.prod(ctx.inputs[0].shape[d] for d in dims)
    return x.sum(dims, a.get("keepdim", False), dtype=ctx.outputs[0].dtype).div_(count)


class NormStatistic(NamedTuple):
    """How vector norms of one order combine across the parts of a tensor: each part's norm becomes a
    statistic (``of_norm``) that ``op`` combines across parts, and the combined statistic becomes the norm
    (``to_norm``); ``empty`` is the statistic of a part with no element."""

    of_norm: Callable
    op: str
    empty: float
    to_norm: Callable


def norm_statistic(order: float) -> NormStatistic:
    """The ``NormStatistic`` of order ``order``: the largest or smallest magnitude for infinite orders, the
    count of non-zeros for 0, else the sum of ``|x| ** order``."""
    if order == math.inf:
        return NormStatistic(lambda n: n, "max", 0.0, lambda s: s)  # magnitudes are >= 0
    if order == -math.inf:
        return NormStatistic(lambda n: n, "min", math.inf, lambda s: s)
    if order == 0:
        return NormStatistic(lambda n: n, "sum", 0.0, lambda s: s)
    return NormStatistic(lambda n: n.pow(order), "sum", 0.0, lambda s: s.pow(1.0 / order))


def _vector_norm(func, ctx: LocalContext) -> torch.Tensor:
    """The norm over dims split across ``ctx.axes``: local statistics all-reduced (``norm_statistic``)."""
    a = ctx.arguments
    x = a["self"] if a.get("dtype") is None else a["self"].to(a["dtype"])
    dims, keepdim, order = reduced_dims(a.get("dim"), x.dim()), a.get("keepdim", False), _order(a)
    statistic = norm_statistic(order)
    local = statistic.of_norm(torch.linalg.vector_norm(x, order, dims, keepdim))
    return statistic.to_norm(ctx.all_reduce(local, statistic.op))


def _sum_outputs(call: OpCall) -> list[TensorInfo] | None:
    x = call["self"]
    if call.get("dtype") is not None:
        return None
    try:
        dims = reduced_dims(call.get("dim"), x.ndim)
    except IndexError:
        return None  # the op raises
    if call.get("keepdim", False):
        return [TensorInfo(tuple(1 if i in dims else n for i, n in enumerate(x.shape)), x.dtype)]
    return [TensorInfo(tuple(n for i, n in enumerate(x.shape) if i not in dims), x.dtype)]


def _shape_rule(call: OpCall) -> list[TensorInfo] | None:
    return _sum_outputs(call) if call.func is aten.sum.dim_IntList else None


@register(
    *REDUCTIONS,
    reads=("dim", "keepdim", "ord", "p", "dtype"),
    check_nd=_every_part_nonempty,
    local_fns={MEAN: _mean, VECTOR_NORM: _vector_norm},
    outputs=floats_only(_shape_rule),
)
def reduction(call: OpCall) -> list[Signature]:
    x = call["self"]
    reduced = _reduced(call)
    keepdim = call.get("keepdim", False)
    split_gives, kept = REDUCTIONS[call.func]
    signatures = []
    for d in range(x.ndim):
        if d not in reduced:
            out_dim = d if keepdim else d - sum(r < d for r in reduced)
            signatures.append(sig(S(out_dim), self=S(d)))
        elif isinstance(split_gives, Partial):
            signatures.append(sig(split_gives, self=S(d)))
        elif split_gives == MEAN:
            signatures.append(sig(P, MEAN, self=S(d)))
        elif split_gives == VECTOR_NORM:
            signatures.append(sig(B, VECTOR_NORM, self=S(d)))
    signatures.append(sig(B, self=B))
    if call.func not in BOOL_ONLY_KEPT or x.dtype == torch.bool:
        signatures += [sig(p, self=p) for p in kept]
    return signatures


@register(aten.cumsum.default, reads=("dim",))
def cumsum(call: OpCall) -> list[Signature]:
    x = call["self"]
    scanned = call.dim("dim") if x.ndim else None
    return [sig(S(d), self=S(d)) for d in range(x.ndim) if d != scanned] + [sig(P, self=P)]


@register(aten.histc.default, reads=("bins", "min", "max"))
def histc(call: OpCall) -> list[Signature]:
    x = call["self"]
    if not call["min"] < call["max"]:
        return []  # the range comes from the data
    if x.dtype.is_floating_point and math.prod(x.shape) > 2 / torch.finfo(x.dtype).eps:
        return []  # a count the dtype cannot hold exactly
    return [sig(P, self=S(d)) for d in range(x.ndim)]
