"""N-D boxing plans: which 1-D transitions run on which axes, in which order, at what cost (docs/boxing.md).

A plan is data (``BoxingPlan``): it can be printed, costed and cached, and ``run.py`` executes it. A transition
on axis ``a`` runs inside the groups of ranks that differ only on ``a``; that is valid only if the later axes
commute with it: no later axis may split a dim it splits or gathers, or reduce with another op than it does.
Within that rule the planner finds the cheapest sequence (Dijkstra's algorithm over the N-D layouts).

Collectives move whole axes, and some changes need less: in ``(S0, B) -> (B, S0)`` on 2x2 two ranks swap
halves, while any collectives gather first. So one more kind of step sends each rank just the pieces it lacks
(``pieces.py``): from the source, or the source with its partial axes reduced, to a goal without partial axes,
costed as its bytes plus a latency per message."""

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._comm import compiling
from .._layout import GlobalMeta, Partial, SbpType, Split, broadcast
from .pieces import Piece, pieces_between, sends_between
from .transitions import AxisView, transition

POINT_TO_POINT = "send/recv"
# The point-to-point step is planned only on placements of at most this many ranks: finding its pieces takes
# time that grows with the square of the ranks (the planner prices placements of thousands), and on large
# placements the collectives' own latency terms already favour them.
POINT_TO_POINT_MAX_RANKS = 64


# What one collective call costs beyond its bytes, in bytes per participating rank: its latency at a typical
# bandwidth (about 50 us at a few GB/s for gloo on one host; NCCL's lower latency meets higher bandwidth). Plans
# and signature choices then prefer fewer, larger collectives where the bytes are about equal (an all-reduce
# rather than a reduce-scatter now and an all-gather later); large tensors are still planned by their bytes.
LATENCY_BYTES_PER_RANK = 64 * 1024


@dataclass(frozen=True)
class BoxingStep:
    """One 1-D transition on one placement axis; ``bytes_sent`` is summed over every rank of the placement,
    ``cost`` adds the latency of the collective (``LATENCY_BYTES_PER_RANK`` for each rank), 0 for a local step.
    The point-to-point step (``collective == POINT_TO_POINT``) changes every axis at once: ``axis`` is -1,
    ``src`` and ``dst`` are whole SBP tuples, ``pieces`` what each rank sends, and ``cost`` adds the latency
    once per message."""

    axis: int
    src: SbpType
    dst: SbpType
    collective: str
    bytes_sent: int
    cost: int = 0
    pieces: tuple[Piece, ...] = ()

    def __repr__(self) -> str:
        where = "every axis" if self.axis < 0 else f"axis {self.axis}"
        return f"{where}: {self.src!r} -> {self.dst!r} by {self.collective} ({self.bytes_sent} B sent)"


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

    @property
    def cost(self) -> int:
        """Bytes sent plus each collective's latency, in bytes: what the planner and the signature choice minimise."""
        return sum(s.cost for s in self.steps)

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


def axis_view(meta: GlobalMeta, axis: int, coord: tuple[int, ...]) -> AxisView:
    """What a transition on ``axis`` needs to know about a tensor of ``meta`` at ``coord``."""
    _, extent = meta.region(coord, axis)
    return AxisView(tuple(extent), math.prod(meta.local_shape(coord)), meta.placement.shape[axis], coord[axis])


def _candidates(meta: GlobalMeta, dst: tuple[SbpType, ...]) -> list[SbpType]:
    """The SBPs an axis may pass through: broadcast, a split of any dim of size > 0 (reduce-scatters go
    through one), and the partial ops of either end."""
    ops = sorted({s.op for s in meta.sbp + dst if isinstance(s, Partial)})
    ends = {s.dim for s in meta.sbp + dst if isinstance(s, Split)}
    dims = [d for d in range(len(meta.shape)) if meta.shape[d] > 0 or d in ends]
    return [broadcast] + [Split(d) for d in dims] + [Partial(op) for op in ops]


def _commutes(cur: tuple[SbpType, ...], axis: int, s: SbpType, t: SbpType) -> bool:
    """Whether ``axis`` may move ``s -> t`` now: no later axis splits a dim it touches or reduces otherwise."""
    dims, op = _split_dims(s) | _split_dims(t), _reduces_with(s, t)
    return not any(_conflicts(later, dims, op) for later in cur[axis + 1 :])


