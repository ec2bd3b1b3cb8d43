"""The meshes a plan may use, and the process group planning traces in."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # (and registers the "fake" backend)

from .._layout import Placement, SbpType, Split, broadcast


@dataclass(frozen=True)
class Mesh:
    """A placement shape and the role of its axes: ``data_axis`` splits the batch, ``tensor_axis`` the layers."""

    shape: tuple[int, ...]
    data_axis: int | None
    tensor_axis: int | None

    def placement(self, device: str) -> Placement:
        """Ranks 0 to n - 1 in the mesh's shape (built without torch: it may run under fake modes)."""
        return Placement(device, np.arange(math.prod(self.shape)).reshape(self.shape).tolist())

    def rows_split(self, ndim: int) -> tuple[SbpType, ...]:
        """The layout of a batch tensor, or of the hidden state between units: rows split over the data axis,
        broadcast on every other axis (a tensor of no dims broadcast everywhere)."""
        return tuple(Split(0) if a == self.data_axis and ndim > 0 else broadcast for a in range(len(self.shape)))


def meshes_for(world: int) -> list[Mesh]:
    """Data parallel, tensor parallel, and every data x tensor grid of ``world`` ranks."""
    if world == 1:
        return [Mesh((1,), 0, None)]
    found = [Mesh((world,), 0, None), Mesh((world,), None, 0)]
    return found + [Mesh((d, world // d), 0, 1) for d in range(2, world) if world % d == 0]


@contextlib.contextmanager
def planning_world(world: int):
    """A process group of ``world`` ranks to trace in: the default one when it has that size, else torch's fake
    backend (one process standing for rank 0 of any world), taken down afterwards."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ValueError(
                f"planning for {world} ranks inside a process group of {dist.get_world_size()}: plan for the "
                "group's size, or plan in a process without a process group"
            )
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
