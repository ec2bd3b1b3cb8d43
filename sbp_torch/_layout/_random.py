"""Random global tensors whose logical value does not depend on world size, placement or SBP.

* CPU: every rank draws the whole logical tensor from torch's CPU generator and keeps its region, so the
  result equals ``torch.randn(size)`` in a single process after the same ``torch.manual_seed``, and every
  rank's generator advances alike. Drawing costs O(logical size) per rank, the price of that equality.
* CUDA: a counter-based Philox stream keyed by the device generator's seed, with the generator's offset as
  the counter base. Element ``i`` of the logical tensor is a function of ``(seed, offset, i)`` only, so each
  rank computes just its own region, and the offset then advances by the counters the whole tensor uses, on
  every rank (as single-GPU PyTorch advances its Philox offset per kernel launch).
"""

import math

import torch

from . import _philox
from ._meta import narrow_to

_TORCH_DRAW = {"normal": torch.randn, "uniform": torch.rand}


def random_region(kind: str, shape: tuple[int, ...], dtype: torch.dtype, starts, lengths, device) -> torch.Tensor:
    """The box ``starts``/``lengths`` of a fresh random tensor of logical ``shape`` and ``dtype``, drawn
    ``"uniform"`` or ``"normal"``; every rank must call it, since it advances the generator as one draw of the
    whole logical tensor. Ranks outside the placement pass ``starts=None``: they only advance the generator
    (and get None)."""
    if device.type == "cpu":
        full = _TORCH_DRAW[kind](shape, dtype=dtype)
        return None if starts is None else narrow_to(full, starts, lengths)
    generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
    seed, offset = generator.initial_seed(), generator.get_offset()
    used = _philox.counters_used(math.prod(shape))
    generator.set_offset(offset + (used + 3) // 4 * 4)  # torch keeps Philox offsets multiples of 4
    if starts is None:
        return None
    indices = _philox.region_flat_indices(shape, starts, lengths, device)
    return _philox.random_values(kind, indices, seed, offset, dtype)
