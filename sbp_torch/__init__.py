"""sbp_torch: OneFlow-style global tensors for PyTorch.

A global tensor is one logical tensor laid out over the ranks of a ``placement`` by one SBP per placement
axis (split, broadcast or partial). Importing this package adds ``to_global`` and ``is_global`` to
``torch.Tensor`` and ``to_global`` to ``torch.nn.Module``.

The names below are the public API; ``sbp_torch.sbp``, ``sbp_torch.pipeline``, ``sbp_torch.kernels`` and
``sbp_torch.planner`` (imported on its own: it needs scipy) are public modules. Everything in a module or
folder whose name starts with ``_`` is the implementation, laid out in layers (``docs/architecture.md``).
"""

import torch
from torch.optim import optimizer as _optimizer
from torch.utils import _foreach_utils

from . import checkpoint, kernels, sbp
from ._api import (
    Caches,
    Collective,
    CompiledStep,
    Explanation,
    GraphNotRecorded,
    MemoryReport,
    MixedPrecision,
    StepNotTraceable,
    arange,
    cache_clear,
    cache_info,
    compile_step,
    empty,
    explain,
    from_dtensor,
    full,
    global_mode,
    init_process_group,
    local_map,
    memory_report,
    module_from_dtensor,
    module_to_dtensor,
    module_to_global,
    ones,
    rand,
    randn,
    set_cache_size,
    tensor,
    to_dtensor,
    to_global,
    zeros,
)
from ._boxing import BoxingPlan, BoxingStep, plan_boxing
from ._comm import CollectiveError, RanksDisagree
from ._dispatch import PYTHON_CALLEES, MixedTensorError, implicit_broadcast, set_strict, strict, torch_dispatch
from ._frontend import torch_function
from ._layout import Placement as placement
from ._layout import normalize_sbp
from ._tensor import GlobalTensor, connect, full_tensor, gradient_sbp, plain_tangent_as_global, to_local
from .checkpoint import _hooks as _checkpoint_hooks
from .checkpoint import full_state_dict

__all__ = [
    "BoxingPlan",
    "BoxingStep",
    "Caches",
    "Collective",
    "CollectiveError",
    "CompiledStep",
    "GlobalTensor",
    "GraphNotRecorded",
    "MemoryReport",
    "MixedPrecision",
    "MixedTensorError",
    "RanksDisagree",
    "arange",
    "boxing_plan",
    "cache_clear",
    "cache_info",
    "compile_step",
    "empty",
    "Explanation",
    "explain",
    "from_dtensor",
    "full",
    "full_state_dict",
    "full_tensor",
    "global_mode",
    "gradient_sbp",
    "implicit_broadcast",
    "init_process_group",
    "local_map",
    "memory_report",
    "module_from_dtensor",
    "module_to_dtensor",
    "module_to_global",
    "ones",
    "placement",
    "rand",
    "randn",
    "sbp",
    "set_cache_size",
    "set_strict",
    "StepNotTraceable",
    "strict",
    "tensor",
    "to_global",
    "to_dtensor",
    "to_local",
    "zeros",
]


def boxing_plan(x: GlobalTensor, sbp) -> BoxingPlan:
    """The plan (steps, collectives, bytes) that ``x.to_global(sbp=sbp)`` would run; moves no data."""
    return plan_boxing(x._meta, normalize_sbp(sbp, x.placement, x.dim(), x.dtype))


# The one place where the layers are wired together: the tensor type's torch entry points go to the
# frontend and the dispatcher, and torch's own classes gain the conversions.
connect(torch_function=torch_function, torch_dispatch=torch_dispatch, python_callees=PYTHON_CALLEES)
_checkpoint_hooks.install(GlobalTensor)  # the methods torch.distributed.checkpoint looks for
torch.Tensor.to_global = to_global
# (a plain zero gradient for a compiled program's unused global output becomes a global one)
torch.Tensor.__coerce_same_metadata_as_tangent__ = plain_tangent_as_global
torch.nn.Module.to_global = module_to_global
# torch's optimizers and gradient clipping choose their foreach paths (a few ops over all parameters, where the
# per-tensor paths issue about ten per parameter) by default only for the tensor types these lists name, as
# DTensor adds itself to them (private lists: their names are the same from torch 2.11 to 2.13)
for _types in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if GlobalTensor not in _types:
        _types.append(GlobalTensor)
del _types
GlobalTensor.to_dtensor = to_dtensor
torch.Tensor.is_global = property(lambda self: isinstance(self, GlobalTensor), doc="Whether this is a global tensor.")
