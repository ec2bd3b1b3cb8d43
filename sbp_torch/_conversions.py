"""Conversions between local and global tensors and between layouts, all differentiable.

Gradient rule: the gradient of a global tensor with SBP ``s`` has SBP ``gradient_sbp(s)`` per axis (S(d) -> S(d),
B -> B, P(sum) -> B, P(max|min) -> P(sum)), chosen so that its local parts are the gradients of the local
parts. For P(max|min) each rank's share is the output gradient where its part attains the extreme (split evenly
between ties), which is why those parts sum to the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _collectives as coll
from ._agreement import exchange
from ._boxing.cross_placement import cross_target, plan_cross, run_cross
from ._boxing.plan import plan_boxing
from ._boxing.run import run_plan
from ._global_tensor import GlobalTensor
from ._layout import GlobalMeta, normalize_sbp
from ._placement import placement as Placement
from ._process_groups import axis_group, ensure_groups
from ._sbp import Broadcast, Partial, SbpType, Split

BROADCAST = Broadcast()


def gradient_sbp(sbp: tuple[SbpType, ...]) -> tuple[SbpType, ...]:
    """The SBP of the gradient of a tensor laid out as ``sbp`` (see module docstring)."""
    return tuple(
        (BROADCAST if s.op == "sum" else Partial("sum")) if isinstance(s, Partial) else s for s in sbp
    )


def box_local(local: torch.Tensor, meta: GlobalMeta, dst_sbp: tuple[SbpType, ...]) -> torch.Tensor:
    """This rank's part of the tensor ``(local, meta)`` laid out as ``dst_sbp``."""
    return run_plan(local, plan_boxing(meta, dst_sbp))


def _extreme_share(meta: GlobalMeta, local: torch.Tensor, axis: int, out_sbp: tuple, dtype) -> torch.Tensor:
    """For a P(max|min) ``axis`` of ``(local, meta)``: 1/ties where this rank's part attains the extreme, else
    0, cut to this rank's region under ``out_sbp``."""
    n = meta.placement.ndim
    mine = box_local(local, meta, meta.sbp[: axis + 1] + (BROADCAST,) * (n - axis - 1))
    best = box_local(local, meta, meta.sbp[:axis] + (BROADCAST,) * (n - axis))
    hits = (mine == best).to(dtype)
    share = hits / coll.all_reduce(hits, "sum", axis_group(meta.placement, axis))
    coord = meta.placement.coord_of(dist.get_rank())
    starts, _ = meta.region(coord, axis)
    out_starts, out_lengths = meta.with_sbp(out_sbp).region(coord)
    for d, (s, o, length) in enumerate(zip(starts, out_starts, out_lengths)):
        share = share.narrow(d, o - s, length)
    return share


def gradient(grad: GlobalTensor, meta: GlobalMeta, saved_local: torch.Tensor | None) -> GlobalTensor:
    """The gradient of a tensor of ``meta`` from the gradient ``grad`` of the same logical tensor, laid out as
    ``gradient_sbp(meta.sbp)``. ``saved_local`` (the input's part) is needed only for P(max|min) axes."""
    if not isinstance(grad, GlobalTensor):
        raise TypeError(f"expected a global gradient for a global tensor, got a plain {type(grad).__name__}")
    target = gradient_sbp(meta.sbp)
    extreme = [a for a, s in enumerate(meta.sbp) if isinstance(s, Partial) and s.op != "sum"]
    if not extreme:
        return GlobalTensor(box_local(grad._local, grad._meta, target), grad._meta.with_sbp(target))
    base = tuple(BROADCAST if a in extreme else s for a, s in enumerate(target))
    local = box_local(grad._local, grad._meta, base)
    if meta.placement.coord_of(dist.get_rank()) is not None and meta.numel:
        for axis in extreme:
            local = local * _extreme_share(meta, saved_local, axis, base, local.dtype)
    return GlobalTensor(local, grad._meta.with_sbp(target))


