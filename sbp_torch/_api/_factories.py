"""Creation of global tensors: each rank builds only its own part, with no communication."""

import torch

from .. import _comm as comm
from .._boxing import box_local
from .._layout import GlobalMeta, Placement, narrow_to, normalize_sbp, partials_as_broadcast, random_region
from .._tensor import GlobalTensor, gradient


def _size(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(n, int) and n >= 0 for n in size):
        raise ValueError(f"size must be non-negative ints, got {size}")
    return tuple(size)


def _meta(shape, placement, sbp, dtype) -> GlobalMeta:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be an sbp_torch.placement, got {type(placement).__name__}")
    return GlobalMeta(tuple(shape), dtype, placement, normalize_sbp(sbp, placement, len(shape), dtype))


def _build(meta: GlobalMeta, region, requires_grad: bool) -> GlobalTensor:
    """The global tensor whose logical values in a box are ``region(starts, lengths)`` (given None on ranks
    outside the placement). Partial axes are built as broadcast, then made partial locally (the value on index
    0 for sums, everywhere for max/min), which moves no data."""
    comm.ensure_groups(meta.placement)
    coord = meta.placement.local_coord()
    as_broadcast = meta.with_sbp(partials_as_broadcast(meta.sbp))
    if coord is None:
        region(None, None)
        local = torch.empty(0, dtype=meta.dtype, device=meta.placement.device())
    else:
        local = region(*as_broadcast.region(coord))
        if local.device.type != "meta":  # (the planner's factories keep meta parts: shapes only)
            local = local.to(meta.placement.device())
        local = box_local(local, as_broadcast, meta.sbp)
    out = GlobalTensor(local, meta, requires_grad=requires_grad)
    if requires_grad:
        # Ops without an SBP rule hand back broadcast gradients: lay each gradient out as gradient_sbp(sbp)
        # (split stays split) before it is accumulated into the leaf's .grad
        out.register_hook(lambda grad: gradient(grad, meta, local))
    return out


def _constant(value, size, placement, sbp, dtype, requires_grad):
    meta = _meta(_size(size), placement, sbp, dtype or torch.get_default_dtype())
    return _build(meta, lambda s, n: None if n is None else torch.full(n, value, dtype=meta.dtype), requires_grad)


def zeros(*size, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor of zeros with logical shape ``size``."""
    return _constant(0, size, placement, sbp, dtype, requires_grad)


def ones(*size, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor of ones with logical shape ``size``."""
    return _constant(1, size, placement, sbp, dtype, requires_grad)


def full(size, fill_value, *, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor filled with ``fill_value``; ``dtype`` defaults to what ``torch.full`` infers."""
    dtype = dtype or torch.full((), fill_value).dtype
    return _constant(fill_value, (tuple(size),), placement, sbp, dtype, requires_grad)


def empty(*size, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor with uninitialised values (partial axes hold zeros off the owner)."""
    meta = _meta(_size(size), placement, sbp, dtype or torch.get_default_dtype())
    return _build(meta, lambda s, n: None if n is None else torch.empty(n, dtype=meta.dtype), requires_grad)


def _random(kind, size, placement, sbp, dtype, requires_grad):
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise TypeError(f"random tensors need a floating dtype, got {dtype}")
    meta = _meta(_size(size), placement, sbp, dtype)
    device = placement.device()
    return _build(meta, lambda s, n: random_region(kind, meta.shape, dtype, s, n, device), requires_grad)


def randn(*size, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """Standard normal values; with equal seeds, the logical value is the same for any placement and SBP
    (and equals ``torch.randn(size)`` on CPU)."""
    return _random("normal", size, placement, sbp, dtype, requires_grad)


def rand(*size, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """Uniform values in [0, 1); same guarantee as ``randn``."""
    return _random("uniform", size, placement, sbp, dtype, requires_grad)


def _from_value(value: torch.Tensor, placement, sbp, requires_grad) -> GlobalTensor:
    meta = _meta(value.shape, placement, sbp, value.dtype)
    return _build(meta, lambda s, n: None if s is None else narrow_to(value, s, n), requires_grad)


def arange(*args, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """``torch.arange(*args)`` as a global tensor."""
    return _from_value(torch.arange(*args, dtype=dtype), placement, sbp, requires_grad)


def tensor(data, *, placement, sbp, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor whose logical value is ``torch.tensor(data)``; every rank must pass the same data."""
    return _from_value(torch.tensor(data, dtype=dtype), placement, sbp, requires_grad)
