"""Placement: the N-D array of ranks that holds a global tensor."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

DEVICE_TYPES = ("cpu", "cuda")


def _flatten(ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (flat ranks, shape) of a nested rectangular list, or raise ValueError naming the problem."""
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        raise ValueError(f"ranks must be a list (e.g. [{ranks}]), got the int {ranks}")
    if not isinstance(ranks, (list, tuple)) or len(ranks) == 0:
        raise ValueError(f"ranks must be a non-empty (nested) list of ints, got {ranks!r}")
    if all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return tuple(ranks), (len(ranks),)
    if not all(isinstance(r, (list, tuple, range)) for r in ranks):
        raise ValueError(f"ranks mixes ints and lists: {ranks!r}")
    parts = [_flatten(r) for r in ranks]
    inner = {shape for _, shape in parts}
    if len(inner) != 1:
        raise ValueError(f"ranks is not rectangular (rows of shapes {sorted(inner)}): {ranks!r}")
    return tuple(itertools.chain.from_iterable(flat for flat, _ in parts)), (len(parts), *inner.pop())


@dataclass(frozen=True, eq=False, repr=False)
class placement:  # noqa: N801 - lower case on purpose, as torch.device and oneflow.placement are
    """Which ranks hold a global tensor: ``type`` (``"cpu"`` or ``"cuda"``) is the device type of the local
    parts, ``ranks`` a list (1-D) or nested rectangular list (N-D), e.g. ``[[0, 1], [2, 3]]`` (shape ``(2, 2)``).
    A rank that is not in the placement may still hold a global tensor of it; its local part is empty.
    A placement is immutable; ``torch.compile`` takes it as a constant of the traced program.
    """

    # Two fields, as given to the constructor: torch.compile rebuilds a placement argument from them.
    type: str  # noqa: A003 - the OneFlow name
    ranks: list

    def __post_init__(self):
        type, ranks = self.type, self.ranks  # noqa: A001
        if type not in DEVICE_TYPES:
            raise ValueError(f"placement type must be one of {DEVICE_TYPES}, got {type!r}")
        flat, shape = _flatten(ranks)
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in flat):
            raise ValueError(f"ranks must be non-negative ints, got {ranks!r}")
        duplicates = sorted({r for r in flat if flat.count(r) > 1})
        if duplicates:
            raise ValueError(f"ranks {duplicates} appear more than once in placement ranks {ranks!r}")
        if dist.is_initialized() and max(flat) >= dist.get_world_size():
            outside = sorted(r for r in flat if r >= dist.get_world_size())
            raise ValueError(f"ranks {outside} are outside the world of size {dist.get_world_size()}")
        object.__setattr__(self, "_flat", flat)
        object.__setattr__(self, "_shape", shape)
        nested = list(flat)
        for n in reversed(shape[1:]):
            nested = [nested[i : i + n] for i in range(0, len(nested), n)]
        object.__setattr__(self, "ranks", nested)

    @classmethod
    def all(cls, type: str) -> placement:  # noqa: A002
        """A 1-D placement of every rank of the default process group, in rank order."""
        if not dist.is_initialized():
            raise RuntimeError("placement.all() needs torch.distributed to be initialised first")
        return cls(type, list(range(dist.get_world_size())))

    shape = property(lambda self: self._shape, doc="Shape of the rank array, e.g. (2, 2).")
    ndim = property(lambda self: len(self._shape), doc="Number of placement axes.")
    flat_ranks = property(lambda self: self._flat, doc="Ranks in row-major order of the rank array.")
    size = property(lambda self: len(self._flat), doc="Number of ranks.")

    def coords(self):
        """Every coordinate of the rank array, in row-major order (the order of ``flat_ranks``)."""
        return itertools.product(*(range(n) for n in self._shape))

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        return dict(zip(self._flat, self.coords()))

    def coord_of(self, rank: int) -> tuple[int, ...] | None:
        """Coordinates of ``rank`` in the rank array, or None when it is not in the placement."""
        return self._coords.get(rank)

    def local_coord(self) -> tuple[int, ...] | None:
        """Coordinates of this process's rank (in the default group), or None when it is not in the placement."""
        return self._coords.get(dist.get_rank())

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def rank_at(self, coord: tuple[int, ...]) -> int:
        index = 0
        for c, n in zip(coord, self._shape):
            index = index * n + c
        return self._flat[index]

    def axis_ranks(self, axis: int, coord: tuple[int, ...]) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``coord`` but the one on ``axis``, in axis order."""
        return tuple(self.rank_at(coord[:axis] + (i,) + coord[axis + 1 :]) for i in range(self._shape[axis]))

    def device(self) -> torch.device:
        """The torch device of this rank's local parts."""
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, placement)
            and self.type == other.type
            and self._shape == other._shape
            and self._flat == other._flat
        )

    def __hash__(self) -> int:
        return hash((self.type, self._shape, self._flat))

    def __repr__(self) -> str:
        return f"placement(type={self.type!r}, ranks={self.ranks})"
