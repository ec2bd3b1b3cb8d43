"""The meshes a plan may use, and the process group planning traces in."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # (and registers the "fake" backend)


@dataclass(frozen=True)
class Mesh:
    """A placement shape and the role of its axes: ``data_axis`` splits the batch, ``tensor_axis`` the layers."""

    shape: tuple[int, ...]
    data_axis: int | None
    tensor_axis: int | None


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
