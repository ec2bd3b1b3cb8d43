"""Each output's shape and dtype, which a decision needs: by rule where one applies, else by tracing (running the op on
meta tensors, which answers for any op); a rule that is not sure returns None.

Tracing a pointwise op goes through torch's Python references: about 40% of a cache miss. Its output has the broadcast
shape of its tensor arguments, and a dtype that depends only on their dtypes, on which of them are 0-dim (they promote
like scalars) and on the types of the numbers passed: it is read off the op run on one-element CPU tensors of the same
dtypes, once per such combination (cached), so it is torch's own promotion, not a copy of its rules. ``SHAPE_RULES``
covers a few ops whose meta kernels are slow Python references (layer norm's took 80% of a miss on a 2x2 placement) or
that every model calls, for float32 and float64 inputs only (whose output dtype is the input's on every device)."""

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .._signatures import TensorInfo
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


def pointwise_outputs(func, args, kwargs) -> list[TensorInfo] | None:
    """``[TensorInfo(shape, dtype)]`` of a pointwise op's output, or None where tracing must decide."""
    tags, returns = func.tags, func._schema.returns
    if not (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags  # running it would advance the generator
        and len(returns) == 1
        and str(returns[0].type) == "Tensor"
        and not op_schema(func).outs
    ):
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


_PLAIN_FLOATS = (torch.float32, torch.float64)


def _dims(dims, ndim: int) -> set | None:
    """``dims`` (an int, a list of them, None or empty: all) as non-negative dims; None if out of range."""
    dims = range(ndim) if dims is None or dims == [] or dims == () else [dims] if isinstance(dims, int) else dims
    out = set()
    for d in dims:
        if not -max(ndim, 1) <= d < max(ndim, 1) or d % max(ndim, 1) in out:
            return None  # out of range or repeated: the op raises
        out.add(d % max(ndim, 1))
    return out


def _layer_norm(a) -> list[TensorInfo] | None:
    x, normalized = a["input"], tuple(a["normalized_shape"])
    shape = _shape(x)
    axis = len(shape) - len(normalized)
    if axis < 0 or shape[axis:] != normalized:
        return None
    stats = shape[:axis] + (1,) * len(normalized)
    return [TensorInfo(shape, x.dtype), TensorInfo(stats, x.dtype), TensorInfo(stats, x.dtype)]


def _softmax(a) -> list[TensorInfo] | None:
    x = a["self"]
    shape = _shape(x)
    if a["half_to_float"] or _dims(a["dim"], len(shape)) is None:
        return None
    return [TensorInfo(shape, x.dtype)]


def _sum_dims(a) -> list[TensorInfo] | None:
    x = a["self"]
    shape = _shape(x)
    dims = _dims(a["dim"], len(shape))
    if dims is None or a.get("dtype") is not None:
        return None
    if a["keepdim"]:
        return [TensorInfo(tuple(1 if i in dims else n for i, n in enumerate(shape)), x.dtype)]
    return [TensorInfo(tuple(n for i, n in enumerate(shape) if i not in dims), x.dtype)]


def _cat(a) -> list[TensorInfo] | None:
    tensors = a["tensors"]
    shapes = [_shape(t) for t in tensors]
    if not tensors or len({len(s) for s in shapes}) != 1 or not shapes[0] or len({t.dtype for t in tensors}) != 1:
        return None
    dims = _dims(a["dim"], len(shapes[0]))
    if dims is None:
        return None
    (dim,) = dims
    if any(s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :] for s in shapes):
        return None
    out = list(shapes[0])
    out[dim] = sum(s[dim] for s in shapes)
    return [TensorInfo(tuple(out), tensors[0].dtype)]


def _transpose(a) -> list[TensorInfo] | None:
    x = a["self"]
    shape = list(_shape(x))
    dims = [_dims(a["dim0"], len(shape)), _dims(a["dim1"], len(shape))]
    if None in dims or not shape:
        return None
    (i,), (j,) = dims
    shape[i], shape[j] = shape[j], shape[i]
    return [TensorInfo(tuple(shape), x.dtype)]


