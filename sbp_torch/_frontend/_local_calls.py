"""Local calls: a torch function that autograd does not record runs on the local parts, skipping dispatch.

When autograd records nothing (grad mode off, as in an optimizer step, or no input requires grad), a call whose aten ops
all ran on the local parts unchanged skips ``__torch_dispatch__`` (a Python entry per aten op) on later calls with the
same argument key: the torch function runs on the local parts, its result wrapped as learnt. A key is learnt on its
second call (a shape seen once costs no learning), on the dispatch path, recording each aten op it dispatches; it
becomes a local call only if all of these hold:

* it dispatched at least one aten op (one that dispatches none, such as ``requires_grad_`` or a hook, acts on the
  wrapper itself) and changed no argument's metadata;
* every recorded op ran its call plan as is (no boxing, no local function, no fallback, a member rank: see ``recording``
  in ``_dispatch``), and none is seeded by the random generator;
* the torch function, called again on clones of the local parts, dispatches the same aten ops with the same non-tensor
  arguments, each tensor the part of the global tensor at the same place (this catches composites that compute an
  argument from a shape: the wrapper's shape is the logical one);
* the result is None, an argument the call wrote into and returned, or a new tensor (or a list of them) that aliases no
  input, from a call that writes none. Views stay on the dispatch path, which makes them autograd views of their base,
  sharing its version counter, as torch's in-place checks expect.

A local call bumps the version of each global argument the learning call bumped, so autograd still refuses a backward
through a tensor modified in place. Floats in the key count by value (a composite may branch on one: dropout with
``p=0`` returns its input), except for ``FLOATS_BY_TYPE``, functions binding one element-wise aten op whose rule reads
its numbers only by ``NumberClass``: there a float counts by its class (zero, finite, or inf and nan), so a learning
rate changing every step does not miss, and a partial sum times 2 does not answer a partial sum times inf. Learnt calls
live in ``LOCAL_CALLS``, bounded like the call cache; ``SBP_TORCH_LOCAL_CALLS=0`` turns them off."""

import os
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _comm as comm
from .._dispatch import LruCache, at, find_tensors, recording
from .._layout import GlobalMeta
from .._signatures import NumberClass, number_class
from .._tensor import GlobalTensor, wrap_fresh
from ._below_autograd import below_autograd

NOT_HANDLED = object()  # returned when the call must take the dispatch path
_REFUSED = object()  # cache value of a key that takes the dispatch path
_SEEN = object()  # cache value of a key seen once: it is learnt on its second call

ENABLED = os.environ.get("SBP_TORCH_LOCAL_CALLS", "1") not in ("0", "")

_T = torch.Tensor
FLOATS_BY_TYPE = frozenset(
    [getattr(torch, name) for name in dir(torch) if name.startswith("_foreach_")]
    + [torch.add, torch.sub, torch.mul, torch.div, torch.lerp, torch.addcmul, torch.addcdiv]
    + [_T.add, _T.add_, _T.sub, _T.sub_, _T.mul, _T.mul_, _T.div, _T.div_, _T.lerp, _T.lerp_]
    + [_T.addcmul, _T.addcmul_, _T.addcdiv, _T.addcdiv_, _T.__truediv__, _T.__itruediv__]
    + [_T.__add__, _T.__radd__, _T.__iadd__, _T.__sub__, _T.__isub__, _T.__mul__, _T.__rmul__, _T.__imul__]
)


