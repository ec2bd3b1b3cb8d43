"""DTensor interop: ``GlobalTensor.to_dtensor``, ``from_dtensor`` and their module forms (docs/interop.md).

A placement is the ``DeviceMesh`` of the same rank array, and per axis ``split(d)`` is ``Shard(d)``,
``broadcast`` is ``Replicate()`` and ``partial(op)`` is ``Partial(op)``. The libraries cut an uneven split
differently: sbp_torch into balanced parts (the first ``n % p`` one row longer), DTensor like ``torch.chunk``
(``ceil(n / p)`` rows each, the last ones shorter or empty), nested axis by axis in both. A ``Relayout`` lists
the box of the logical tensor that each rank holds in each library. Where no box differs the local parts are
shared as they are; otherwise each rank receives, point to point, only the pieces of its new box that it does
not hold, from a rank that holds the same partial term (the same coordinate on every partial axis)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from .. import _comm as comm
from .._boxing import Piece
from .._boxing.pieces import Box, holders, partial_term, pieces_from, send_pieces
from .._layout import REDUCE_OPS, GlobalMeta, Partial, Placement, Split, broadcast, normalize_sbp
from .._tensor import GlobalTensor, gradient, has_extreme
from ._gradient_reducer import GradientReducer
from ._module import ForwardInGlobalMode


def _dtensor_placement(sbp) -> object:
    if isinstance(sbp, Split):
        return Shard(sbp.dim)
    return DPartial(sbp.op) if isinstance(sbp, Partial) else Replicate()


def _sbp_of(placement):
    """The SBP of a DTensor placement, or None. Exact types: ``_StridedShard``, ``_MaskPartial`` and the like
    lay data out otherwise."""
    if type(placement) is Shard:
        return Split(placement.dim)
    if type(placement) is Replicate:
        return broadcast
    if type(placement) is DPartial and placement.reduce_op in REDUCE_OPS:
        return Partial(placement.reduce_op)
    return None


# One DeviceMesh per placement: the one ``from_dtensor`` met first, or one made here. Making one creates process
# groups, which every rank of the world must do in the same order (as ``comm.ensure_groups``); dropped with the
# default group they were made under.
_meshes: dict[Placement, DeviceMesh] = {}
_meshes_world: list = [None]


def _mesh_cache() -> dict[Placement, DeviceMesh]:
    if _meshes_world[0] is not dist.group.WORLD:
        _meshes.clear()
        _meshes_world[0] = dist.group.WORLD
    return _meshes


def device_mesh(p: Placement) -> DeviceMesh:
    """The ``DeviceMesh`` of the rank array of ``p``; every rank of the world must call it, in the same order."""
    cache = _mesh_cache()
    if p not in cache:
        _refuse_out_of_order(p, "to_dtensor")
        cache[p] = DeviceMesh(p.type, torch.tensor(p.ranks, dtype=torch.int))
    return cache[p]


def _refuse_out_of_order(p: Placement, what: str) -> None:
    """Raise where ``p`` lists the ranks of some line along an axis out of increasing order: DTensor cuts a
    tensor by mesh coordinate but gathers a mesh dim's parts in the order of its process group's ranks, so on
    such a mesh its own ``full_tensor`` permutes a ``distribute_tensor``'s value, and no conversion can agree
    with both."""
    ranks = torch.tensor(p.ranks)
    for axis in range(ranks.dim()):
        steps = ranks.movedim(axis, -1).diff(dim=-1)
        if steps.numel() and bool((steps < 0).any()):
            raise ValueError(
                f"{what}: {p} lists ranks out of increasing order along axis {axis}, where DTensor's gathers "
                "(by process-group rank) and its cuts (by mesh coordinate) disagree; use a placement whose ranks "
                "increase along each axis"
            )


def _placement_of(mesh: DeviceMesh, what: str) -> Placement:
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is not mesh and root.size() != mesh.size():
        raise ValueError(
            f"{what}: the DTensor lies on a slice of a larger DeviceMesh ({mesh}), which holds other ranks on "
            f"other ranks; a global tensor needs one placement on every rank: convert a DTensor on the whole mesh"
        )
    try:
        placement = Placement(mesh.device_type, mesh.mesh.tolist())
    except ValueError as err:
        raise ValueError(f"{what}: {mesh} is not a placement: {err}") from err
    _refuse_out_of_order(placement, what)
    return placement


def _normalized(box: Box) -> Box:
    """An empty box compares by its lengths only: where it starts holds nothing."""
    starts, lengths = box
    return ((0,) * len(starts), lengths) if 0 in lengths else box


@dataclass(frozen=True)
class Relayout:
    """Where each rank's part of one tensor lies in each library (boxes by placement coordinate) and the pieces
    that move the parts from one layout to the other. Plain data: built once per ``GlobalMeta``."""

    meta: GlobalMeta
    sbp_boxes: dict[tuple[int, ...], Box]
    dtensor_boxes: dict[tuple[int, ...], Box]
    to_dtensor: tuple[Piece, ...]
    from_dtensor: tuple[Piece, ...]

    @property
    def shared(self) -> bool:
        """Whether every rank holds the same box in both libraries, so its local part serves both."""
        return self.sbp_boxes == self.dtensor_boxes

    def bytes_moved(self, to_dtensor: bool) -> int:
        """Bytes sent between ranks (local copies excluded) in one direction."""
        pieces = self.to_dtensor if to_dtensor else self.from_dtensor
        return sum(p.numel for p in pieces if not p.is_local) * self.meta.dtype.itemsize


def _pieces(meta: GlobalMeta, held: dict, needed: dict) -> tuple[Piece, ...]:
    """The pieces that give each rank its ``needed`` box of its partial term from the ``held`` boxes; a rank
    whose box does not change keeps its part and gets no piece. Holders of one box take turns."""
    p = meta.placement
    receivers = [(p.rank_at(c), needed[c], partial_term(meta, c)) for c in p.coords() if held[c] != needed[c]]
    return pieces_from(holders(meta, held), receivers)


@functools.lru_cache(maxsize=1024)
def relayout(meta: GlobalMeta) -> Relayout:
    """The boxes of ``meta`` in both libraries and the pieces between them."""
    placements = [_dtensor_placement(s) for s in meta.sbp]
    sbp_boxes, dtensor_boxes = {}, {}
    for c in meta.placement.coords():
        starts, lengths = meta.region(c)
        sbp_boxes[c] = _normalized((tuple(starts), tuple(lengths)))
        lengths, starts = _compute_local_shape_and_global_offset(meta.shape, meta.placement.shape, c, placements)
        dtensor_boxes[c] = _normalized((tuple(starts), tuple(lengths)))
    return Relayout(
        meta, sbp_boxes, dtensor_boxes, _pieces(meta, sbp_boxes, dtensor_boxes), _pieces(meta, dtensor_boxes, sbp_boxes)
    )


def _move(local: torch.Tensor, plan: Relayout, to_dtensor: bool) -> torch.Tensor:
    """This rank's part in the other library's layout: ``local`` itself where its box does not change (and on
    a rank outside the placement, empty in both), else a new tensor filled by the plan's pieces."""
    coord = plan.meta.placement.local_coord()
    if plan.shared or coord is None:
        return local
    held, needed = (plan.sbp_boxes, plan.dtensor_boxes) if to_dtensor else (plan.dtensor_boxes, plan.sbp_boxes)
    out = local if held[coord] == needed[coord] else local.new_empty(needed[coord][1])
    pieces = plan.to_dtensor if to_dtensor else plan.from_dtensor
    return send_pieces(local, held[coord][0], pieces, out, needed[coord][0])


