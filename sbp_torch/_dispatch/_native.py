"""``GlobalTensor.__torch_dispatch__``: the C hit path (``csrc/dispatch_hit.c``, built by ``setup.py`` into ``_hit``)
where it is built, else the Python ``torch_dispatch``. The C handler runs a cached simple plan (``CallPlan.simple``)
with no Python frame and hands every other call to ``dispatch``, which keys and looks it up again; it reads the same
call cache, so both answer every call alike. ``SBP_TORCH_NATIVE_HIT=0`` keeps the Python handler."""

import contextlib
import os

import torch

from .. import _comm as comm
from .._tensor import GlobalTensor
from ._call_plan import CallPlan, checked_global
from ._dispatcher import _RECORDER, CALLS, dispatch
from ._dispatcher import torch_dispatch as python_torch_dispatch
from ._schema import op_schema

try:
    from ._hit import configure, configure_local, eager_torch_function, local_or_below_autograd
    from ._hit import torch_dispatch as native_torch_dispatch
except ImportError:  # not built (no C compiler at install): the Python handler alone
    configure = configure_local = eager_torch_function = local_or_below_autograd = native_torch_dispatch = None


def _scalar_positions(func) -> frozenset:
    return op_schema(func).scalar_positions


NATIVE = configure is not None and os.environ.get("SBP_TORCH_NATIVE_HIT", "1") not in ("0", "")
if NATIVE:
    configure(  # each keyword is a row of the table of ``configure`` in ``csrc/dispatch_hit.c``
        global_tensor=GlobalTensor,
        tensor=torch.Tensor,
        call_plan=CallPlan,
        entries=CALLS._entries,
        clock=CALLS._clock,
        recorder=_RECORDER,
        detach=torch.ops.aten.detach.default,
        slow_dispatch=dispatch,
        scalar_positions=_scalar_positions,
        checked_global=checked_global,
        local_failure=comm.local_failure,
        make_wrapper=torch.Tensor._make_wrapper_subclass,
        strided=torch.strided,
        op_overload=torch._ops.OpOverload,
    )
    torch_dispatch = native_torch_dispatch
else:
    torch_dispatch = python_torch_dispatch


@contextlib.contextmanager
def python_dispatch():
    """Within the block, global tensors take the Python ``__torch_dispatch__`` instead of the C hit path (for
    comparing or timing one against the other in one process); ``_frontend.python_handlers`` also switches the
    frontend's local calls."""
    kept = GlobalTensor.__dict__["__torch_dispatch__"]
    GlobalTensor.__torch_dispatch__ = classmethod(python_torch_dispatch)
    try:
        yield
    finally:
        GlobalTensor.__torch_dispatch__ = kept


# The Python functions the handler calls: like a Python handler, Dynamo must never take them for frames to compile.
PYTHON_CALLEES = (dispatch, _scalar_positions, checked_global, comm.local_failure) if NATIVE else ()


def native_local_calls(**objects) -> tuple:
    """The C ``_local_or_below_autograd`` of the frontend's local calls and the eager part of its torch function,
    given the objects they read (the table of ``configure_local`` in ``csrc/local_calls_hit.c``); (None, None)
    where the C hit paths are not in use."""
    if not NATIVE:
        return None, None
    configure_local(**objects)
    return local_or_below_autograd, eager_torch_function
