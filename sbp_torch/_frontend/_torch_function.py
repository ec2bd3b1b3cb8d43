"""``GlobalTensor.__torch_function__``: what a torch function on global tensors takes, in order:

1. getters (``shape``, ``grad``, ...) and functions known to return views go straight on, below autograd;
2. a plain tensor with dims from user code beside global tensors raises, unless implicit broadcast is on
   (``_plain_inputs.py``);
3. ``torch.matmul`` of batched global tensors becomes one ``aten.matmul`` (``_batched_matmul.py``), which
   torch would flatten in a way that loses a split of the heads dim; grouped-query attention on CUDA has its key
   and value heads repeated, so that it reaches a fused kernel rather than a flattening math path
   (``_grouped_attention.py``);
4. a call that autograd does not record may run on the local parts directly (``_local_calls.py``), except
   while torch.compile traces: a traced program is planned once, so the shortcut would save nothing, and it
   reads the local parts, which a trace must reach only through ``__torch_dispatch__``;
5. everything else goes below autograd to ``__torch_dispatch__``, the dispatcher."""

from .._comm import compiling
from ._batched_matmul import MATMUL_FUNCS, BatchedMatmul, applies
from ._below_autograd import below_autograd, run_below_autograd, without_torch_function
from ._gradient_boundary import at_uses
from ._grouped_attention import SDPA_FUNCS, with_repeated_heads
from ._grouped_attention import applies as grouped_attention
from ._local_calls import DISPATCH_ONLY, NOT_HANDLED, call
from ._plain_inputs import check_plain_inputs


def torch_function(cls, func, types, args=(), kwargs=None):
    """``GlobalTensor.__torch_function__`` (see the module docstring)."""
    if func in DISPATCH_ONLY:
        return below_autograd(func, types, args, kwargs)
    check_plain_inputs(func, args, kwargs)
    if func in MATMUL_FUNCS and applies(func, args, kwargs or {}):
        return BatchedMatmul.apply(*args)
    if func in SDPA_FUNCS and grouped_attention(func, args, kwargs or {}):
        args, kwargs = with_repeated_heads(args, kwargs or {})
        return func(*args, **kwargs)
    if compiling():
        args, kwargs = at_uses(func, args, kwargs)
        return below_autograd(func, types, args, kwargs)
    return without_torch_function(_local_or_below_autograd, types, (func, types, args, kwargs))


def _local_or_below_autograd(func, types, args, kwargs):
    """A local call where it may be one, else the call below autograd; run with torch functions off (one entry into
    torch's trampoline serves both)."""
    result = call(func, types, args, kwargs)
    return run_below_autograd(func, args, kwargs) if result is NOT_HANDLED else result