def _mm(a) -> list[TensorInfo] | None:
    x, y = a["self"], a["mat2"]
    xs, ys = _shape(x), _shape(y)
    if len(xs) != 2 or len(ys) != 2 or xs[1] != ys[0] or x.dtype != y.dtype:
        return None
    return [TensorInfo((xs[0], ys[1]), x.dtype)]


def _addmm(a) -> list[TensorInfo] | None:
    bias = a["self"]
    out = _mm({"self": a["mat1"], "mat2": a["mat2"]})
    if out is None or bias.dtype != out[0].dtype:
        return None
    try:
        if tuple(torch.broadcast_shapes(_shape(bias), out[0].shape)) != out[0].shape:
            return None
    except RuntimeError:
        return None
    return out


def _t(a) -> list[TensorInfo] | None:
    x = a["self"]
    shape = _shape(x)
    return None if len(shape) > 2 else [TensorInfo(tuple(reversed(shape)), x.dtype)]


def _view(a) -> list[TensorInfo] | None:
    x, size = a["self"], list(a["size"])
    if any(n < -1 for n in size):
        return None
    numel, known = math.prod(_shape(x)), math.prod(n for n in size if n != -1)
    if size.count(-1) > 1 or (size.count(-1) == 1 and (known == 0 or numel % known)):
        return None
    if -1 in size:
        size[size.index(-1)] = numel // known
    elif known != numel:
        return None
    return [TensorInfo(tuple(size), x.dtype)]


# op -> rule of the bound arguments; the first tensor argument must be float32 or float64
SHAPE_RULES = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.t.default: _t,
    aten.view.default: _view,
    aten.native_layer_norm.default: _layer_norm,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten.sum.dim_IntList: _sum_dims,
    aten.cat.default: _cat,
    aten.transpose.int: _transpose,
}


def ruled_outputs(bound: BoundCall) -> list[TensorInfo] | None:
    """Each output's shape and dtype by rule (pointwise, or ``SHAPE_RULES``), or None where tracing must decide."""
    rule = SHAPE_RULES.get(bound.func)
    if rule is None:
        return pointwise_outputs(bound.func, bound.args, bound.kwargs)
    arguments = bound.by_name
    first = arguments[bound.schema.names[0]]
    first = first[0] if isinstance(first, (list, tuple)) and first else first
    if not isinstance(first, torch.Tensor) or first.dtype not in _PLAIN_FLOATS:
        return None
    return rule(arguments)


class UnknownOutputs(Exception):
    """The op cannot run on meta tensors (no meta kernel, a data-dependent shape, ...)."""


def _on_meta(value):
    if isinstance(value, GlobalTensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value


def infer_outputs(bound: BoundCall) -> list[TensorInfo]:
    """Each tensor output's shape and dtype, by rule or on meta tensors; ``UnknownOutputs`` where neither can tell."""
    ruled = ruled_outputs(bound)
    if ruled is not None:
        return ruled
    try:
        out = bound.func(*tree_map(_on_meta, bound.args), **tree_map(_on_meta, bound.kwargs))
    except Exception as err:  # noqa: BLE001 - no meta kernel, data-dependent shape, ...: the fallback runs it
        raise UnknownOutputs(f"cannot infer output shapes: {err}") from err
    leaves, _ = tree_flatten(out)
    infos = [TensorInfo(tuple(o.shape), o.dtype) for o in leaves if isinstance(o, torch.Tensor)]
    if bound.func is _BATCH_NORM and not bound.by_name["training"] and bound.placement.type == "cpu":
        # torch's CPU kernel returns empty statistics in evaluation where its meta kernel says [C]
        infos[1:] = [TensorInfo((0,), i.dtype) for i in infos[1:]]
    return infos


_BATCH_NORM = torch.ops.aten.native_batch_norm.default
