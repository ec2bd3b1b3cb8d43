"""The gradient rule of global tensors, on local parts.

The gradient of a global tensor with SBP ``s`` has SBP ``gradient_sbp(s)`` per axis (S(d) -> S(d), B -> B,
P(sum) -> B, P(max|min) -> P(sum)), chosen so that its local parts are the gradients of the local parts. For
P(max|min) each rank's share is the output gradient where its part attains the extreme (split evenly between
ties), which is why those parts sum to the gradient."""

import torch

from .. import _comm as comm
from .._boxing import box_local
from .._layout import GlobalMeta, Partial, SbpType, broadcast, narrow_to, partial_sum


def gradient_sbp(sbp: tuple[SbpType, ...]) -> tuple[SbpType, ...]:
    """The SBP of the gradient of a tensor laid out as ``sbp`` (see the module docstring)."""
    return tuple((broadcast if s.op == "sum" else partial_sum) if isinstance(s, Partial) else s for s in sbp)


def has_extreme(meta: GlobalMeta) -> bool:
    """Whether ``meta`` has a P(max) or P(min) axis, whose gradient needs the forward values."""
    return any(isinstance(s, Partial) and s.op != "sum" for s in meta.sbp)


def _extreme_share(meta: GlobalMeta, local: torch.Tensor, axis: int, out_sbp: tuple, dtype) -> torch.Tensor:
    """For a P(max|min) ``axis`` of ``(local, meta)``: 1/ties where this rank's part attains the extreme, else
    0, cut to this rank's region under ``out_sbp``."""
    n = meta.placement.ndim
    mine = box_local(local, meta, meta.sbp[: axis + 1] + (broadcast,) * (n - axis - 1))
    best = box_local(local, meta, meta.sbp[:axis] + (broadcast,) * (n - axis))
    hits = (mine == best).to(dtype)
    share = hits / comm.all_reduce(hits, "sum", comm.axis_group(meta.placement, axis))
    coord = meta.placement.local_coord()
    starts, _ = meta.region(coord, axis)
    out_starts, out_lengths = meta.with_sbp(out_sbp).region(coord)
    return narrow_to(share, out_starts, out_lengths, starts)


def gradient_part(grad: torch.Tensor, grad_meta: GlobalMeta, meta: GlobalMeta, saved: torch.Tensor | None):
    """This rank's part of the gradient of a tensor of ``meta``, laid out as ``gradient_sbp(meta.sbp)``, from
    this rank's part ``grad`` of the same logical gradient laid out as ``grad_meta``. ``saved`` (the input's
    part) is needed only for P(max|min) axes."""
    target = gradient_sbp(meta.sbp)
    extreme = [a for a, s in enumerate(meta.sbp) if isinstance(s, Partial) and s.op != "sum"]
    if not extreme:
        return box_local(grad, grad_meta, target)
    base = tuple(broadcast if a in extreme else s for a, s in enumerate(target))
    local = box_local(grad, grad_meta, base)
    if meta.placement.local_coord() is not None and meta.numel:
        for axis in extreme:
            local = local * _extreme_share(meta, saved, axis, base, local.dtype)
    return local