def _axis_views(meta: GlobalMeta, axis: int) -> tuple[list[AxisView], list[int]]:
    """The distinct views (``axis_view``) of ``meta``'s ranks on ``axis``, and the index of each rank's among
    them, in the placement's row-major order. A placement has up to thousands of ranks and few distinct views (balanced
    parts take at most two lengths per split): the regions are computed for all ranks at once."""
    shape = meta.placement.shape
    coords = np.indices(shape).reshape(len(shape), -1)  # row-major, as ``placement.coords()``
    lengths = [np.full(coords.shape[1], n, dtype=np.int64) for n in meta.shape]
    extent = lengths
    for a, sbp in enumerate(meta.sbp):  # ``GlobalMeta.region``, on every rank at once
        if a == axis:
            extent = list(lengths)
        if isinstance(sbp, Split):
            base, extra = np.divmod(lengths[sbp.dim], shape[a])
            lengths[sbp.dim] = base + (coords[a] < extra)
    numel = np.prod(np.stack(lengths), axis=0) if lengths else np.ones(coords.shape[1], dtype=np.int64)
    columns = [*extent, numel, coords[axis]]
    # Rows told apart by one integer code, column by column (``np.unique`` of rows sorts them as bytes, slowly).
    codes = np.zeros(coords.shape[1], dtype=np.int64)
    for column in columns:
        values, code = np.unique(column, return_inverse=True)
        codes = np.unique(codes * len(values) + code.reshape(-1), return_inverse=True)[1].reshape(-1)
    _, first, of_rank = np.unique(codes, return_index=True, return_inverse=True)
    rows = np.stack(columns, axis=1)[first].tolist()
    views = [AxisView(tuple(r[:-2]), r[-2], shape[axis], r[-1]) for r in rows]
    return views, of_rank.reshape(-1).tolist()


@lru_cache(maxsize=65536)
def _step(at: GlobalMeta, axis: int, t: SbpType) -> BoxingStep:
    """Moving ``axis`` of a tensor laid out as ``at`` to ``t``, with its bytes (memoized: the searches of
    one decision's candidates share most of their steps)."""
    s = at.sbp[axis]
    row = transition(s, t)
    if compiling():  # Dynamo traces this; it cannot trace numpy's unique: one view per rank, as the sum needs
        coords = list(at.placement.coords())
        views, of_rank = [axis_view(at, axis, c) for c in coords], list(range(len(coords)))
    else:
        views, of_rank = _axis_views(at, axis)
    sent_by = [row.sent(s, t, v) for v in views]
    total = sum(sent_by[i] for i in of_rank)  # every rank's, in order: the same floats as rank by rank
    sent = round(total * at.dtype.itemsize)
    ranks = len(at.placement.flat_ranks) if not row.is_local and at.placement.shape[axis] > 1 else 0
    return BoxingStep(axis, s, t, row.collective, sent, sent + ranks * LATENCY_BYTES_PER_RANK)


def _direct(meta: GlobalMeta, start: tuple, goal: tuple) -> tuple | None:
    """The plan without a search where it is known to be the search's answer: nothing to do, or one axis to
    move (not between two partial ops) on a 1-D placement, where the direct row is the only single step and
    any detour adds a collective."""
    changed = [a for a, (s, t) in enumerate(zip(start, goal)) if s != t]
    if not changed:
        return ()
    axis = changed[0]
    if len(start) == 1 and not (isinstance(start[axis], Partial) and isinstance(goal[axis], Partial)):
        return (_step(meta, axis, goal[axis]),)
    return None


def _reduced_only(start: tuple, cur: tuple) -> bool:
    """Whether ``cur`` has no partial axis and differs from ``start`` only where ``start`` was partial: the
    layouts a point-to-point step may leave from (the source, or the source with its partial axes reduced).
    Leaving from every layout would find little more and cost a pieces computation per layout searched."""
    return all(not isinstance(c, Partial) and (c == s or isinstance(s, Partial)) for s, c in zip(start, cur))


@lru_cache(maxsize=65536)
def _point_to_point(at: GlobalMeta, goal: tuple) -> BoxingStep:
    """The step that sends every rank of a tensor laid out as ``at`` the pieces of ``goal`` it lacks (neither
    may be partial), memoized like ``_step``."""
    pieces = pieces_between(at, at.with_sbp(goal))
    moved = [p for p in pieces if not p.is_local]
    sent = sum(p.numel for p in moved) * at.dtype.itemsize
    return BoxingStep(-1, at.sbp, goal, POINT_TO_POINT, sent, sent + len(moved) * LATENCY_BYTES_PER_RANK, pieces)