@dataclass(frozen=True)
class LocalCall:
    """What a learnt call returns, given the local result, and which arguments' versions it bumps."""

    returns: str  # "tensor", "list", "tuple", "argument" (an argument it wrote into) or "none"
    argument: int | str | None  # for "argument": its position or keyword
    outputs: tuple[GlobalMeta, ...]  # for "tensor" and "list": the metadata of each output
    local_shapes: tuple  # this rank's part shape of each output
    # (position or keyword, None for one tensor or the indices in a list, or "all", bumps) of the written
    # global arguments, grouped by argument and count, so a foreach op bumps its lists in one call each
    bumped: tuple

    def finish(self, local, args, kwargs):
        """The call's result from the local result; None when it is not what was learnt (take dispatch)."""
        for slot, indices, count in self.bumped:
            value = at(args, kwargs, (slot, None))
            targets = (value,) if indices is None else value if indices == "all" else [value[i] for i in indices]
            for _ in range(count):
                torch._C._increment_version(targets)
        if self.returns == "tensor":
            meta = self.outputs[0]
            if local.shape != self.local_shapes[0] or local.dtype != meta.dtype:
                return None
            return wrap_fresh(local, meta)
        if self.returns == "argument":
            return at(args, kwargs, (self.argument, None))
        if self.returns == "none":
            return None
        if len(local) != len(self.outputs) or any(
            t.shape != shape or t.dtype != m.dtype for t, m, shape in zip(local, self.outputs, self.local_shapes)
        ):
            return None
        wrapped = [wrap_fresh(t, m) for t, m in zip(local, self.outputs)]
        return wrapped if self.returns == "list" else tuple(wrapped)


LOCAL_CALLS = LruCache()  # (torch function, *argument keys) -> LocalCall, _REFUSED or _SEEN
_cached = LOCAL_CALLS.get  # (bound once: read on every call)
# Torch functions that take the dispatch path whatever their arguments: getters (shape, grad, ...) and
# functions that dispatched nothing and returned no tensor (dim, is_complex, ...), and functions that
# returned a view once (transpose, view, reshape, and so indexing, whose integer and slice indices give views).
DISPATCH_ONLY: set = set()  # (GlobalTensor.__torch_function__ reads it first)


# (float, class) of a float of ``FLOATS_BY_TYPE``, made once each (the C walk makes equal tuples)
_CLASS_KEYS = {c: (float, c.value) for c in NumberClass}


def _walk(values, by_type: bool, grad: bool, key: list, local: list) -> bool:
    """Append each value's key to ``key`` and what the local call passes for it to ``local``; False when the
    call cannot be a local call (autograd records it, or a plain tensor with dims meets a global one)."""
    for v in values:
        t = type(v)
        if t is GlobalTensor:
            if grad and v.requires_grad:
                return False
            key.append(v._meta)
            local.append(v._local)
        elif t is float:
            key.append(_CLASS_KEYS[number_class(v)] if by_type else (float, v))
            local.append(v)
        elif t is int or t is bool:
            key.append((t, v))
            local.append(v)
        elif t is list or t is tuple:
            if v and all([type(e) is GlobalTensor for e in v]):  # a foreach op's list: one comprehension each
                if grad and any([e.requires_grad for e in v]):
                    return False
                key.append((t, tuple([e._meta for e in v])))
                parts = [e._local for e in v]
                local.append(parts if t is list else tuple(parts))
                continue
            inner_key, inner_local = [], []
            if not _walk(v, by_type, grad, inner_key, inner_local):
                return False
            key.append((t, tuple(inner_key)))
            local.append(inner_local if t is list else tuple(inner_local))
        elif isinstance(v, torch.Tensor):
            # (a subclass of GlobalTensor, a plain tensor with dims: the dispatch path decides, or refuses)
            if isinstance(v, GlobalTensor) or v.dim() or (grad and v.requires_grad):
                return False
            key.append(("tensor", v.dtype, v.device))
            local.append(v)
        else:
            key.append(v)
            local.append(v)
    return True


_dispatch_modes = torch._C._len_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled


