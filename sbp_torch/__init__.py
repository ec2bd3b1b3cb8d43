"""sbp_torch: OneFlow-style global tensors for PyTorch.

A global tensor is one logical tensor laid out over the ranks of a ``placement`` by one SBP per placement
axis (split, broadcast or partial). Importing this package adds ``to_global`` and ``is_global`` to
``torch.Tensor``.
"""

import torch

from . import sbp
from ._boxing.plan import BoxingPlan, BoxingStep, plan_boxing
from ._collectives import CollectiveError
from ._conversions import full_tensor, gradient_sbp, to_global, to_local
from ._dispatch import MixedTensorError, implicit_broadcast, set_strict
from ._factory import arange, empty, full, ones, rand, randn, tensor, zeros
from ._global_tensor import GlobalTensor
from ._module import module_to_global
from ._placement import placement

__all__ = [
    "BoxingPlan",
    "BoxingStep",
    "CollectiveError",
    "GlobalTensor",
    "MixedTensorError",
    "arange",
    "boxing_plan",
    "empty",
    "full",
    "full_tensor",
    "gradient_sbp",
    "implicit_broadcast",
    "module_to_global",
    "ones",
    "placement",
    "rand",
    "randn",
    "sbp",
    "set_strict",
    "tensor",
    "to_global",
    "to_local",
    "zeros",
]


def boxing_plan(x: GlobalTensor, sbp) -> BoxingPlan:
    """The plan (steps, collectives, bytes) that ``x.to_global(sbp=sbp)`` would run; moves no data."""
    from ._layout import normalize_sbp

    return plan_boxing(x._meta, normalize_sbp(sbp, x.placement, x.dim(), x.dtype))


torch.Tensor.to_global = to_global
torch.nn.Module.to_global = module_to_global
torch.Tensor.is_global = property(lambda self: isinstance(self, GlobalTensor), doc="Whether this is a global tensor.")
