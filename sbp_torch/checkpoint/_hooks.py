"""The methods ``torch.distributed.checkpoint`` looks for on a tensor subclass, for global tensors: which box of
the logical tensor this rank writes, which boxes it reads, and the plain tensor that holds a box.

A rank's box is its region of the layout (``GlobalMeta.region``). Ranks that hold the same box (broadcast axes)
name it by the same offsets, and DCP's save planner writes each box once. A partial tensor has no box that holds
logical values, so these methods refuse it; ``sbp_torch.checkpoint.save`` and ``load`` reduce or expand partial
values around DCP."""

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .._layout import GlobalMeta, Partial
from .._tensor import GlobalTensor


def _box(meta: GlobalMeta, what: str) -> ChunkStorageMetadata | None:
    """The box this rank holds, or None where it holds no values (outside the placement, or an empty part of a
    tensor that has values: a box of no elements adds nothing, and DCP's plan check counts volumes)."""
    partial_axes = [a for a, s in enumerate(meta.sbp) if isinstance(s, Partial)]
    if partial_axes:
        raise ValueError(
            f"{what}: the global tensor ({meta}) is partial on placement axis {partial_axes[0]}; its parts are not "
            "values of the tensor. Save and load it with sbp_torch.checkpoint.save/load, which reduce partial "
            "values on the way out and lay them out again on the way in, or convert it with to_global first."
        )
    coord = meta.placement.local_coord()
    if coord is None:
        return None
    starts, lengths = meta.region(coord)
    if 0 in lengths and meta.numel > 0:
        return None
    return ChunkStorageMetadata(offsets=torch.Size(starts), sizes=torch.Size(lengths))


def create_write_items(self: GlobalTensor, fqn: str, obj) -> list[WriteItem]:
    """DCP's ``__create_write_items__``: one item for this rank's box (none outside the placement)."""
    box = _box(self._meta, f"saving {fqn!r}")
    if box is None:
        return []
    data = TensorWriteData(chunk=box, properties=TensorProperties(dtype=self.dtype), size=torch.Size(self.shape))
    return [WriteItem(index=MetadataIndex(fqn, box.offsets), type=WriteItemType.SHARD, tensor_data=data)]


def create_chunk_list(self: GlobalTensor) -> list[ChunkStorageMetadata]:
    """DCP's ``__create_chunk_list__``: the boxes this rank loads into (its own, none outside the placement)."""
    box = _box(self._meta, "loading a global tensor")
    return [] if box is None else [box]


def get_tensor_shard(self: GlobalTensor, index: MetadataIndex) -> torch.Tensor:
    """DCP's ``__get_tensor_shard__``: this rank's part, the plain tensor that holds the box at ``index``; DCP
    writes it out, or copies loaded values into it."""
    box = _box(self._meta, f"the checkpoint entry {index.fqn!r}")
    if box is None or tuple(box.offsets) != tuple(index.offset):
        raise ValueError(f"{index.fqn!r}: this rank holds no box at offsets {tuple(index.offset)} ({self._meta})")
    return self._local


def install(cls: type) -> None:
    """Give ``cls`` (GlobalTensor) the methods DCP looks for."""
    cls.__create_write_items__ = create_write_items
    cls.__create_chunk_list__ = create_chunk_list
    cls.__get_tensor_shard__ = get_tensor_shard