def call(func, types, args, kwargs):
    """The call's result as a local call (learning it on its second sight), or ``NOT_HANDLED``."""
    if not ENABLED or _dispatch_modes() or _autocast():
        return NOT_HANDLED
    grad = _grad_enabled()
    by_type = func in FLOATS_BY_TYPE
    key, local_args = [func], []
    if not _walk(args, by_type, grad, key, local_args):
        return NOT_HANDLED
    local_kwargs = None
    if kwargs:
        names = tuple(kwargs)
        values = []
        if not _walk(kwargs.values(), by_type, grad, key, values):
            return NOT_HANDLED
        key.append(names)
        local_kwargs = dict(zip(names, values))
    key = tuple(key)
    try:
        plan = _cached(key)
    except TypeError:  # an unhashable argument (a slice, say)
        return NOT_HANDLED
    if plan is None:  # a first sight: the dispatch path alone, so a shape seen once costs no learning
        LOCAL_CALLS.put(key, _SEEN)
        return NOT_HANDLED
    if plan is _SEEN:
        return _learn(func, types, args, kwargs, key)
    if plan is _REFUSED:
        return NOT_HANDLED
    try:
        local = func(*local_args, **local_kwargs) if local_kwargs else func(*local_args)
    except Exception as err:  # the others went on: closes this rank's world (docs/faults.md)
        comm.local_failure(func, err)
        raise
    result = plan.finish(local, args, kwargs)
    if result is None and plan.returns in ("tensor", "list", "tuple"):
        # Not what was learnt (a changed default dtype, say): forget the key; the dispatch path decides.
        LOCAL_CALLS.pop(key)
        return NOT_HANDLED
    return result


def _learn(func, types, args, kwargs, key):
    """Run the call on the dispatch path, recording its aten ops, and learn it as a local call if it qualifies."""
    kwargs = kwargs or {}
    slots, tensors, _ = find_tensors(args, kwargs)
    before = [(g._version, g._meta) for g in tensors]
    recorded = []
    with recording(recorded):
        result = below_autograd(func, types, args, kwargs)
    getter = getattr(func, "__name__", None) == "__get__"  # a property getter (Tensor.grad, ...), as torch passes it
    if (not recorded and (getter or not (isinstance(result, torch.Tensor) or _is_tensor_list(result)))) or (
        isinstance(result, GlobalTensor) and result._is_view()
    ):
        DISPATCH_ONLY.add(func)
        LOCAL_CALLS.pop(key)
        return result
    bumped = _grouped_bumps(args, kwargs, [(slot, g._version - v) for slot, g, (v, _) in zip(slots, tensors, before)])
    plan = None
    # A call that dispatched nothing may act on the wrapper itself (requires_grad_, a hook, the grad
    # setter), and one that changed an argument's metadata acts on more than its part: neither is local.
    if recorded and all(g._meta is meta for g, (_, meta) in zip(tensors, before)):
        try:
            plan = _qualify(func, args, kwargs, tensors, recorded, result, bumped)
        except Exception:  # noqa: BLE001 - learning must never fail a call that ran: it stays on dispatch
            plan = None
    LOCAL_CALLS.put(key, _REFUSED if plan is None else plan)
    return result


def _grouped_bumps(args, kwargs, bumps: list) -> tuple:
    """``LocalCall.bumped`` from ((slot, index), bumps) of each global argument."""
    groups: dict = {}
    for (slot, index), count in bumps:
        if count:
            groups.setdefault((slot, count), []).append(index)
    grouped = []
    for (slot, count), indices in groups.items():
        if indices == [None]:
            grouped.append((slot, None, count))
        else:
            whole = indices == list(range(len(at(args, kwargs, (slot, None)))))
            grouped.append((slot, "all" if whole else tuple(indices), count))
    return tuple(grouped)


