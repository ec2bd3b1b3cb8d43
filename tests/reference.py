"""Single-process references for global tensors, used by the multi-rank tests.

The reference of a layout is the definition itself: given every rank's local part (by placement coordinate),
``assemble`` rebuilds the logical tensor by undoing the placement axes from the last to the first (concatenate
splits, take a broadcast copy, reduce partials). It is differentiable, with the gradient conventions of
sbp_torch: every broadcast copy gets the full gradient, and partial max/min split it evenly between ties.
"""

from __future__ import annotations

import itertools

import torch

from sbp_torch._layout import Broadcast, GlobalMeta, Partial, Split


def coords(placement_shape):
    return list(itertools.product(*(range(n) for n in placement_shape)))


class _FirstCopy(torch.autograd.Function):
    """The first of equal copies; every copy receives the full gradient (sbp_torch's broadcast rule)."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.copies = len(parts)
        return parts[0].clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * ctx.copies


def _first_copy(parts):
    return _FirstCopy.apply(*parts)


def _undo(parts: list[torch.Tensor], sbp) -> torch.Tensor:
    if isinstance(sbp, Split):
        return torch.cat(parts, dim=sbp.dim)
    if isinstance(sbp, Broadcast):
        return _first_copy(parts)
    stacked = torch.stack(parts)
    return {
        "sum": lambda: stacked.sum(0, dtype=stacked.dtype),
        "max": lambda: stacked.amax(0),
        "min": lambda: stacked.amin(0),
    }[sbp.op]()


def assemble(parts: dict, placement_shape, sbp) -> torch.Tensor:
    """The logical tensor from ``parts`` (coordinate -> local tensor) laid out as ``sbp``."""
    level = dict(parts)
    for axis in reversed(range(len(placement_shape))):
        merged = {}
        for c in {k[:axis] for k in level}:
            line = [level[c + (i,)] for i in range(placement_shape[axis])]
            merged[c] = _undo(line, sbp[axis])
        level = merged
    return level[()]


def random_parts(meta: GlobalMeta, generator: torch.Generator) -> dict:
    """Random local parts of the balanced shapes of ``meta``; broadcast axes get identical copies."""
    shape = meta.placement.shape
    parts = {}
    for c in coords(shape):
        source = tuple(0 if isinstance(s, Broadcast) else i for s, i in zip(meta.sbp, c))
        if source != c:
            parts[c] = parts[source].clone()
            continue
        local_shape = meta.local_shape(c)
        if meta.dtype.is_floating_point:
            parts[c] = torch.randn(local_shape, generator=generator, dtype=meta.dtype)
        else:
            parts[c] = torch.randint(-5, 6, local_shape, generator=generator).to(meta.dtype)
    return parts


def expected_region(x: torch.Tensor, meta: GlobalMeta, coord) -> torch.Tensor:
    """The slice of logical ``x`` that ``coord`` holds under ``meta`` (ignoring partial axes)."""
    starts, lengths = meta.region(coord)
    return x[tuple(slice(s, s + n) for s, n in zip(starts, lengths))]


def partial_free(meta: GlobalMeta) -> bool:
    return not any(isinstance(s, Partial) for s in meta.sbp)
