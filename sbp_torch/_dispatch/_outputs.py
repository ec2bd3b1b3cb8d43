"""Each output's shape, dtype and strides, which a decision needs: by rule where one applies, else by tracing (running
the op on meta tensors laid out in the inputs' logical strides, which answers for any op as plain torch would); a rule
that is not sure returns None. Rules state shapes and dtypes only, so they answer where the output is contiguous: an
op that is not a view, on contiguous inputs. Views and ops on inputs laid out otherwise are traced (a view on meta
tensors costs microseconds; an element-wise op on non-contiguous inputs takes torch's layout rules from its trace).

Tracing a pointwise op goes through torch's Python references: about 40% of a cache miss. Its output has the broadcast
shape of its tensor arguments, and a dtype that depends only on their dtypes, on which of them are 0-dim (they promote
like scalars) and on the types of the numbers passed: it is read off the op run on one-element CPU tensors of the same
dtypes, once per such combination (cached), so it is torch's own promotion, not a copy of its rules. A few rules state
their outputs beside their signatures (``Rule.outputs``): ops whose meta kernels are slow Python references (layer
norm's took 80% of a miss on a 2x2 placement) or that every model calls, for float32 and float64 inputs only."""

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .._signatures import OpCall, Rule, TensorInfo
from .._tensor import GlobalTensor
from ._bound import BoundCall
from ._schema import op_schema

aten = torch.ops.aten

_dtypes: dict = {}  # (op, argument kinds) -> output dtype, or None where the one-element run raised


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


def _broadcast_shape(shapes: list[tuple]) -> tuple | None:
    """The shape the tensors of ``shapes`` broadcast to, or None where they do not broadcast. Sizes that are not
    plain ints (symbolic, under tracing) go to torch, which knows how to compare them."""
    if not all(type(n) is int for shape in shapes for n in shape):
        try:
            return tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            return None
    ndim = max(map(len, shapes))
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, ndim - len(shape)):
            if n != 1:
                if out[i] != 1 and out[i] != n:
                    return None
                out[i] = n
    return tuple(out)


def pointwise_outputs(func, args, kwargs) -> list[TensorInfo] | None:
    """``[TensorInfo(shape, dtype)]`` of a pointwise op's output, or None where tracing must decide."""
    if not op_schema(func).simple_pointwise:
        return None
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v) for v in values):
        return None
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    shape = _broadcast_shape([_shape(t) for t in tensors])
    if shape is None:
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


def _contiguous(value) -> bool:
    if isinstance(value, GlobalTensor):
        return value._meta.contiguous
    if isinstance(value, torch.Tensor):
        return value.is_contiguous()
    if isinstance(value, (list, tuple)):
        return all(map(_contiguous, value))
    return True


def ruled_outputs(bound: BoundCall, call: OpCall | None = None, rule: Rule | None = None) -> list[TensorInfo] | None:
    """Each output's shape and dtype (contiguous) by the op's rule (``Rule.outputs``, shown ``call``) or, for a
    pointwise op, by torch's promotion; None where tracing must decide: a view, or inputs that are not contiguous."""
    if (
        getattr(bound.func, "is_view", False)
        or not all(map(_contiguous, bound.args))
        or not all(map(_contiguous, bound.kwargs.values()))
    ):
        return None
    if rule is not None and rule.outputs is not None:
        ruled = rule.outputs(call)
        if ruled is not None:
            return ruled
    return pointwise_outputs(bound.func, bound.args, bound.kwargs)


class UnknownOutputs(Exception):
    """The op cannot run on meta tensors (no meta kernel, a data-dependent shape, ...)."""


def _on_meta(value):
    if isinstance(value, torch.device):  # a cast's target device (the backward of ``.to(dtype)`` names it)
        return torch.device("meta")
    if isinstance(value, GlobalTensor):
        return torch.empty_strided(value.shape, value._meta.strides, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value


def infer_outputs(bound: BoundCall, call: OpCall | None = None, rule: Rule | None = None) -> list[TensorInfo]:
    """Each tensor output's shape, dtype and strides, by rule or on meta tensors; ``UnknownOutputs`` where neither can
    tell."""
    ruled = ruled_outputs(bound, call, rule)
    if ruled is not None:
        return ruled
    try:
        out = bound.func(*tree_map(_on_meta, bound.args), **tree_map(_on_meta, bound.kwargs))
    except Exception as err:  # noqa: BLE001 - no meta kernel, data-dependent shape, ...: the fallback runs it
        raise UnknownOutputs(f"cannot infer output shapes: {err}") from err
    leaves, _ = tree_flatten(out)
    infos = [TensorInfo(tuple(o.shape), o.dtype, tuple(o.stride())) for o in leaves if isinstance(o, torch.Tensor)]
    if bound.func is _BATCH_NORM and not bound.by_name["training"] and bound.placement.type == "cpu":
        # torch's CPU kernel returns empty statistics in evaluation where its meta kernel says [C]
        infos[1:] = [TensorInfo((0,), i.dtype) for i in infos[1:]]
    return infos


_BATCH_NORM = torch.ops.aten.native_batch_norm.default