def _meta_of(d: DTensor, what: str) -> GlobalMeta:
    p = _placement_of(d.device_mesh, what)
    sbp = tuple(_sbp_of(q) for q in d.placements)
    if None in sbp:
        unfit = d.placements[sbp.index(None)]
        raise ValueError(
            f"{what}: the DTensor placement {unfit!r} has no SBP that lays the data out the same way (sbp_torch "
            f"maps Shard(d), Replicate() and Partial of {', '.join(REDUCE_OPS)}); redistribute the DTensor first"
        )
    return GlobalMeta(tuple(d.shape), d.dtype, p, normalize_sbp(sbp, p, d.dim(), d.dtype), tuple(d.stride()))


def _dtensor(local: torch.Tensor, meta: GlobalMeta, mesh: DeviceMesh) -> DTensor:
    """The DTensor of ``local``, this rank's part of ``meta`` in sbp_torch's layout (no autograd)."""
    placements = [_dtensor_placement(s) for s in meta.sbp]
    moved = _move(local, relayout(meta), to_dtensor=True)
    if not meta.shape and moved.dim():  # from_local reads an empty size as none given, and the part's shape
        moved = moved.new_empty(())
    return DTensor.from_local(
        moved, mesh, placements, run_check=False, shape=torch.Size(meta.shape), stride=meta.strides
    )


def _local_of(d: DTensor) -> torch.Tensor:
    local = d._local_tensor
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _global(d: DTensor, what: str) -> GlobalTensor:
    """The global tensor of ``d`` (no autograd); placements sbp_torch lacks are first made ``Replicate()``."""
    placements = [Replicate() if _sbp_of(q) is None else q for q in d.placements]
    if placements != list(d.placements):
        d = d.redistribute(d.device_mesh, placements)
    meta = _meta_of(d, what)
    return GlobalTensor(_move(_local_of(d), relayout(meta), to_dtensor=False), meta)


