"""The dispatcher: ``dispatch``, called by ``GlobalTensor.__torch_dispatch__``, runs an aten op on global tensors.

One bounded LRU cache, ``CALLS``, maps each call key (``_bound.call_key``) to its entry (a ``CallPlan``, a ``Fallback``
with its reason, a foreach plan or an in-place view), which a repeated call looks up and runs. A new key is bound once
(``BoundCall``), checked (one placement for every global input), decided (``_decide.py``), compiled
(``_call_plan.py``) and stored.

A plain tensor with dims beside global tensors is taken here as broadcast on their placement. Plain tensors from user
code never get here: the frontend refuses them above autograd (``_frontend/_plain_inputs.py``) unless implicit
broadcast is on. Those that reach dispatch were built by torch's own formulas below that check (a C++ composite's
index or mask, a backward formula's constant) from shapes and scalars, so they are the same on every rank."""

import contextlib
import contextvars

import torch
from torch.utils._pytree import tree_map

from .. import _comm as comm
from .._layout import GlobalMeta, broadcast
from .._tensor import GlobalTensor, wrap_fresh
from ._bound import BoundCall, call_key
from ._cache import LruCache
from ._call_plan import compile_plan
from ._decide import NoSignature, decide
from ._fallback import VALUE_OPS, Fallback, run_fallback
from ._foreach import first_foreach_call
from ._inplace_view import InplaceView
from ._schema import op_schema

_DETACH = torch.ops.aten.detach.default
CALLS = LruCache()
_cached = CALLS.get  # (bound once: the hit path is read on every op)

# Where the ops this thread dispatches are recorded (see ``recording``); None when not recording.
_RECORDER: contextvars.ContextVar = contextvars.ContextVar("sbp_torch_recorder", default=None)


class MixedTensorError(RuntimeError):
    """A global tensor met a plain tensor with dims from user code. (Not a TypeError: torch turns a TypeError raised for
    ``a + b`` into Python's generic "unsupported operand" message, which would hide this one.)"""


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``GlobalTensor.__torch_dispatch__``."""
    return dispatch(func, args, kwargs or {})


def dispatch(func, args, kwargs):
    """Run the aten op ``func`` on arguments that hold global tensors."""
    if comm.observed():  # (inline, not naming_cause: the C hit path has Dynamo skip this function's own code)
        with comm.caused_by(lambda: str(func)):
            return _dispatch(func, args, kwargs)
    return _dispatch(func, args, kwargs)


def _dispatch(func, args, kwargs):
    if _RECORDER.get() is not None:
        return _recorded(func, args, kwargs)
    if func is _DETACH:  # every gradient accumulated into .grad is detached: the layout cannot change
        return wrap_fresh(args[0]._local.detach(), args[0]._meta)
    key = call_key(func, op_schema(func), args, kwargs)
    try:
        entry = _cached(key)
    except TypeError:  # an unhashable argument: this call is not cached
        entry = None
    if entry is not None and entry.func is func:  # the steady state of a training loop
        return entry.run(func, args, kwargs)
    return _first_call(BoundCall(func, args, kwargs, key))[0]


def _first_call(bound: BoundCall) -> tuple:
    """(The result, the entry) of a call whose key is not in the cache."""
    schema = bound.schema
    if schema.foreach:
        result, entry = first_foreach_call(bound, _dispatch_one)
    elif schema.inplace_view:
        entry = InplaceView.of(bound, _dispatch_one)
        result = entry.run(bound.func, bound.args, bound.kwargs)
    else:
        return _decide_and_run(bound)
    key = bound.hashable_key()
    if key is not None:
        CALLS.put(key, entry)
    return result, entry


def _dispatch_one(bound: BoundCall) -> tuple:
    """(The result, the entry) of one call that is not a foreach call: from the cache, or decided now."""
    key = bound.hashable_key()
    entry = CALLS.get(key) if key is not None else None
    if entry is not None and entry.func is bound.func:
        return entry.run(bound.func, bound.args, bound.kwargs), entry
    return _decide_and_run(bound)


def _decide_and_run(bound: BoundCall) -> tuple:
    _check_operands(bound)
    _refuse_writes_into_copies(bound)
    key = bound.hashable_key()
    if bound.plain:  # implicit broadcast: the call as it runs has global tensors there, and its own key
        bound = BoundCall(bound.func, *_broadcast_plain_tensors(bound))
        key = bound.hashable_key()
        entry = CALLS.get(key) if key is not None else None
        if entry is not None and entry.func is bound.func:
            return entry.run(bound.func, bound.args, bound.kwargs), entry
    func = bound.func
    if func in VALUE_OPS:
        entry = Fallback(func, "its result is a plain value")
    else:
        try:
            entry = compile_plan(bound, decide(bound))
        except NoSignature as why:
            entry = Fallback(func, str(why))
    if key is not None:
        CALLS.put(key, entry)
    if isinstance(entry, Fallback):
        return run_fallback(bound, entry.reason), entry
    return entry.run(func, bound.args, bound.kwargs), entry


def _check_operands(bound: BoundCall) -> None:
    first = bound.tensors[0]
    for g in bound.tensors[1:]:
        if g.placement != first.placement:
            raise ValueError(f"{bound.func}: inputs live on different placements: {first.placement} and {g.placement}")


class WriteIntoCopy(NotImplementedError):
    """An op writes into ``tensor``, a view that sbp_torch computed as a copy (``GlobalMeta.copied``): the write would
    not reach the tensor it is a view of. (The frontend writes such a view back where it knows where it came from:
    ``x[index]``.)"""

    def __init__(self, message: str, tensor: GlobalTensor):
        super().__init__(message)
        self.tensor = tensor


def _refuse_writes_into_copies(bound: BoundCall) -> None:
    """Raise ``WriteIntoCopy`` where the op writes into a view that sbp_torch computed as a copy. Such a tensor's
    key differs from a view's, so no cached plan runs the write first; every rank decides alike."""
    for i in bound.written:
        meta = bound.tensors[i]._meta
        if meta.copied:
            raise WriteIntoCopy(
                f"{bound.func} writes into a view of a global tensor that sbp_torch computed as a copy (the view's "
                f"input had to be re-laid out, or gathered, first; {meta}): the write would not reach the tensor it "
                "is a view of. Write into that tensor through an op of its own layout (a masked write, torch.where), "
                "or lay it out so that the view needs no re-layout (broadcast)",
                bound.tensors[i],
            )


