"""Boxing across placements: move a global tensor to another placement and SBP with point-to-point sends
(docs/boxing.md, "Across placements"). ``cross_target`` checks the target from the arguments alone;
``plan_cross`` builds a plan as data (``CrossPlan``) and ``run_cross`` executes it:

1. Each partial axis of the source is reduced inside the source placement (``plan_boxing``: to a split or to
   broadcast), or kept: its terms travel and are combined by its op where they arrive (kept axes share one op).
   The choice that sends the fewest bytes in all wins; on a tie the first in ``_reductions`` order, which
   reduces at the source (its receivers get one copy, not one per term).
2. Pieces (``pieces.py``): the boxes held at the source (of the value or of one partial term) intersected with
   the boxes needed at the destination.
3. Only the coordinate 0 of every partial axis of the target receives the value; the others hold the identity
   of an op (see ``fill_of``). Ranks in neither placement have no piece and no step: they return at once."""

import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from .._layout import GlobalMeta, Partial, Placement, SbpType, Split, broadcast, normalize_sbp, reduction_identity
from .pieces import Piece, box_of, fill_of, pieces_between, send_pieces
from .plan import BoxingPlan, plan_boxing
from .run import run_plan


@dataclass(frozen=True)
class CrossPlan:
    """How a tensor of ``src`` becomes a tensor of ``dst`` (another placement): first ``reduce`` inside the
    source placement (no step unless the source has partial axes), then ``pieces``, in order."""

    src: GlobalMeta
    dst: GlobalMeta
    reduce: BoxingPlan
    pieces: tuple[Piece, ...]

    @property
    def combine(self) -> str | None:
        """The op that combines arriving pieces when partial axes are kept (their terms overlap), or None:
        the pieces are disjoint and copied."""
        ops = {s.op for s in self.reduce.dst_sbp if isinstance(s, Partial)}
        return ops.pop() if ops else None

    @property
    def bytes_moved(self) -> int:
        """Bytes the pieces send between ranks (local copies excluded)."""
        return sum(p.numel for p in self.pieces if not p.is_local) * self.src.dtype.itemsize

    @property
    def bytes_sent(self) -> int:
        """Bytes sent by all ranks together: the source reduction plus the pieces."""
        return self.reduce.bytes_sent + self.bytes_moved

    def __str__(self) -> str:
        def layout(meta: GlobalMeta) -> str:
            return f"{meta.placement.ranks} ({', '.join(map(repr, meta.sbp))})"

        lines = [
            f"{layout(self.src)} -> {layout(self.dst)} for {tuple(self.src.shape)} {self.src.dtype}: "
            f"{self.bytes_sent} B sent"
        ]
        if self.reduce.steps:
            reduced = ", ".join(map(repr, self.reduce.dst_sbp))
            lines.append(f"  reduce on {layout(self.src)} -> ({reduced})")
            lines += [f"    {s!r}" for s in self.reduce.steps]
        if self.combine:
            lines.append(f"  partial terms travel; each receiver combines its pieces by {self.combine}")
        itemsize = self.src.dtype.itemsize
        lines += [f"  {p!r} ({0 if p.is_local else p.numel * itemsize} B sent)" for p in self.pieces]
        return "\n".join(lines)


def cross_target(src: GlobalMeta, p: Placement, sbp) -> GlobalMeta:
    """The metadata of a tensor of ``src`` moved to placement ``p`` with ``sbp`` (None: ``src.sbp``), checked from
    the arguments alone so that every rank raises alike before any data moves: TypeError when ``p`` is not a
    placement, ValueError for another device type, ``normalize_sbp``'s errors (naming both placements) for an
    SBP that does not fit ``p``."""
    if not isinstance(p, Placement):
        raise TypeError(f"to_global: placement must be an sbp_torch.placement, got {type(p).__name__}")
    if p.type != src.placement.type:
        raise ValueError(
            f"to_global: cannot move a tensor from {src.placement} to {p}: the device types differ "
            f"({src.placement.type!r} and {p.type!r})"
        )
    try:
        sbp = normalize_sbp(src.sbp if sbp is None else sbp, p, len(src.shape), src.dtype)
    except (TypeError, ValueError) as err:
        raise type(err)(f"to_global from {src.placement} to {p}: {err}") from err
    return GlobalMeta(src.shape, src.dtype, p, sbp, src.strides)


def _reductions(meta: GlobalMeta) -> list[tuple[SbpType, ...]]:
    """The layouts the source may be reduced to before its pieces travel: each partial axis becomes a split
    of a non-empty dim or broadcast, or stays (kept axes must share one op, which combines at the
    destination); the other axes stay."""
    splits = [Split(d) for d, n in enumerate(meta.shape) if n > 0]
    choices = [splits + [broadcast, s] if isinstance(s, Partial) else [s] for s in meta.sbp]
    return [r for r in itertools.product(*choices) if len({s.op for s in r if isinstance(s, Partial)}) <= 1]


@lru_cache(maxsize=1024)
def plan_cross(src: GlobalMeta, dst: GlobalMeta) -> CrossPlan:
    """The plan that moves a tensor of ``src`` to ``dst`` (same shape and dtype, validated SBPs) sending the
    fewest bytes in all, the first in ``_reductions`` order on a tie."""
    plans = (CrossPlan(src, dst, plan_boxing(src, r), pieces_between(src.with_sbp(r), dst)) for r in _reductions(src))
    return min(plans, key=lambda p: p.bytes_sent)


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _destination_part(like: torch.Tensor, plan: CrossPlan, coord: tuple[int, ...] | None) -> torch.Tensor:
    """This rank's target part before any piece arrives: a fill where it receives nothing, the identity of
    the op that combines the pieces, or uninitialised where copied pieces will cover it."""
    shape = plan.dst.local_shape(coord)
    fill = None if coord is None else fill_of(plan.dst, coord)
    if fill is None and plan.combine and coord is not None:
        fill = reduction_identity(plan.combine, plan.dst.dtype)
    return like.new_empty(shape) if fill is None else like.new_full(shape, fill)


def run_cross(local: torch.Tensor, plan: CrossPlan) -> torch.Tensor:
    """This rank's part of the destination layout of ``plan``, from its part ``local`` of the source layout
    (empty outside the source placement). Every rank of the world calls it; only ranks with a piece or a
    reduction step do any work."""
    local = run_plan(local, plan.reduce)
    held = plan.src.with_sbp(plan.reduce.dst_sbp)
    src_coord, dst_coord = plan.src.placement.local_coord(), plan.dst.placement.local_coord()
    src_origin = box_of(held, src_coord)[0] if src_coord is not None else None
    dst_origin = box_of(plan.dst, dst_coord)[0] if dst_coord is not None else None
    out = _destination_part(local, plan, dst_coord)
    return send_pieces(local, src_origin, plan.pieces, out, dst_origin, _COMBINE.get(plan.combine))
