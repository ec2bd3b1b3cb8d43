"""``GlobalTensor.__torch_function__``: what a torch function on global tensors takes, in order:

1. getters (``shape``, ``grad``, ...) and functions known to return views go straight on, below autograd;
2. a plain tensor with dims from user code beside global tensors raises, unless implicit broadcast is on
   (``_plain_inputs.py``); an assignment ``x[index] = value`` whose index cuts a dim that ``x`` splits is written
   as a masked write, and ``fill_diagonal_`` as a masked fill; ``t.data = v`` takes ``v``'s part
   (``_assignment.py``);
3. ``torch.matmul`` of batched global tensors becomes one ``aten.matmul`` (``_batched_matmul.py``), which
   torch would flatten in a way that loses a split of the heads dim; grouped-query attention on CUDA has its key
   and value heads repeated, so that it reaches a fused kernel rather than a flattening math path
   (``_grouped_attention.py``);
4. a call that autograd does not record may run on the local parts directly (``_local_calls.py``), except
   while torch.compile traces: a traced program is planned once, so the shortcut would save nothing, and it
   reads the local parts, which a trace must reach only through ``__torch_dispatch__``;
5. everything else goes below autograd to ``__torch_dispatch__``, the dispatcher.

Where the C hit paths are built (``csrc/local_calls_hit.c``), an eager call past step 1 runs steps 2 to 5 in C when none
of steps 2, 3 and the compile check has anything to do (no plain tensor with dims, no write step 2 rewrites, no
batched matmul or attention, no compilation); otherwise C does nothing and the steps run here in Python."""

import contextlib

import torch
from torch.compiler import is_dynamo_compiling

from .._comm import compiling
from .._dispatch import WriteIntoCopy, native_local_calls, python_dispatch
from .._layout import Broadcast
from ._assignment import (
    DATA,
    FILL_DIAGONAL,
    GETITEM,
    SETITEM,
    assign,
    fill_diagonal,
    index_of,
    remember_index,
    set_data,
    through_a_copy,
    written_back,
)
from ._batched_matmul import MATMUL_FUNCS, BatchedMatmul, applies
from ._below_autograd import below_autograd, run_below_autograd, values_read, without_torch_function
from ._gradient_boundary import at_uses
from ._grouped_attention import SDPA_FUNCS, with_repeated_heads
from ._grouped_attention import applies as grouped_attention
from ._local_calls import _REFUSED, DISPATCH_ONLY, ENABLED, FLOATS_BY_TYPE, LOCAL_CALLS, NOT_HANDLED, LocalCall, call
from ._plain_inputs import check_plain_inputs


def torch_function(cls, func, types, args=(), kwargs=None):
    """``GlobalTensor.__torch_function__`` (see the module docstring)."""
    try:
        if func in DISPATCH_ONLY:
            if len(args) > 1 or kwargs:  # (a getter takes its tensor alone: nothing plain to refuse)
                check_plain_inputs(func, args, kwargs)
            result = below_autograd(func, types, args, kwargs)
            return remember_index(args, result) if func is GETITEM else result
        if _EAGER is not None and not torch.compiler.is_compiling():  # (Dynamo, tracing this, reads True)
            result = without_torch_function(_EAGER, types, (func, types, args, kwargs))
            if result is not NOT_HANDLED:
                return remember_index(args, result) if func is GETITEM else result
        check_plain_inputs(func, args, kwargs)
        if func is SETITEM and through_a_copy(*args[:2]):
            return _assigned_eagerly(*args) if is_dynamo_compiling() else assign(*args)
        if func == _SET_DATA:  # (t.data = v)
            return set_data(*args)
        if func is FILL_DIAGONAL and not all(isinstance(s, Broadcast) for s in args[0]._meta.sbp):
            return fill_diagonal(*args, **(kwargs or {}))
        if func in MATMUL_FUNCS and applies(func, args, kwargs or {}):
            return BatchedMatmul.apply(*args)
        if func in SDPA_FUNCS and grouped_attention(func, args, kwargs or {}):
            args, kwargs = with_repeated_heads(args, kwargs or {})
            return func(*args, **kwargs)
        if compiling():
            args, kwargs = at_uses(func, args, kwargs)
            return below_autograd(func, types, args, kwargs)
        result = without_torch_function(_LOCAL_OR_BELOW_AUTOGRAD, types, (func, types, args, kwargs))
        return remember_index(args, result) if func is GETITEM else result
    except WriteIntoCopy as refused:
        if index_of(refused.tensor) is None:
            raise
        return written_back(refused.tensor, lambda: func(*args, **(kwargs or {})))


