"""Process groups for the axes of a placement, created once per set of ranks and cached.

Groups are created lazily, on the member ranks only (``use_local_synchronization``), and all axis groups of a
placement that hold this rank are created together in axis order. Because every rank runs the same program,
ranks meet their placements in the same order, so creation follows one global order and cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ._placement import placement as Placement

_groups_by_ranks: dict[tuple[int, ...], object] = {}
_axis_groups: dict[tuple[Placement, int], AxisGroup] = {}


@dataclass(frozen=True)
class AxisGroup:
    """The ranks that a collective along one placement axis runs on, seen from this rank.

    ``ranks`` are in axis (coordinate) order and ``index`` is this rank's position among them. Collectives
    work in coordinate order; ``group_rank_of`` maps a coordinate to the rank inside ``process_group``
    (torch orders group ranks by global rank, which may differ from the placement's order).
    """

    ranks: tuple[int, ...]
    index: int
    process_group: object | None  # None for a one-rank axis: nothing to communicate

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def coord_of_group_rank(self) -> tuple[int, ...]:
        """For each group rank g (torch's order), the axis coordinate of that rank."""
        return tuple(self.ranks.index(r) for r in sorted(self.ranks))

    def describe(self) -> str:
        return f"ranks {list(self.ranks)}"


def _process_group(ranks: tuple[int, ...]):
    key = tuple(sorted(ranks))
    if key not in _groups_by_ranks:
        if len(key) == 1:
            _groups_by_ranks[key] = None
        elif key == tuple(range(dist.get_world_size())):
            _groups_by_ranks[key] = dist.group.WORLD
        else:
            _groups_by_ranks[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _groups_by_ranks[key]


def axis_group(p: Placement, axis: int) -> AxisGroup:
    """The group along ``axis`` of ``p`` that holds this rank (which must be in ``p``)."""
    key = (p, axis)
    if key not in _axis_groups:
        rank = dist.get_rank()
        coord = p.coord_of(rank)
        if coord is None:
            raise RuntimeError(f"rank {rank} is not in {p} and takes part in none of its collectives")
        for a in range(p.ndim):  # all axes at once, in axis order (see module docstring)
            ranks = p.axis_ranks(a, coord)
            _axis_groups[(p, a)] = AxisGroup(ranks, coord[a], _process_group(ranks))
    return _axis_groups[key]

