"""Dispatch of aten ops on global tensors: validate inputs, pick output layouts, box, run locally, wrap.

This is the foundation's small rule set: ops that act on each local part independently keep their inputs'
layout (``LAYOUT_RULES``); every other op takes the always-valid route of boxing its inputs to broadcast and
producing broadcast outputs, with a one-time warning naming the op. The full signature table replaces the
fallback op by op.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._conversions import box_local
from ._global_tensor import GlobalTensor
from ._layout import GlobalMeta
from ._sbp import Broadcast, Partial

aten = torch.ops.aten
BROADCAST = Broadcast()


def _no_partial_of(*ops):
    """Layout check: the op commutes with every split and with partials whose reduction is not in ``ops``."""
    return lambda meta: not any(isinstance(s, Partial) and s.op in ops for s in meta.sbp)


_any_layout = lambda meta: True  # noqa: E731
_linear = _no_partial_of("max", "min")  # scaling/adding commutes with sums, not with max/min
_keeps_partial_values = _no_partial_of("sum", "max", "min")

# op -> which input layouts the op can run on part by part, keeping the layout. Inputs must all be global
# with identical metadata (in-place ops box the others to self's layout); other operands must be Python
# numbers, and then only layouts without partials qualify unless the op is a pure scaling.
LAYOUT_RULES = {
    aten.detach.default: _any_layout,
    aten.alias.default: _any_layout,
    aten.clone.default: _any_layout,
    aten.zeros_like.default: _any_layout,
    aten.empty_like.default: _any_layout,
    aten.neg.default: _linear,
    aten.add.Tensor: _linear,
    aten.sub.Tensor: _linear,
    aten.add_.Tensor: _linear,
    aten.sub_.Tensor: _linear,
    aten.mul.Tensor: _linear,
    aten.mul_.Tensor: _linear,
    aten.div.Tensor: _linear,
    aten.div_.Tensor: _linear,
    aten.ones_like.default: _keeps_partial_values,
    aten.full_like.default: _keeps_partial_values,
}
_SCALING = {aten.neg.default, aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_SCALE_BY_OTHER_ONLY = {aten.div.Tensor, aten.div_.Tensor}  # x / g is not linear in g

_warned: set = set()


def _check_operands(func, flat: list) -> list[GlobalTensor]:
    globals_ = [a for a in flat if isinstance(a, GlobalTensor)]
    first = globals_[0]
    for g in globals_[1:]:
        if g.placement != first.placement:
            raise ValueError(f"{func}: inputs live on different placements: {first.placement} and {g.placement}")
    for a in flat:
        if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() > 0:
            raise TypeError(
                f"{func}: cannot mix a global tensor with a plain tensor of shape {tuple(a.shape)}; convert it "
                "with to_global(placement, sbp) first (0-dim tensors and Python scalars are allowed)"
            )
    return globals_


def _is_inplace(func) -> bool:
    return func._schema.name.endswith("_")


def _layout_kept(func, args, globals_: list[GlobalTensor]) -> GlobalMeta | None:
    """The layout the op keeps, or None when the rule does not apply."""
    rule = LAYOUT_RULES.get(func)
    if rule is None:
        return None
    meta = globals_[0]._meta
    if not rule(meta) or any(g.shape != globals_[0].shape for g in globals_):
        return None
    scalars = [a for a in args if not isinstance(a, GlobalTensor)]  # also a number before self: 1.5 - g
    has_partial = any(isinstance(s, Partial) for s in meta.sbp)
    if scalars and has_partial and (func not in _SCALING or len(globals_) > 1):
        return None
    if func in _SCALE_BY_OTHER_ONLY and args[0] is not globals_[0]:
        return None
    if len(globals_) > 1 and has_partial and func in _SCALING:
        return None  # a product of two partial sums is not the partial sum of products
    return meta


def _run_locally(func, args, kwargs, meta: GlobalMeta):
    def local(a):
        return box_local(a._local, a._meta, meta.sbp) if isinstance(a, GlobalTensor) else a

    out = func(*tree_map(local, args), **tree_map(local, kwargs))
    if _is_inplace(func):
        return args[0]
    return GlobalTensor(out, GlobalMeta(meta.shape, out.dtype, meta.placement, meta.sbp))


def _written_globals(func, args, kwargs) -> list[GlobalTensor]:
    """The global tensors the op writes into (self of in-place ops, ``out=`` tensors)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, GlobalTensor) and arg.alias_info is not None and arg.alias_info.is_write:
            written.append(value)
    return written


def _fallback(func, args, kwargs, globals_: list[GlobalTensor]):
    """Box every input to broadcast, run the op on full values, return broadcast outputs; tensors the op
    writes into get the result boxed back into their own layout."""
    if func not in _warned:
        _warned.add(func)
        warnings.warn(f"sbp_torch: no SBP rule of {func} applies to these inputs; it runs on broadcast (gathered) inputs", stacklevel=3)
    placement = globals_[0].placement
    replicated = (BROADCAST,) * placement.ndim
    member = placement.coord_of(torch.distributed.get_rank()) is not None
    full_values: dict[int, torch.Tensor] = {}

    def full(a):
        if not isinstance(a, GlobalTensor):
            return a
        if id(a) not in full_values:
            if member:
                full_values[id(a)] = box_local(a._local, a._meta, replicated)
            else:
                full_values[id(a)] = torch.empty(a.shape, dtype=a.dtype, device="meta")
        return full_values[id(a)]

    out = func(*tree_map(full, args), **tree_map(full, kwargs))
    written = _written_globals(func, args, kwargs)
    for g in written:
        if member and full_values[id(g)] is not g._local:
            g._local.copy_(box_local(full_values[id(g)], g._meta.with_sbp(replicated), g.sbp))
    if written:
        return written[0] if len(written) == 1 else tuple(written)

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        meta = GlobalMeta(tuple(o.shape), o.dtype, placement, replicated)
        return GlobalTensor(o if member else o.new_empty(0, device=globals_[0]._local.device), meta)

    return tree_map(wrap, out)


def dispatch(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    globals_ = _check_operands(func, flat)
    meta = _layout_kept(func, args, globals_)
    if meta is not None:
        return _run_locally(func, args, kwargs, meta)
    return _fallback(func, args, kwargs, globals_)