def _broadcast_plain_tensors(bound: BoundCall) -> tuple:
    """The call's ``(args, kwargs)`` with every plain tensor with dims made a broadcast global tensor."""
    placement = bound.placement
    member = placement.local_coord() is not None

    def lift(a):
        if not isinstance(a, GlobalTensor) and any(a is p for p in bound.plain):
            if a.requires_grad:
                raise MixedTensorError(
                    f"{bound.func}: a plain tensor that requires grad cannot be broadcast implicitly"
                )
            meta = GlobalMeta(tuple(a.shape), a.dtype, placement, (broadcast,) * placement.ndim, tuple(a.stride()))
            return GlobalTensor(a if member else a.new_empty(0), meta)
        return a

    return tree_map(lift, (bound.args, bound.kwargs))


@contextlib.contextmanager
def recording(calls: list):
    """Within the block, each aten op this thread (context) dispatches at the top level is appended to ``calls`` as
    ``(op, args, kwargs, result, ran as is, sizes only)``: "as is" when its entry ran the op on the local parts
    unchanged (no boxing, no local function, no fallback, a member rank); "sizes only" when it ran the op on the parts
    as they were but told it the output's local shape for the logical one (a view's reshape, ``expand``). Dispatches
    made while running an op are not recorded."""
    token = _RECORDER.set(calls)
    try:
        yield
    finally:
        _RECORDER.reset(token)


def _recorded(func, args, kwargs):
    calls = _RECORDER.get()
    token = _RECORDER.set(None)
    try:
        out = dispatch(func, args, kwargs)
    finally:
        _RECORDER.reset(token)
    if func is _DETACH:  # (no entry: the part is detached as it is)
        calls.append((func, args, kwargs, out, True, False))
        return out
    try:
        entry = CALLS.peek(call_key(func, op_schema(func), args, kwargs))
    except TypeError:
        entry = None
    ran = entry is not None and entry.func is func
    calls.append((func, args, kwargs, out, ran and entry.as_is, ran and getattr(entry, "sizes_only", False)))
    return out
