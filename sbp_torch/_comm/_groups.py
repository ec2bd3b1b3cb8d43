"""Process groups for the axes of a placement, created once per set of ranks and cached (docs/concepts.md).

``torch.distributed.new_group`` must be entered by every rank of the world in the same order (even with
``use_local_synchronization`` a group's name depends on how many groups each rank made before), so
``ensure_groups`` runs where every rank takes part: when a global tensor is first made on a placement.

The caches are dropped when the default group is destroyed or replaced, and at exit, because a gloo group or
its work objects freed during interpreter teardown can abort the process ("terminate called without an active
exception"). The wrapped ``destroy_process_group`` also collects garbage first, so that tensors that finished
collectives still reference are freed while gloo is alive."""

from __future__ import annotations

import atexit
import functools
import gc
from dataclasses import dataclass

import torch.distributed as dist

from .._layout import Placement

_groups_by_ranks: dict[tuple[int, ...], object] = {}
_ready: set[Placement] = set()
_axis_groups: dict[tuple[Placement, int], AxisGroup] = {}
_cached_for_world: list[object] = [None]  # the default group the caches were filled under


def forget_groups() -> None:
    """Drop every cached process group (they are not destroyed here: torch owns them)."""
    _groups_by_ranks.clear()
    _ready.clear()
    _axis_groups.clear()
    _cached_for_world[0] = None


def _drop_stale_groups() -> None:
    world = dist.group.WORLD
    if _cached_for_world[0] is not world:
        forget_groups()
        _cached_for_world[0] = world


atexit.register(forget_groups)


def _forgetting_groups(destroy):
    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None:  # the whole default world goes
            forget_groups()
            gc.collect()
        return destroy(group)

    return destroy_process_group


dist.destroy_process_group = _forgetting_groups(dist.destroy_process_group)


@dataclass(frozen=True)
class AxisGroup:
    """The ranks that a collective along one placement axis runs on, seen from this rank: ``ranks`` in axis
    (coordinate) order, ``index`` this rank's position among them. Collectives work in coordinate order; torch
    orders group ranks by global rank, which ``coord_of_group_rank`` maps."""

    ranks: tuple[int, ...]
    index: int
    process_group: object | None  # None for a one-rank axis: nothing to communicate
    placement: Placement | None = None  # what the group is an axis of, for messages (None: a bare group)
    axis: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def coord_of_group_rank(self) -> tuple[int, ...]:
        """For each group rank g (torch's order), the axis coordinate of that rank."""
        return tuple(self.ranks.index(r) for r in sorted(self.ranks))

    @functools.cached_property
    def in_rank_order(self) -> bool:
        """Whether axis order is torch's group order: parts laid end to end in one order are in the other."""
        return self.coord_of_group_rank == tuple(range(self.size))

    def describe(self) -> str:
        """Where a collective on this group runs, for messages."""
        if self.placement is None:
            return f"on ranks {list(self.ranks)}"
        return f"along axis {self.axis} of {self.placement!r} (ranks {list(self.ranks)})"


def _process_group(ranks: tuple[int, ...]):
    key = tuple(sorted(ranks))
    if key not in _groups_by_ranks:
        if len(key) == 1:
            _groups_by_ranks[key] = None
        elif key == tuple(range(dist.get_world_size())):
            _groups_by_ranks[key] = dist.group.WORLD
        else:
            # every rank enters, members or not
            _groups_by_ranks[key] = dist.new_group(list(key), timeout=_world_timeout())
    return _groups_by_ranks[key]


def _world_timeout():
    """The collective timeout the user gave ``init_process_group``: a new group would otherwise get the
    backend's default (30 minutes for gloo), and a stuck axis collective would wait that long."""
    world = dist.group.WORLD
    try:
        return world._get_backend(world._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError):  # private API: fall back to the backend default
        return None


def ensure_groups(p: Placement) -> None:
    """Create the process groups of every axis line of ``p``; every rank of the world must call this."""
    _drop_stale_groups()
    if p in _ready:
        return
    for axis in range(p.ndim):
        for coord in p.coords():
            if coord[axis] == 0:
                _process_group(p.axis_ranks(axis, coord))
    _ready.add(p)


def axis_group(p: Placement, axis: int) -> AxisGroup:
    """The group along ``axis`` of ``p`` that holds this rank (which must be in ``p``)."""
    _drop_stale_groups()
    if p not in _ready:
        raise RuntimeError(
            f"the process groups of {p} were never created; global tensors must be made with to_global or the "
            "sbp_torch creation functions, called on every rank"
        )
    if (p, axis) not in _axis_groups:
        coord = p.local_coord()
        ranks = p.axis_ranks(axis, coord)
        _axis_groups[(p, axis)] = AxisGroup(ranks, coord[axis], _groups_by_ranks[tuple(sorted(ranks))], p, axis)
    return _axis_groups[(p, axis)]
