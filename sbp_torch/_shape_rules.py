"""Output metadata of pointwise ops by rule, not by tracing them on meta tensors.

A decision needs each output's shape and dtype. Running the op on meta tensors gives both for any op, but
for pointwise ops it goes through torch's Python references and costs about 40% of a cache miss. A pointwise
op's output has the broadcast shape of its tensor arguments, and its dtype depends only on their dtypes,
on which of them are 0-dim (they promote like scalars) and on the types of the numbers passed. So the
shape is ``torch.broadcast_shapes`` and the dtype is read off the op run on one-element CPU tensors of the
same dtypes, once per such combination (cached): torch's own promotion, not a copy of its rules.

Where the rule is not sure it returns None and the caller traces: ops that are not tagged pointwise, that
return anything but one tensor, that take ``out=`` or lists of tensors, that draw random numbers (running
them would advance the generator), shapes that do not broadcast or an in-place op whose ``self`` would have
to grow, and combinations the one-element run refuses (the trace then raises the real error).
"""

from __future__ import annotations

import torch

from ._global_tensor import GlobalTensor
from ._schema import facts
from ._signatures.core import TensorInfo

_dtypes: dict = {}  # (op, argument kinds) -> output dtype, or None where the one-element run raised


def _eligible(func) -> bool:
    tags = func.tags
    returns = func._schema.returns
    return (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and len(returns) == 1
        and str(returns[0].type) == "Tensor"
        and not facts(func).outs
    )


def _shape(t: torch.Tensor) -> tuple:
    return t._meta.shape if isinstance(t, GlobalTensor) else tuple(t.shape)  # no torch function for globals


def _kind(value):
    """What of an argument the output dtype can depend on."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, len(_shape(value)) == 0)
    if isinstance(value, (bool, int, float, complex)):
        return ("number", type(value))
    return ("value", value)


def _tiny(value):
    if isinstance(value, torch.Tensor):
        return torch.ones((1,) if _shape(value) else (), dtype=value.dtype)
    return value


def pointwise_outputs(func, args, kwargs) -> list[TensorInfo] | None:
    """``[TensorInfo(shape, dtype)]`` of a pointwise op's output, or None where tracing must decide."""
    if not _eligible(func):
        return None
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v) for v in values):
        return None
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    try:
        shape = tuple(torch.broadcast_shapes(*(_shape(t) for t in tensors)))
    except RuntimeError:
        return None
    alias = func._schema.arguments[0].alias_info
    if alias is not None and alias.is_write and (not args or _shape(args[0]) != shape):
        return None  # an in-place op cannot grow self: let the trace raise
    try:
        key = (func, tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in kwargs.items()))
        hash(key)
    except TypeError:
        return None
    if key not in _dtypes:
        try:
            out = func(*(_tiny(a) for a in args), **{k: _tiny(v) for k, v in kwargs.items()})
            _dtypes[key] = out.dtype
        except Exception:  # noqa: BLE001 - not sure: the trace decides, and raises the real error
            _dtypes[key] = None
    dtype = _dtypes[key]
    return None if dtype is None else [TensorInfo(shape, dtype)]
