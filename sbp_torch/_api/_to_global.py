"""``to_global``: local tensors to a global tensor, and a global tensor to another layout or placement.

From local tensors, each rank's tensor is its part of the logical tensor. Uneven parts are allowed: they are
agreed on (every rank learns every part's shape before any data moves), assembled and re-cut into the
balanced parts that a global tensor holds, and the gradient comes back cut like the parts that went in."""

import torch
import torch.distributed as dist
from torch._guards import CompileContext
from torch.compiler import is_dynamo_compiling

from .. import _comm as comm
from .._boxing import box_local, cross_target
from .._comm import compiling
from .._layout import Broadcast, GlobalMeta, Placement, SbpType, Split, broadcast, normalize_sbp
from .._tensor import GlobalTensor, from_whole, full_tensor, gradient, has_extreme, to_placement, to_sbp

_FROM_PARTS = "to_global of local parts"


class _FromLocal(torch.autograd.Function):
    @staticmethod
    @comm.naming_cause(lambda *_: _FROM_PARTS)
    def forward(ctx, local: torch.Tensor, meta: GlobalMeta, shapes: dict | None, sync_data: bool = True):
        ctx.meta, ctx.shapes = meta, shapes
        ctx.input_shape, ctx.input_dtype = local.shape, local.dtype
        if shapes is None:  # every rank holds the whole value: each keeps its region, nothing moves
            return from_whole(local.detach(), meta)
        part = _assemble(local.detach(), meta, shapes, take_first=sync_data)
        # The tie shares of P(max|min) axes come from the values the part holds: this rank's own along those axes,
        # the first rank's along broadcast ones (whose other values are ignored), re-cut to the balanced region.
        ctx.saved_local = part if has_extreme(meta) else None
        return GlobalTensor(part, meta)

    @staticmethod
    @comm.naming_cause(lambda *_: _FROM_PARTS)
    def backward(ctx, grad):
        if ctx.shapes is None:
            return full_tensor(grad), None, None, None
        part = _to_parts(gradient(grad, ctx.meta, ctx.saved_local), ctx.shapes)
        if ctx.meta.placement.local_coord() is None:  # outside the placement: x was not used
            part = torch.zeros(ctx.input_shape, dtype=ctx.input_dtype, device=part.device)
        return part, None, None, None


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


def _assemble(local: torch.Tensor, meta: GlobalMeta, shapes: dict, take_first: bool = True) -> torch.Tensor:
    """This rank's balanced part of the tensor whose parts are the ranks' ``local`` tensors (shapes by coord):
    broadcast axes take index 0's value (unless ``take_first`` is False); unbalanced split parts are gathered
    and re-cut."""
    p = meta.placement
    coord = p.local_coord()
    if coord is None:
        return local.new_empty(0)
    for axis, s in enumerate(meta.sbp):
        if take_first and isinstance(s, Broadcast) and p.shape[axis] > 1:
            local = comm.broadcast(local, comm.axis_group(p, axis))
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
        local = comm.all_gather(local, s.dim, sizes, comm.axis_group(p, axis))
        extents = {
            c: e[: s.dim] + [sum(extents[k][s.dim] for k in line(c))] + e[s.dim + 1 :] for c, e in extents.items()
        }
        gathered[axis] = broadcast
    return box_local(local, meta.with_sbp(tuple(gathered)), meta.sbp)


def _to_parts(g: GlobalTensor, shapes: dict) -> torch.Tensor:
    """This rank's part of ``g`` cut like the (possibly unbalanced) parts ``shapes`` (coordinate -> shape) that
    it was assembled from: the inverse of ``_assemble``, used for the gradient of the local parts."""
    p = g._meta.placement
    coord = p.local_coord()
    if coord is None or all(tuple(g._meta.local_shape(c)) == tuple(shape) for c, shape in shapes.items()):
        return g._local
    released = tuple(broadcast if isinstance(s, Split) else s for s in g.sbp)
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


