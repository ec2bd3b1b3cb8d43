"""Random global tensors whose logical value does not depend on world size, placement or SBP.

* CPU: every rank draws the whole logical tensor from torch's CPU generator and keeps its region, so the
  result equals ``torch.randn(size)`` in a single process after the same ``torch.manual_seed``, and every
  rank's generator advances alike. Drawing costs O(logical size) per rank, the price of that equality.
* CUDA: a counter-based Philox stream keyed by the device generator's seed, with the generator's offset as
  the counter base. Element ``i`` of the logical tensor is a function of ``(seed, offset, i)`` only, so each
  rank computes just its own region, and the offset then advances by the counters the whole tensor uses, on
  every rank (as single-GPU PyTorch advances its Philox offset per kernel launch).
"""

from __future__ import annotations

import torch

from . import _philox
from ._layout import GlobalMeta

_TORCH_DRAW = {"normal": torch.randn, "uniform": torch.rand}


def _slices(starts, lengths):
    return tuple(slice(s, s + n) for s, n in zip(starts, lengths))


def counter_based_region(kind: str, meta: GlobalMeta, starts, lengths, seed: int, offset: int, device):
    """The values of the box region of a counter-based random tensor (any device; CUDA uses this)."""
    indices = _philox.region_flat_indices(meta.shape, starts, lengths, device)
    return _philox.random_values(kind, indices, seed, offset, meta.dtype)


def random_region(kind: str, meta: GlobalMeta, starts, lengths, device):
    """This rank's region of a fresh random tensor; every rank must call it (it advances the generator).

    ``starts``/``lengths`` is None on ranks outside the placement, which only advance their generator.
    """
    if device.type == "cpu":
        full = _TORCH_DRAW[kind](meta.shape, dtype=meta.dtype)
        return None if starts is None else full[_slices(starts, lengths)]
    generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
    seed, offset = generator.initial_seed(), generator.get_offset()
    used = _philox.counters_used(meta.numel)
    generator.set_offset(offset + (used + 3) // 4 * 4)  # torch keeps Philox offsets multiples of 4
    if starts is None:
        return None
    return counter_based_region(kind, meta, starts, lengths, seed, offset, device)
