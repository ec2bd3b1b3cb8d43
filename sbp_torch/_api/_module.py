"""``nn.Module.to_global``: lay out a model's parameters and buffers; ``GradientReducer`` reduces their gradients.

A module's tensors are taken as the *full logical values* (every rank built the same model; where ranks
differ, the values of the placement's first rank win), so ``split(0)`` keeps one balanced part per rank of
each parameter. This differs on purpose from ``Tensor.to_global`` on a local tensor, where a split tensor is
*one part* of a bigger logical tensor: a model is written for the logical shapes (docs/training.md)."""

import fnmatch
import itertools
from collections.abc import Mapping

import torch
from torch import nn

from .._layout import GlobalMeta, Placement, broadcast, normalize_sbp
from .._tensor import GlobalTensor
from ._experts import install_expert_regions
from ._global_mode import GlobalMode
from ._gradient_reducer import GradientReducer
from ._module_tensors import module_tensors
from ._plain_units import install_plain_units
from ._recompute import TorchFunctionsInRecompute
from ._sharding import MixedPrecision, default_units, shard_model, storage_sbp
from ._to_global import to_global


def _pattern_specificity(pattern: str) -> tuple[int, int]:
    """Exact names beat patterns; then the pattern with more literal characters."""
    wild = sum(pattern.count(c) for c in "*?[")
    return (wild == 0, len(pattern) - wild)


def sbp_for(name: str, tensor: torch.Tensor, sbp, placement: Placement):
    """The SBP of the module tensor ``name`` under the plan ``sbp`` (one SBP, a pattern dict, a callable)."""
    if callable(sbp) and not isinstance(sbp, Mapping):
        chosen = sbp(name, tensor)
    elif isinstance(sbp, Mapping):
        matches = [p for p in sbp if fnmatch.fnmatchcase(name, p)]  # in dict order; max keeps the first of equals
        chosen = sbp[max(matches, key=_pattern_specificity)] if matches else (broadcast,) * placement.ndim
    else:
        chosen = sbp
    try:
        return normalize_sbp(chosen, placement, tensor.dim(), tensor.dtype)
    except (ValueError, TypeError) as err:
        raise type(err)(f"module tensor {name!r} of shape {tuple(tensor.shape)}: {err}") from err


def _globalize(name: str, tensor: torch.Tensor, placement: Placement, sbp, memo: dict, sharding) -> torch.Tensor:
    """The global tensor that stands for ``tensor``; a parameter sharded by ``sharding`` (None, or (axis,
    policy, {id(stored): (stored, compute meta)}) to fill) is stored split over the axis."""
    if id(tensor) in memo:  # tied parameters stay tied
        return memo[id(tensor)]
    sbp = compute = sbp_for(name, tensor, sbp, placement)
    if sharding is not None and isinstance(tensor, nn.Parameter):
        sbp = storage_sbp(name, compute, sharding[0], tensor.dim()) or compute
    replicated = to_global(tensor.detach(), placement, (broadcast,) * placement.ndim)
    value = replicated.to_global(sbp=sbp).detach()
    local = value._local
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # a split kept as a view of the whole would hold the whole tensor alive on every rank
        value = GlobalTensor(local.clone(), value._meta)
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        if sbp != compute:
            dtype = sharding[1].param_dtype or value.dtype
            sharding[2][id(value)] = (
                value,
                GlobalMeta(value._meta.shape, dtype, placement, compute, value._meta.strides),
            )
    memo[id(tensor)] = value
    return value


def _sharding(placement: Placement, shard, mixed_precision) -> tuple | None:
    if shard is None:
        if mixed_precision is not None:
            raise ValueError("mixed_precision applies to sharded parameters: give shard=<the data axis> too")
        return None
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < placement.ndim:
        raise ValueError(f"shard must be a placement axis, 0 to {placement.ndim - 1} for {placement}, got {shard!r}")
    return (shard, mixed_precision or MixedPrecision(), {})