_SET_DATA = DATA.__set__  # (a method-wrapper: made anew at each access, equal to this one)
_EAGERLY = "an assignment through an index that cuts a dim its tensor splits is written eagerly"


@torch.compiler.disable(reason=_EAGERLY)
def _assigned_eagerly(x, index, value):
    assign(x, index, value)


def _local_or_below_autograd(func, types, args, kwargs):
    """A local call where it may be one, else the call below autograd; run with torch functions off (one entry into
    torch's trampoline serves both)."""
    result = call(func, types, args, kwargs)
    return run_below_autograd(func, args, kwargs) if result is NOT_HANDLED else result


# ``_local_or_below_autograd`` in C where the hit paths are built (``csrc/local_calls_hit.c``): a learnt local call that
# returns a tensor, an argument or None, and every call that is no local call, run there; first sights, learning and
# other returns go to the Python function, so both answer every call alike. With it, ``_EAGER`` runs the steps of
# ``torch_function`` above for an eager call in C, and answers ``NOT_HANDLED``, having done nothing, where the Python
# steps must see the call (a plain tensor with dims, a write of ``_assignment.py``, a batched matmul or attention, a
# compilation under way).
_COMPILE_TLS = getattr(torch._guards, "_TLS", None)
_NATIVE_LOCAL, _EAGER = (
    native_local_calls(
        entries=LOCAL_CALLS._entries,
        clock=LOCAL_CALLS._clock,
        pop=LOCAL_CALLS.pop,
        floats_by_type=FLOATS_BY_TYPE,
        refused=_REFUSED,
        local_call=LocalCall,
        python=_local_or_below_autograd,
        values_read=values_read,
        increment_version=torch._C._increment_version,
        dispatch_modes=torch._C._len_torch_dispatch_stack,
        autocast=torch._C._is_any_autocast_enabled,
        grad_enabled=torch.is_grad_enabled,
        not_handled=NOT_HANDLED,
        special=frozenset(MATMUL_FUNCS) | frozenset(SDPA_FUNCS) | {SETITEM, _SET_DATA, FILL_DIAGONAL},
        compile_tls=_COMPILE_TLS,
    )
    if ENABLED and _COMPILE_TLS is not None
    else (None, None)
)
_LOCAL_OR_BELOW_AUTOGRAD = _NATIVE_LOCAL or _local_or_below_autograd


@contextlib.contextmanager
def python_handlers(dispatch: bool = True, local_calls: bool = True):
    """Within the block, global tensors take sbp_torch's Python handlers instead of its C hit paths
    (``csrc/hit_module.c``): the dispatcher's (``dispatch``) and the frontend's local calls and eager steps
    (``local_calls``), for comparing or timing one against the other in one process. Where the C paths are not
    built, it changes nothing."""
    global _EAGER, _LOCAL_OR_BELOW_AUTOGRAD
    kept = _EAGER, _LOCAL_OR_BELOW_AUTOGRAD
    with python_dispatch() if dispatch else contextlib.nullcontext():
        if local_calls:
            _EAGER, _LOCAL_OR_BELOW_AUTOGRAD = None, _local_or_below_autograd
        try:
            yield
        finally:
            _EAGER, _LOCAL_OR_BELOW_AUTOGRAD = kept
