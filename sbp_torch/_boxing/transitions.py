"""The 1-D boxing table: for each pair of SBP kinds, the collective that moves the fewest bytes on one placement
axis; N-D boxing (``plan.py``) is a sequence of these rows.

| from \\ to  | B                   | S(j)                      | P(op)                          |
|------------|---------------------|---------------------------|--------------------------------|
| S(i)       | all-gather          | all-to-all (i != j)       | local: fill off-part with identity |
| B          | -                   | local slice (a view)      | local: keep on index 0 (sum), keep (max/min) |
| P(op)      | all-reduce          | reduce-scatter            | (planned as P -> S(k) -> P(op2)) |

A change of partial op is not a row: the planner routes it through a split (reduce-scatter, then a local fill),
which sends half the bytes of an all-reduce."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _comm as comm
from .._comm import AxisGroup
from .._layout import Broadcast, Partial, SbpType, Split, balanced_part, balanced_sizes, reduction_identity


@dataclass(frozen=True)
class AxisView:
    """What one transition needs to know about the tensor along its axis, on one rank: ``extent``, the region's
    size per tensor dim before this axis' split (the tensor that the axis group shares); ``local_numel``, this
    rank's element count before the transition; ``parts``, the axis length; ``index``, this rank's coordinate."""

    extent: tuple[int, ...]
    local_numel: int
    parts: int
    index: int

    def sizes(self, dim: int) -> list[int]:
        return balanced_sizes(self.extent[dim], self.parts)

    def own(self, dim: int) -> tuple[int, int]:
        return balanced_part(self.extent[dim], self.parts, self.index)


@dataclass(frozen=True)
class Transition:
    """One row of the table: the collective's name, elements this rank sends, and how to run it."""

    collective: str
    sent: Callable[[SbpType, SbpType, AxisView], float]
    run: Callable[[torch.Tensor, SbpType, SbpType, AxisView, AxisGroup], torch.Tensor]

    @property
    def is_local(self) -> bool:
        """Local rows move no data and need no process group."""
        return self.collective.startswith("local")


def _share(view: AxisView, dim: int) -> float:
    """Fraction of this rank's elements that it keeps when ``dim`` is split over the axis."""
    extent = view.extent[dim]
    return view.own(dim)[1] / extent if extent else 0.0


def _fill(local: torch.Tensor, op: str, dim: int, view: AxisView) -> torch.Tensor:
    """The full-extent tensor holding ``local`` at this rank's part of ``dim`` and ``op``'s identity elsewhere."""
    shape = list(local.shape)
    shape[dim] = view.extent[dim]
    full = local.new_full(shape, reduction_identity(op, local.dtype))
    start, length = view.own(dim)
    full.narrow(dim, start, length).copy_(local)
    return full


TABLE: dict[tuple[type, type], Transition] = {
    (Split, Broadcast): Transition(
        "all-gather",
        lambda s, t, v: v.local_numel * (v.parts - 1),
        lambda x, s, t, v, g: comm.all_gather(x, s.dim, v.sizes(s.dim), g),
    ),
    (Split, Split): Transition(
        "all-to-all",
        lambda s, t, v: v.local_numel * (1 - _share(v, t.dim)),
        lambda x, s, t, v, g: comm.all_to_all(x, t.dim, s.dim, v.sizes(t.dim), v.sizes(s.dim), g),
    ),
    (Split, Partial): Transition(
        "local fill",
        lambda s, t, v: 0,
        lambda x, s, t, v, g: _fill(x, t.op, s.dim, v),
    ),
    (Broadcast, Split): Transition(
        "local slice",
        lambda s, t, v: 0,
        lambda x, s, t, v, g: x.narrow(t.dim, *v.own(t.dim)),
    ),
    (Broadcast, Partial): Transition(
        "local",
        lambda s, t, v: 0,
        lambda x, s, t, v, g: x if t.op != "sum" or v.index == 0 else torch.zeros_like(x),
    ),
    (Partial, Broadcast): Transition(
        "all-reduce",
        lambda s, t, v: 2 * v.local_numel * (v.parts - 1) / v.parts,
        lambda x, s, t, v, g: comm.all_reduce(x, s.op, g),
    ),
    (Partial, Split): Transition(
        "reduce-scatter",
        lambda s, t, v: v.local_numel * (1 - _share(v, t.dim)),
        lambda x, s, t, v, g: comm.reduce_scatter(x, s.op, t.dim, v.sizes(t.dim), g),
    ),
}


def transition(src: SbpType, dst: SbpType) -> Transition:
    """The table row for ``src -> dst`` (which must differ; partial -> partial is planned as two rows)."""
    return TABLE[(type(src), type(dst))]