def module_to_global(
    module: nn.Module,
    placement: Placement,
    sbp=None,
    *,
    bucket_mb: float = 25.0,
    shard: int | None = None,
    units: list[str] | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> nn.Module:
    """Lay out every parameter and buffer of ``module`` on ``placement``, in place; returns ``module``.

    Args:
        sbp: one SBP (or tuple, one per placement axis) for every tensor; or a dict from glob patterns on
            the dotted tensor names (``"blocks.*.mlp.up.weight"``) to SBPs, where the most specific match wins
            and unmatched tensors are broadcast; or a callable ``(name, tensor) -> sbp``. Default: broadcast.
        bucket_mb: size of the buckets in which all-reduced gradients are combined.
        shard: a placement axis (the data axis) to shard parameters over, as FSDP and ZeRO do: each parameter
            is stored split over it (what the optimizer, ``state_dict`` and checkpoints see) and gathered to the
            layout ``sbp`` gives it (broadcast on that axis) while the unit that holds it runs; gradients are
            reduce-scattered back to the stored layout (docs/training.md). None: parameters are stored as used.
        units: glob patterns on module names; each matching module gathers its parameters (those of no
            inner unit) together, the root module the rest. Default: the model's blocks (``default_units``).
        mixed_precision: a ``MixedPrecision``: the dtypes sharded parameters are gathered in and gradients
            reduced in (needs ``shard``).

    Each call of ``module`` then runs in global mode on ``placement`` (``global_mode``): tensors its ``forward``
    builds with torch's factories are broadcast global tensors, so unmodified model code runs. A module holding
    tensors on two placements raises when called.

    Under torch.compile the gradients are reduced inside the compiled backward instead, and laying out a model
    turns on Inductor's collective bucketing passes where they are off (docs/compile.md).
    """
    if hasattr(placement, "apply_to") and not isinstance(placement, Placement):  # a planner's Plan
        return placement.apply_to(module)
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be an sbp_torch.placement, got {type(placement).__name__}")
    if sbp is None:
        sbp = (broadcast,) * placement.ndim
    sharding = _sharding(placement, shard, mixed_precision)
    memo: dict = {}
    params = []
    metas: dict = {}
    for full_name, _, table, name, tensor in module_tensors(module):
        if isinstance(tensor, GlobalTensor):
            continue
        new = _globalize(full_name, tensor, placement, sbp, memo, sharding)
        # tensors of equal metadata share one object: the keys of cached calls then compare it by identity (an
        # optimizer's calls, parameter after parameter), not field by field in Python
        new._meta = metas.setdefault(new._meta, new._meta)
        table[name] = new
        if isinstance(new, nn.Parameter) and new.requires_grad and all(new is not p for p in params):
            params.append(new)
    if params:
        GradientReducer(params, bucket_mb, module)
    ForwardInGlobalMode.install(module)
    install_expert_regions(module)
    modules = dict(module.named_modules())
    blocks = [name for name in default_units(module) if name]
    blocks += [name for name in modules if any(fnmatch.fnmatchcase(name, p) for p in units or [])]
    TorchFunctionsInRecompute.install(modules[name] for name in blocks)
    install_plain_units(module, blocks)
    if sharding is not None:
        module._sbp_torch_sharded = shard_model(module, sharding[2], shard, units, sharding[1])
    return module


class ForwardInGlobalMode:
    """The hooks that run each call of a laid-out module under global mode on the placement of its tensors."""

    _ATTRIBUTE = "_sbp_torch_forward_in_global_mode"

    @classmethod
    def install(cls, module: nn.Module) -> None:
        """Install the hooks once per module; a later ``to_global`` updates the placements they read."""
        hooks = getattr(module, cls._ATTRIBUTE, None)
        if hooks is None:
            hooks = cls()
            setattr(module, cls._ATTRIBUTE, hooks)
            module.register_forward_pre_hook(hooks.enter)
            module.register_forward_hook(hooks.leave, always_call=True)
        tensors = itertools.chain(module.parameters(), module.buffers())
        hooks.placements = list(dict.fromkeys(t.placement for t in tensors if isinstance(t, GlobalTensor)))

    def __init__(self):
        self.placements: list = []
        self.active: list = []  # the modes of the calls under way (a module may call itself)

    def enter(self, module: nn.Module, args) -> None:
        if len(self.placements) > 1:
            raise ValueError(
                f"{type(module).__name__} holds tensors on two placements, {self.placements[0]} and "
                f"{self.placements[1]}: one call of a module runs on one placement (lay the parts out as pipeline "
                "stages, or all on one placement)"
            )
        if self.placements:
            mode = GlobalMode(self.placements[0], broadcast)
            mode.__enter__()
            self.active.append(mode)

    def leave(self, module: nn.Module, args, output) -> None:
        if self.active:
            self.active.pop().__exit__(None, None, None)