class _ToDTensor(torch.autograd.Function):
    """Backward: the DTensor gradient becomes a global one, laid out as ``gradient_sbp`` of the input."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, mesh: DeviceMesh):
        ctx.meta = x._meta
        ctx.saved_local = x._local if has_extreme(x._meta) else None
        return _dtensor(x._local, x._meta, mesh)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            raise TypeError(f"to_dtensor: expected a DTensor gradient, got a {type(grad).__name__}")
        return gradient(_global(grad, "to_dtensor (backward)"), ctx.meta, ctx.saved_local), None


class _FromDTensor(torch.autograd.Function):
    """Backward: the global gradient, laid out as ``gradient_sbp`` of the input's SBP, becomes a DTensor."""

    @staticmethod
    def forward(ctx, d: DTensor, meta: GlobalMeta):
        local = _move(_local_of(d), relayout(meta), to_dtensor=False)
        ctx.meta, ctx.mesh = meta, d.device_mesh
        ctx.saved_local = local if has_extreme(meta) else None
        return GlobalTensor(local, meta)

    @staticmethod
    def backward(ctx, grad):
        grad = gradient(grad, ctx.meta, ctx.saved_local)
        return _dtensor(grad._local, grad._meta, ctx.mesh), None


def to_dtensor(x: GlobalTensor) -> DTensor:
    """``x`` as a DTensor on the ``DeviceMesh`` of its placement, with ``Shard``/``Replicate``/``Partial`` for
    its split/broadcast/partial axes; also ``GlobalTensor.to_dtensor()``. Every rank of the world must call it.

    The local parts are shared (no copy) where both libraries give every rank the same box of the logical
    tensor; an uneven split whose parts differ moves only the rows that change hands. Differentiable: the
    gradient comes back as a global tensor laid out as ``gradient_sbp(x.sbp)``.

    Raises:
        ValueError: ``x`` has partial axes of different reductions, which a DTensor cannot hold.
    """
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"to_dtensor takes a global tensor, got a plain {type(x).__name__}")
    ops = sorted({s.op for s in x.sbp if isinstance(s, Partial)})
    if len(ops) > 1:
        sbp = ", ".join(map(repr, x.sbp))
        raise ValueError(
            f"to_dtensor: a DTensor holds partial axes of one reduction only, but ({sbp}) mixes {' and '.join(ops)}; "
            "reduce some of them first (x.to_global(sbp=...))"
        )
    return _ToDTensor.apply(x, device_mesh(x.placement))


def from_dtensor(d: DTensor) -> GlobalTensor:
    """The global tensor of the DTensor ``d``, on the placement of its mesh's rank array; ``Shard(d)``,
    ``Replicate()`` and ``Partial`` of sum, max or min map to ``split(d)``, ``broadcast`` and ``partial``.
    Every rank of the world must call it. Shares ``d``'s local parts where the layouts agree (see
    ``to_dtensor``). Differentiable: the gradient comes back as a DTensor on ``d``'s mesh.

    Raises:
        ValueError: a placement that lays data out otherwise (``_StridedShard``, ``Partial("avg")``, ...),
            named in the message; or a mesh that is a slice of a larger one.
    """
    if not isinstance(d, DTensor):
        raise TypeError(f"from_dtensor takes a DTensor, got a {type(d).__name__}")
    meta = _meta_of(d, "from_dtensor")
    comm.ensure_groups(meta.placement)
    _mesh_cache().setdefault(meta.placement, d.device_mesh)
    return _FromDTensor.apply(d, meta)


@torch.no_grad()
def _convert_module(module: nn.Module, kind: type, convert, convert_grad) -> list[nn.Parameter]:
    """Replace every parameter and buffer of type ``kind`` by ``convert`` of it (its gradient by ``convert_grad``),
    in place; parameters stay parameters and tied tensors stay tied. Returns the new parameters."""
    memo: dict = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if not isinstance(tensor, kind):
                    continue
                if id(tensor) not in memo:
                    value = convert(tensor.detach())
                    if isinstance(tensor, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
                        value.grad = None if tensor.grad is None else convert_grad(tensor.grad)
                    memo[id(tensor)] = value
                table[name] = memo[id(tensor)]
    return [t for t in memo.values() if isinstance(t, nn.Parameter)]


def module_to_dtensor(module: nn.Module) -> nn.Module:
    """Make every global parameter and buffer of ``module`` (and gradient) a DTensor, in place; returns
    ``module``. Its calls then no longer run in global mode. Every rank of the world must call it."""
    _convert_module(module, GlobalTensor, to_dtensor, to_dtensor)
    ForwardInGlobalMode.install(module)
    return module


def module_from_dtensor(module: nn.Module, *, bucket_mb: float = 25.0) -> nn.Module:
    """Make every DTensor parameter and buffer of ``module`` (and gradient) a global tensor, in place; returns
    ``module``, laid out as ``Module.to_global`` leaves a module: its calls run in global mode and gradients
    are reduced to their parameters' layouts in buckets of ``bucket_mb`` MiB. Every rank of the world must
    call it."""
    params = _convert_module(module, DTensor, from_dtensor, lambda grad: _global(grad, "module_from_dtensor"))
    params = [p for p in params if p.requires_grad]
    if params:
        GradientReducer(params, bucket_mb, module)
    ForwardInGlobalMode.install(module)
    return module
