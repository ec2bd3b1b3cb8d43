"""``memory_report``: the bytes a laid-out model holds on this rank, by what they are for."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from .._tensor import GlobalTensor


@dataclass(frozen=True)
class MemoryReport:
    """Bytes on this rank. ``parameters``, ``gradients`` and ``optimizer_state`` are what is held now (the local
    parts of global tensors); ``gathered_peak`` is the most that a sharded model's gathered parameter copies
    held at once, and ``saved_for_backward_peak`` the most that autograd held saved for backward in one
    forward (gathered copies not counted), both since ``Module.to_global`` and None for a model not sharded."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_peak: int | None
    saved_for_backward_peak: int | None

    def __str__(self) -> str:
        rows = [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)]
        return "\n".join(f"{name:24} {'—' if n is None else f'{n:,} B':>16}" for name, n in rows)


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        local = t._local if isinstance(t, GlobalTensor) else t
        total += local.numel() * local.element_size()
    return total


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """The bytes ``model`` (and ``optimizer``'s state, if given) hold on this rank; see ``MemoryReport``."""
    params = list(model.parameters())
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]
    sharded = getattr(model, "_sbp_torch_sharded", None)
    watched = sharded.memory() if sharded is not None else {}
    return MemoryReport(
        parameters=_local_bytes(params),
        gradients=_local_bytes(p.grad for p in params),
        optimizer_state=_local_bytes(state),
        gathered_peak=watched.get("gathered_peak"),
        saved_for_backward_peak=watched.get("saved_for_backward_peak"),
    )