def _is_tensor_list(value) -> bool:
    """A non-empty list or tuple (not a named one) of tensors, as foreach ops return."""
    return type(value) in (list, tuple) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _qualify(func, args, kwargs, tensors, recorded, result, bumped) -> LocalCall | None:
    """The local call learnt from one recorded dispatch-path call, or None if it does not qualify."""
    if not all(as_is and torch.Tag.nondeterministic_seeded not in op.tags for op, _, _, _, as_is, _ in recorded):
        return None
    parts = {}  # id(global tensor) -> the tensor the replay passes in its place
    for g in tensors:
        parts.setdefault(id(g), g._local.clone())
    replay = _ReplayRecorder()
    local_args = [_replay_value(a, parts) for a in args]
    local_kwargs = {k: _replay_value(v, parts) for k, v in kwargs.items()}
    cuda = sorted({t.device.index or 0 for t in parts.values() if t.is_cuda})
    try:  # (nothing seeded should run here; if it does, the generators' streams are kept as they were)
        with torch.random.fork_rng(devices=cuda, device_type="cuda"), replay:
            local_result = func(*local_args, **local_kwargs)
    except Exception:  # the function does not run on the parts as they are: not a local call
        return None
    if len(replay.calls) != len(recorded):
        return None
    aliases = set()  # ids of global tensors that an op returned as an alias of an input (views)
    for (op, g_args, g_kwargs, g_out, _, _), (local_op, l_args, l_kwargs, l_out) in zip(recorded, replay.calls):
        if op is not local_op or not _same_arguments((g_args, g_kwargs), (l_args, l_kwargs), parts):
            return None
        g_flat, g_spec = tree_flatten(g_out)
        l_flat, l_spec = tree_flatten(l_out)
        if g_spec != l_spec:
            return None
        for k, (g, local) in enumerate(zip(g_flat, l_flat)):
            if isinstance(g, GlobalTensor):
                if not isinstance(local, torch.Tensor) or local.shape != g._local.shape:
                    return None
                parts[id(g)] = local
                returned = op._schema.returns[min(k, len(op._schema.returns) - 1)]
                if returned.alias_info is not None and not returned.alias_info.is_write:
                    aliases.add(id(g))
    # Every op replayed alike: what the call returns decides the rest.
    if result is None:
        return None if local_result is not None else LocalCall("none", None, (), (), bumped)
    for slot, value in [*enumerate(args), *kwargs.items()]:
        if value is result:  # an argument the call wrote into (a tensor, a foreach op's list), returned as itself
            ok = local_result is at(local_args, local_kwargs, (slot, None))
            return LocalCall("argument", slot, (), (), bumped) if ok else None
    if bumped:  # writes an argument yet returns new tensors: a failed output check could not re-run it
        return None
    if isinstance(result, GlobalTensor):
        outputs = [result]
    elif _is_tensor_list(result) and _is_tensor_list(local_result) and len(local_result) == len(result):
        outputs = result
    else:
        return None
    if isinstance(local_result, torch.Tensor):
        local_result = [local_result]
    argument_ids = {id(g) for g in tensors}
    for g, local in zip(outputs, local_result):
        if (
            type(g) is not GlobalTensor
            or id(g) in aliases
            or id(g) in argument_ids
            or g._is_view()
            or parts.get(id(g)) is not local
        ):
            return None
    return LocalCall(
        "tensor" if isinstance(result, GlobalTensor) else type(result).__name__,
        None,
        tuple(g._meta for g in outputs),
        tuple(g._local.shape for g in outputs),
        bumped,
    )


def _replay_value(value, parts):
    if isinstance(value, GlobalTensor):
        return parts[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(_replay_value(v, parts) for v in value)
    return value


def _same_arguments(global_call, local_call, parts) -> bool:
    """Whether an aten call on the local parts had the arguments of the global one: the part of each global
    tensor where it had that tensor, equal plain tensors and equal other values."""
    g_flat, g_spec = tree_flatten(global_call)
    l_flat, l_spec = tree_flatten(local_call)
    if g_spec != l_spec:
        return False
    for g, local in zip(g_flat, l_flat):
        if isinstance(g, GlobalTensor):
            if parts.get(id(g)) is not local:
                return False
        elif isinstance(g, torch.Tensor):
            if not (
                type(local) is torch.Tensor
                and g.shape == local.shape
                and g.dtype == local.dtype
                and torch.equal(g, local)
            ):
                return False
        elif type(g) is not type(local) or g != local:
            return False
    return True


class _ReplayRecorder(TorchDispatchMode):
    """Records (op, args, kwargs, result) of every aten op the replay dispatches."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out