@lru_cache(maxsize=65536)
def _point_to_point_priced(at: GlobalMeta, goal: tuple) -> BoxingStep:
    """``_point_to_point(at, goal)`` without its pieces: the same bytes and cost, found without listing the
    pieces (up to the square of the ranks of them), which only the step a plan keeps needs."""
    elements, messages = sends_between(at, at.with_sbp(goal))
    sent = elements * at.dtype.itemsize
    return BoxingStep(-1, at.sbp, goal, POINT_TO_POINT, sent, sent + messages * LATENCY_BYTES_PER_RANK)


@lru_cache(maxsize=4096)
def plan_boxing(meta: GlobalMeta, dst_sbp: tuple[SbpType, ...]) -> BoxingPlan:
    """The plan that takes a global tensor of ``meta`` to ``dst_sbp`` on the same placement (both validated):
    the cheapest sequence of steps (cost: bytes plus latency; then number of steps), by the search that the
    module docstring describes. Neighbours are tried in a fixed order, so every rank finds the same plan."""
    start, goal = tuple(meta.sbp), tuple(dst_sbp)
    direct = _direct(meta, start, goal)
    if direct is not None:
        return BoxingPlan(meta, dst_sbp, direct)
    if any(isinstance(s, Partial) for s in start):
        return BoxingPlan(meta, dst_sbp, search(meta, goal))
    # From a source without partial axes the only point-to-point edge leads straight to the goal: the same
    # as searching with it, but its pieces are listed only when it wins.
    steps = search(meta, goal, point_to_point=False)
    cost = sum(s.cost for s in steps)
    small = len(meta.placement.flat_ranks) <= POINT_TO_POINT_MAX_RANKS
    if small and not any(isinstance(s, Partial) for s in goal) and _point_to_point_priced(meta, goal).cost < cost:
        steps = (_point_to_point(meta, goal),)  # on a tie the collectives win, as in the search
    return BoxingPlan(meta, dst_sbp, steps)


def search(meta: GlobalMeta, goal: tuple[SbpType, ...], point_to_point: bool = True) -> tuple[BoxingStep, ...]:
    """The cheapest steps from ``meta.sbp`` to ``goal`` (see plan_boxing); only collectives when
    ``point_to_point`` is False."""
    start = tuple(meta.sbp)
    candidates = _candidates(meta, goal)
    small = len(meta.placement.flat_ranks) <= POINT_TO_POINT_MAX_RANKS
    goal_whole = point_to_point and small and not any(isinstance(s, Partial) for s in goal)
    best = {start: (0, 0)}
    came_from: dict = {}
    frontier = [(0, 0, 0, start)]
    pushed = 1

    def relax(cur, nxt, step, cost, n_steps, weight=1):
        nonlocal pushed
        score = (cost + step.cost, n_steps + weight)
        if nxt not in best or score < best[nxt]:
            best[nxt] = score
            came_from[nxt] = (cur, step)
            heapq.heappush(frontier, (*score, pushed, nxt))
            pushed += 1

    while frontier:
        cost, n_steps, _, cur = heapq.heappop(frontier)
        if cur == goal:
            break
        if best[cur] < (cost, n_steps):
            continue  # a stale entry
        for axis, s in enumerate(cur):
            for t in candidates:
                if t == s or (isinstance(s, Partial) and isinstance(t, Partial)) or not _commutes(cur, axis, s, t):
                    continue
                relax(cur, cur[:axis] + (t,) + cur[axis + 1 :], _step(meta.with_sbp(cur), axis, t), cost, n_steps)
        if goal_whole and _reduced_only(start, cur):
            # counted as more steps than any per-axis route, so that on a tie those win (local slices are views)
            relax(cur, goal, _point_to_point_priced(meta.with_sbp(cur), goal), cost, n_steps, weight=len(goal) + 1)
    steps = []
    cur = goal
    while cur != start:
        cur, step = came_from[cur]
        if step.collective == POINT_TO_POINT:  # priced only: list its pieces now that the plan keeps it
            step = _point_to_point(meta.with_sbp(cur), goal)
        steps.append(step)
    return tuple(reversed(steps))
