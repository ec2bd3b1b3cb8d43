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


def in_layout_of(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``part``, or a copy of it with the strides of ``like`` (a parameter's or leaf's part) where they differ, or
    of another shape a contiguous copy where ``part`` is not dense: as torch's AccumulateGrad gives a plain
    gradient its leaf's strides. A wrapper's strides are its logical ones, so AccumulateGrad does not see a
    transposed part (the gradient of a weight tied through ``t()``) or an expanded one (the gradient of a sum).
    Left so, the first would make every foreach op of the optimizer take its per-tensor path on CUDA, and the
    second could take no later accumulation or in-place scaling."""
    if part.shape == like.shape and not _same_strides(part, like) and _dense(like):
        return torch.empty_like(like, dtype=part.dtype).copy_(part)  # (empty_like keeps a dense tensor's strides)
    return part if _dense(part) else part.contiguous()  # (laid out otherwise than the leaf: dense at least)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps, in some order of its dims."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape) lay out their elements alike (a dim of size 1 has any stride)."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))
