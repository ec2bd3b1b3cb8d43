"""N-D boxing plans: which 1-D transitions to run on which axes, in which order, and what they cost.

A plan is data (``BoxingPlan``): it can be printed, costed and cached, and ``run.py`` executes it.

On an N-D placement a transition on axis ``a`` works inside the groups of ranks that differ only in their
coordinate on ``a``. That is valid only if the later axes (which cut the tensor further) commute with it:
a later axis must not split a dim that the transition splits or gathers, and a later partial axis must not
reduce with another op than the one the transition reduces with. Planning therefore goes in two phases:

1. from the last axis to the first, *release* (to broadcast) every axis that conflicts with an earlier axis
   that must change; releasing is itself a change, so conflicts propagate in axis order;
2. from the first axis to the last, move every axis from its current SBP to the target one directly.

A change between two partial ops is routed through a split of a dim no other axis splits (reduce-scatter then
a local fill), or through broadcast where no such dim exists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

from .._layout import GlobalMeta
from .._sbp import Broadcast, Partial, SbpType, Split
from .transitions import AxisView, transition

BROADCAST = Broadcast()


@dataclass(frozen=True)
class BoxingStep:
    """One 1-D transition on one placement axis; ``bytes_sent`` is summed over every rank of the placement."""

    axis: int
    src: SbpType
    dst: SbpType
    collective: str
    bytes_sent: int

    def __repr__(self) -> str:
        return f"axis {self.axis}: {self.src!r} -> {self.dst!r} by {self.collective} ({self.bytes_sent} B sent)"


@dataclass(frozen=True)
class BoxingPlan:
    """The steps that take a tensor of ``meta`` to ``dst_sbp``, in order. Empty when nothing changes."""

    meta: GlobalMeta
    dst_sbp: tuple[SbpType, ...]
    steps: tuple[BoxingStep, ...]

    @property
    def bytes_sent(self) -> int:
        """Bytes sent by all ranks together."""
        return sum(s.bytes_sent for s in self.steps)

    def __str__(self) -> str:
        src = ", ".join(map(repr, self.meta.sbp))
        dst = ", ".join(map(repr, self.dst_sbp))
        lines = [f"({src}) -> ({dst}) for {tuple(self.meta.shape)} {self.meta.dtype}: {self.bytes_sent} B sent"]
        return "\n".join(lines + [f"  {s!r}" for s in self.steps])


def _split_dims(sbp: SbpType) -> set[int]:
    return {sbp.dim} if isinstance(sbp, Split) else set()


def _reduces_with(src: SbpType, dst: SbpType) -> str | None:
    """The op a change ``src -> dst`` reduces with, if it reduces."""
    return src.op if isinstance(src, Partial) and src != dst else None


def _conflicts(later: SbpType, dims: set[int], reduce_op: str | None) -> bool:
    """Whether a later axis holding ``later`` breaks a change that touches ``dims`` and reduces with ``reduce_op``."""
    if isinstance(later, Split):
        return later.dim in dims
    if isinstance(later, Partial):
        return reduce_op is not None and later.op != reduce_op
    return False


def _released_axes(src: tuple[SbpType, ...], dst: tuple[SbpType, ...]) -> list[bool]:
    """Phase 1: which axes must go to broadcast before any axis moves to its target."""
    released = [False] * len(src)
    changes: list[tuple[set[int], str | None]] = []  # (dims, reduce op) of each changing axis so far
    for b, (s, t) in enumerate(zip(src, dst)):
        if any(_conflicts(s, dims, op) for dims, op in changes):
            released[b] = True
            target = BROADCAST
        elif s != t:
            target = t
        else:
            continue
        changes.append((_split_dims(s) | _split_dims(t), _reduces_with(s, target) or _reduces_with(s, t)))
    return released


def _scatter_dim(meta: GlobalMeta, axis: int, sbp: tuple[SbpType, ...], dst: tuple[SbpType, ...]) -> int | None:
    """A dim to route a partial-op change on ``axis`` through: the largest that no other axis splits."""
    others = [s for a, pair in enumerate(zip(sbp, dst)) if a != axis for s in pair]
    taken = set().union(*(_split_dims(s) for s in others))
    free = [d for d in range(len(meta.shape)) if d not in taken and meta.shape[d] > 0]
    return max(free, key=lambda d: meta.shape[d]) if free else None


def _moves(meta: GlobalMeta, dst: tuple[SbpType, ...]) -> list[tuple[int, SbpType, SbpType]]:
    """The (axis, from, to) moves of both phases, each a row of the 1-D table."""
    cur = list(meta.sbp)
    released = _released_axes(meta.sbp, dst)
    moves = []
    for axis in reversed(range(len(cur))):
        if released[axis] and cur[axis] != BROADCAST:
            moves.append((axis, cur[axis], BROADCAST))
            cur[axis] = BROADCAST
    for axis, target in enumerate(dst):
        s = cur[axis]
        if s == target:
            continue
        if isinstance(s, Partial) and isinstance(target, Partial):
            dim = _scatter_dim(meta, axis, tuple(cur), dst)
            middle = Split(dim) if dim is not None else BROADCAST
            moves += [(axis, s, middle), (axis, middle, target)]
        else:
            moves.append((axis, s, target))
        cur[axis] = target
    return moves


def axis_view(meta: GlobalMeta, axis: int, coord: tuple[int, ...]) -> AxisView:
    """What a transition on ``axis`` needs to know about a tensor of ``meta`` at ``coord``."""
    _, extent = meta.region(coord, axis)
    local_numel = 1
    for n in meta.local_shape(coord):
        local_numel *= n
    return AxisView(tuple(extent), local_numel, meta.placement.shape[axis], coord[axis])


@lru_cache(maxsize=4096)
def plan_boxing(meta: GlobalMeta, dst_sbp: tuple[SbpType, ...]) -> BoxingPlan:
    """The plan that takes a global tensor of ``meta`` to ``dst_sbp`` on the same placement (both validated)."""
    steps = []
    cur = meta
    coords = list(itertools.product(*(range(n) for n in meta.placement.shape)))
    for axis, s, t in _moves(meta, dst_sbp):
        row = transition(s, t)
        sent = sum(row.sent(s, t, axis_view(cur, axis, c)) for c in coords) * meta.dtype.itemsize
        steps.append(BoxingStep(axis, s, t, row.collective, round(sent)))
        cur = cur.with_sbp(cur.sbp[:axis] + (t,) + cur.sbp[axis + 1 :])
    return BoxingPlan(meta, dst_sbp, tuple(steps))