def _from_local(x: torch.Tensor, p: Placement, sbp, check_meta: bool, sync_data: bool) -> GlobalTensor:
    if not isinstance(p, Placement):
        raise TypeError(f"to_global: placement must be an sbp_torch.placement, got {type(p).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("to_global needs torch.distributed to be initialised (e.g. launch with torchrun)")
    if x.device.type != p.type:
        x = x.to(p.device())
    raw = sbp if isinstance(sbp, (tuple, list)) else (sbp,)
    ndim = x.dim()
    shapes = {}
    if _exchanges(raw, check_meta):
        if CompileContext.current_compile_id() is not None and dist.get_world_size() > 1:  # (a graph break, below)
            raise torch._dynamo.exc.Unsupported(_PARTS_AT_EACH_CALL)
        # Everything that can differ between ranks is checked on the exchanged values, so all ranks agree
        # on whether to raise. Ranks outside the placement pass any tensor of the right dtype.
        agreed = (p.type, p.shape, p.flat_ranks, repr(tuple(raw)), str(x.dtype))
        by_rank = comm.agree("to_global", agreed, tuple(x.shape), check_meta)
        shapes = {p.coord_of(r): by_rank[r] for r in p.flat_ranks}
        ndims = {len(s) for s in shapes.values()}
        if len(ndims) > 1:
            raise ValueError(f"to_global: the local parts have different numbers of dims: {by_rank}")
        ndim = ndims.pop()
    sbp = normalize_sbp(sbp, p, ndim, x.dtype)
    shape = _logical_shape(p, sbp, shapes) if shapes else tuple(x.shape)
    comm.ensure_groups(p)
    return _FromLocal.apply(x, GlobalMeta(shape, x.dtype, p, sbp), shapes, sync_data)


# Dynamo's guards see this rank's part alone, so a compiled graph would keep the other ranks' parts it was compiled
# with, which may change on one rank alone: the call runs eagerly instead, its ranks agreeing at every call
_PARTS_AT_EACH_CALL = (
    "sbp_torch: to_global of this rank's part runs outside the compiled graph, at each call: the global tensor "
    "depends on every rank's part (lay it out before, or unchecked as broadcast, to keep it inside)"
)


def _exchanges(sbp, check: bool | None) -> bool:
    splits = any(isinstance(s, Split) for s in (sbp if isinstance(sbp, (tuple, list)) else (sbp,)))
    return check is None or bool(check) or splits


@torch.compiler.disable(reason=_PARTS_AT_EACH_CALL)
def _from_parts_at_each_call(x, placement, sbp, check_meta, sync_data):
    return to_global(x, placement, sbp, check_meta=check_meta, sync_data=sync_data)


_COMPILED_MOVE = "inside a compiled program, with a gradient: move it outside the compiled function, or detach it"


def from_replica(value: torch.Tensor, placement: Placement, sbp) -> GlobalTensor:
    """The global tensor whose logical value is ``value``, which every rank holds whole and equal (a factory's
    result under global mode): each rank keeps its own region, with no communication and no check. Traceable
    by torch.compile."""
    sbp = normalize_sbp(sbp, placement, value.dim(), value.dtype)
    return _FromLocal.apply(value, GlobalMeta(tuple(value.shape), value.dtype, placement, sbp), None)


@comm.naming_cause(lambda *_, **__: _FROM_PARTS)
def to_global(
    x: torch.Tensor,
    placement: Placement | None = None,
    sbp=None,
    *,
    check_meta: bool | None = None,
    sync_data: bool = True,
):
    """Make ``x`` a global tensor on ``placement`` with ``sbp``, OneFlow style.

    * local -> global: ``x`` is this rank's part. For split, the logical tensor is the concatenation of all
      parts (uneven allowed); for broadcast, the first rank's ``x``, sent to the others (``sync_data=False``:
      each rank's own ``x``, which the caller promises is the same on every rank of the broadcast axes: nothing
      is sent, as OneFlow's ``sync_data=False`` and DTensor's ``from_local``); for partial, the reduction of all
      ``x``. ``check_meta`` (default True here) verifies that all ranks passed the same placement, SBP and dtype.
    * global -> global: boxes ``x`` to ``sbp`` (default: unchanged) with the cheapest collectives; to another
      ``placement`` by point-to-point sends of the slices each destination rank needs.

    Every rank of the default process group must make the same call (ranks outside the placement too).
    Differentiable: the gradient comes back in the input's layout (see ``gradient_sbp``).
    """
    if is_dynamo_compiling() and isinstance(x, torch.Tensor):
        if not isinstance(x, GlobalTensor) and _exchanges(sbp, check_meta) and dist.get_world_size() > 1:
            return _from_parts_at_each_call(x, placement, sbp, check_meta, sync_data)
        # Dynamo records ``x.to_global(...)`` as one call of the method, which AOTAutograd runs through the
        # dispatcher; it cannot trace this body (process-group caches, placements as keys), which it inlines
        # where the call comes as a function: written so, or passed on by a torch function mode (Dynamo, when
        # imported after sbp_torch, takes the method for one of torch's and hands it to the modes; eager never
        # does). Called as the method, with that mode off while it handles the call, it is recorded (or handed
        # to the next mode, which comes back here).
        return x.to_global(placement, sbp, check_meta=check_meta, sync_data=sync_data)
    if isinstance(x, GlobalTensor):
        if not sync_data:
            raise ValueError("to_global: sync_data=False applies to a local tensor (this rank's part); x is global")
        if placement is not None and placement != x.placement:
            dst_meta = cross_target(x._meta, placement, sbp)  # checked before any data moves
            if compiling() and x.requires_grad and set(x.placement.flat_ranks) != set(placement.flat_ranks):
                # its traced backward hangs the ranks outside one placement (docs/compile.md, Limits)
                raise NotImplementedError(f"to_global from {x.placement} to {placement} {_COMPILED_MOVE}")
            if check_meta:
                comm.agree("to_global", (x._meta, dst_meta), (), True)
            comm.ensure_groups(placement)
            return to_placement(x, dst_meta)
        dst = x.sbp if sbp is None else normalize_sbp(sbp, x.placement, x.dim(), x.dtype)
        if check_meta:
            comm.agree("to_global", (x._meta, repr(dst)), (), True)
        return to_sbp(x, dst)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_global takes a tensor, got {type(x).__name__}")
    if placement is None or sbp is None:
        raise ValueError("to_global on a local tensor needs both placement and sbp")
    return _from_local(x, placement, sbp, True if check_meta is None else check_meta, sync_data)