def _has_extreme(meta: GlobalMeta) -> bool:
    """Whether ``meta`` has a P(max) or P(min) axis, whose gradient needs the forward values."""
    return any(isinstance(s, Partial) and s.op != "sum" for s in meta.sbp)


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src: GlobalTensor, dst_sbp):
        ctx.meta = src._meta
        extreme = _has_extreme(src._meta)
        ctx.saved_local = src._local if extreme else None
        return GlobalTensor(box_local(src._local, src._meta, dst_sbp), src._meta.with_sbp(dst_sbp))

    @staticmethod
    def backward(ctx, grad):
        return gradient(grad, ctx.meta, ctx.saved_local), None


class _CrossBox(torch.autograd.Function):
    """Boxing to another placement (``_boxing/cross_placement.py``). Backward moves the gradient back across,
    to the input's gradient layout with broadcast on its partial axes, where ``gradient`` keeps tie shares."""

    @staticmethod
    def forward(ctx, src: GlobalTensor, dst: GlobalMeta):
        ctx.meta = src._meta
        ctx.saved_local = src._local if _has_extreme(src._meta) else None
        return GlobalTensor(run_cross(src._local, plan_cross(src._meta, dst)), dst)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, GlobalTensor):
            raise TypeError(f"expected a global gradient for a global tensor, got a plain {type(grad).__name__}")
        released = tuple(BROADCAST if isinstance(s, Partial) else s for s in ctx.meta.sbp)
        back = GlobalMeta(grad._meta.shape, grad._meta.dtype, ctx.meta.placement, released)
        moved = GlobalTensor(run_cross(grad._local, plan_cross(grad._meta, back)), back)
        return gradient(moved, ctx.meta, ctx.saved_local), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, meta: GlobalMeta, shapes: dict):
        ctx.meta, ctx.shapes = meta, shapes
        ctx.input_shape, ctx.input_dtype = local.shape, local.dtype
        extreme = _has_extreme(meta)
        # The tie shares of P(max|min) axes come from this rank's own values, re-cut to the balanced region.
        ctx.saved_local = _assemble(local.detach(), meta, shapes, broadcast=False) if extreme else None
        return GlobalTensor(_assemble(local.detach(), meta, shapes), meta)

    @staticmethod
    def backward(ctx, grad):
        part = _to_parts(gradient(grad, ctx.meta, ctx.saved_local), ctx.shapes)
        if ctx.meta.placement.coord_of(dist.get_rank()) is None:  # outside the placement: x was not used
            part = torch.zeros(ctx.input_shape, dtype=ctx.input_dtype, device=part.device)
        return part, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GlobalTensor, grad_sbp_: tuple[SbpType, ...]):
        ctx.meta = g._meta.with_sbp(grad_sbp_)
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx, grad):
        return GlobalTensor(grad, ctx.meta), None


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GlobalTensor):
        ctx.meta = g._meta
        extreme = _has_extreme(g._meta)
        ctx.saved_local = g._local if extreme else None
        return box_local(g._local, g._meta, (BROADCAST,) * g._meta.placement.ndim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank is taken to hold the same gradient of the logical tensor (they ran the same program).
        replicated = ctx.meta.with_sbp((BROADCAST,) * ctx.meta.placement.ndim)
        if isinstance(grad, GlobalTensor):  # the full tensor met global tensors as a 0-dim operand
            grad = box_local(grad._local, grad._meta, (BROADCAST,) * grad._meta.placement.ndim)
        if ctx.meta.placement.coord_of(dist.get_rank()) is None:
            grad = grad.new_empty(0)
        return gradient(GlobalTensor(grad, replicated), ctx.meta, ctx.saved_local)


def _split_axes(sbp: tuple[SbpType, ...], dim: int) -> list[int]:
    return [a for a, s in enumerate(sbp) if isinstance(s, Split) and s.dim == dim]


def _logical_shape(p: Placement, sbp: tuple, shapes: dict) -> tuple[int, ...]:
    """The shape of the concatenation of the parts ``shapes`` (coordinate -> shape), or ValueError."""
    ndim = len(shapes[(0,) * p.ndim])
    logical = []
    for d in range(ndim):
        axes = _split_axes(sbp, d)
        owners = [c for c in shapes if all(c[a] == 0 for a in range(p.ndim) if a not in axes)]
        logical.append(sum(shapes[c][d] for c in owners))
        for c, shape in shapes.items():
            projected = tuple(c[a] if a in axes else 0 for a in range(p.ndim))
            if shape[d] != shapes[projected][d]:
                table = ", ".join(f"rank {p.rank_at(k)}: {tuple(v)}" for k, v in shapes.items())
                raise ValueError(
                    f"to_global: the local parts cannot be concatenated into one tensor with sbp {sbp}: "
                    f"dim {d} of rank {p.rank_at(c)} has {shape[d]} rows but rank {p.rank_at(projected)} "
                    f"has {shapes[projected][d]}; parts are {table}"
                )
    return tuple(logical)


def _assemble(local: torch.Tensor, meta: GlobalMeta, shapes: dict, broadcast: bool = True) -> torch.Tensor:
    """This rank's balanced part of the tensor whose parts are the ranks' ``local`` tensors (shapes by coord):
    broadcast axes take index 0's value (unless ``broadcast`` is False); unbalanced split parts are gathered
    and re-cut."""
    p = meta.placement
    coord = p.coord_of(dist.get_rank())
    if coord is None:
        return local.new_empty(0)
    for axis, s in enumerate(meta.sbp):
        if broadcast and isinstance(s, Broadcast) and p.shape[axis] > 1:
            local = coll.broadcast(local, axis_group(p, axis))
    if all(tuple(meta.local_shape(c)) == tuple(shape) for c, shape in shapes.items()):
        return local
    # Unbalanced parts: gather every split axis (last first), then cut balanced parts locally.
    extents = {c: list(shape) for c, shape in shapes.items()}
    gathered = list(meta.sbp)
    for axis in reversed(range(p.ndim)):
        s = meta.sbp[axis]
        if not isinstance(s, Split):
            continue
        line = lambda c: [c[:axis] + (i,) + c[axis + 1 :] for i in range(p.shape[axis])]  # noqa: E731
        sizes = [extents[c][s.dim] for c in line(coord)]
        local = coll.all_gather(local, s.dim, sizes, axis_group(p, axis))
        extents = {c: e[: s.dim] + [sum(extents[k][s.dim] for k in line(c))] + e[s.dim + 1 :] for c, e in extents.items()}
        gathered[axis] = BROADCAST
    return box_local(local, meta.with_sbp(tuple(gathered)), meta.sbp)


def _to_parts(g: GlobalTensor, shapes: dict) -> torch.Tensor:
    """This rank's part of ``g`` cut like the (possibly unbalanced) parts ``shapes`` (coordinate -> shape) that
    it was assembled from: the inverse of ``_assemble``, used for the gradient of the local parts."""
    p = g._meta.placement
    coord = p.coord_of(dist.get_rank())
    if coord is None or all(tuple(g._meta.local_shape(c)) == tuple(shape) for c, shape in shapes.items()):
        return g._local
    released = tuple(BROADCAST if isinstance(s, Split) else s for s in g.sbp)
    local = box_local(g._local, g._meta, released)
    for d, length in enumerate(shapes[coord]):
        axes = _split_axes(g.sbp, d)
        if not axes:
            continue
        # Parts nest in axis order: the ones before this rank's along d are those that come first in
        # lexicographic order of the split axes' coordinates (with the other coordinates at 0).
        key = lambda c: tuple(c[a] for a in axes)  # noqa: E731
        start = sum(
            shape[d]
            for c, shape in shapes.items()
            if key(c) < key(coord) and all(c[a] == 0 for a in range(p.ndim) if a not in axes)
        )
        local = local.narrow(d, start, length)
    return local


def _from_local(x: torch.Tensor, p: Placement, sbp, check_meta: bool) -> GlobalTensor:
    if not isinstance(p, Placement):
        raise TypeError(f"to_global: placement must be an sbp_torch.placement, got {type(p).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("to_global needs torch.distributed to be initialised (e.g. launch with torchrun)")
    if x.device.type != p.type:
        x = x.to(p.device())
    raw = sbp if isinstance(sbp, (tuple, list)) else (sbp,)
    ndim = x.dim()
    shapes = {}
    if check_meta or any(isinstance(s, Split) for s in raw):
        # Everything that can differ between ranks is checked on the exchanged values, so all ranks agree
        # on whether to raise. Ranks outside the placement pass any tensor of the right dtype.
        agreed = (p.type, p.shape, p.flat_ranks, repr(tuple(raw)), str(x.dtype))
        by_rank = exchange("to_global", agreed, tuple(x.shape), check_meta)
        shapes = {p.coord_of(r): by_rank[r] for r in p.flat_ranks}
        ndims = {len(s) for s in shapes.values()}
        if len(ndims) > 1:
            raise ValueError(f"to_global: the local parts have different numbers of dims: {by_rank}")
        ndim = ndims.pop()
    sbp = normalize_sbp(sbp, p, ndim, x.dtype)
    shape = _logical_shape(p, sbp, shapes) if shapes else tuple(x.shape)
    ensure_groups(p)
    return _FromLocal.apply(x, GlobalMeta(shape, x.dtype, p, sbp), shapes)


def to_global(x: torch.Tensor, placement: Placement | None = None, sbp=None, *, check_meta: bool | None = None):
    """Make ``x`` a global tensor on ``placement`` with ``sbp``, OneFlow style.

    * local -> global: ``x`` is this rank's part. For split, the logical tensor is the concatenation of all
      parts (uneven allowed); for broadcast, the first rank's ``x``; for partial, the reduction of all ``x``.
      ``check_meta`` (default True here) verifies that all ranks passed the same placement, SBP and dtype.
    * global -> global: boxes ``x`` to ``sbp`` (default: unchanged) with the cheapest collectives; to another
      ``placement`` by point-to-point sends of the slices each destination rank needs.

    Every rank of the default process group must make the same call (ranks outside the placement too).
    Differentiable: the gradient comes back in the input's layout (see ``gradient_sbp``).
    """
    if isinstance(x, GlobalTensor):
        if placement is not None and placement != x.placement:
            dst_meta = cross_target(x._meta, placement, sbp)  # checked before any data moves
            if check_meta:
                exchange("to_global", (x._meta, dst_meta), (), True)
            ensure_groups(placement)
            return _CrossBox.apply(x, dst_meta)
        dst = x.sbp if sbp is None else normalize_sbp(sbp, x.placement, x.dim(), x.dtype)
        if check_meta:
            exchange("to_global", (x._meta, repr(dst)), (), True)
        return x if dst == x.sbp else _Box.apply(x, dst)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_global takes a tensor, got {type(x).__name__}")
    if placement is None or sbp is None:
        raise ValueError("to_global on a local tensor needs both placement and sbp")
    return _from_local(x, placement, sbp, True if check_meta is None else check_meta)


def to_local(x: GlobalTensor, *, grad_sbp=None) -> torch.Tensor:
    """This rank's part of ``x`` (an empty tensor on a rank outside the placement).

    Differentiable: the local gradient becomes a global gradient laid out as ``grad_sbp`` (default
    ``gradient_sbp(x.sbp)``: broadcast for broadcast and partial-sum tensors, so ranks must agree on it).
    """
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"to_local takes a global tensor, got a plain {type(x).__name__}")
    target = gradient_sbp(x.sbp) if grad_sbp is None else normalize_sbp(
        grad_sbp, x.placement, x.dim(), x.dtype
    )
    return _ToLocal.apply(x, target)


def full_tensor(x: GlobalTensor) -> torch.Tensor:
    """The logical tensor as a plain tensor on every rank of the placement (empty outside it)."""
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"full_tensor takes a global tensor, got a plain {type(x).__name__}")
    return _FullTensor.apply(x)
