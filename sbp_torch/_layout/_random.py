"""Random global tensors whose logical value does not depend on world size, placement or SBP (docs/randomness.md).

* CPU: every rank draws the whole logical tensor from torch's CPU generator and keeps its region, so the result
  equals ``torch.randn(size)`` in one process after the same ``torch.manual_seed`` (at O(logical size) per rank).
* CUDA: counter-based Philox keyed by the device generator's seed, counting from its offset: each rank computes
  just its region, then every rank advances the offset by the counters of the whole tensor."""

import contextlib
import math

import torch

from . import _philox
from ._meta import narrow_to

_TORCH_DRAW = {"normal": torch.randn, "uniform": torch.rand}
_DEVICE_DRAWS_REFUSED = [False]


@contextlib.contextmanager
def device_draws_refused():
    """Within the block, a draw on a CUDA device raises: its generator's seed and offset are read in Python, and a
    program traced here would replay the same values on every call."""
    _DEVICE_DRAWS_REFUSED[0] = True
    try:
        yield
    finally:
        _DEVICE_DRAWS_REFUSED[0] = False


def random_region(kind: str, shape: tuple[int, ...], dtype: torch.dtype, starts, lengths, device) -> torch.Tensor:
    """The box ``starts``/``lengths`` of a fresh ``"uniform"`` or ``"normal"`` random tensor of logical ``shape``
    and ``dtype``. Every rank must call it, as it advances the generator by one draw of the whole logical tensor;
    ranks outside the placement pass ``starts=None`` and only advance the generator (getting None)."""
    if device.type == "meta":  # parts with a shape and no values (the planner's traces): no generator moves
        return None if starts is None else torch.empty(tuple(lengths), dtype=dtype, device="meta")
    if device.type == "cpu":
        full = _TORCH_DRAW[kind](shape, dtype=dtype)
        return None if starts is None else narrow_to(full, starts, lengths)
    if _DEVICE_DRAWS_REFUSED[0]:
        raise NotImplementedError(
            "random global tensors on CUDA cannot be drawn inside compile_step: the traced program would replay "
            "the same values every call; draw them outside the step and pass them in"
        )
    generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
    seed, offset = generator.initial_seed(), generator.get_offset()
    used = _philox.counters_used(math.prod(shape))
    generator.set_offset(offset + (used + 3) // 4 * 4)  # torch keeps Philox offsets multiples of 4
    if starts is None:
        return None
    indices = _philox.region_flat_indices(shape, starts, lengths, device)
    return _philox.random_values(kind, indices, seed, offset, dtype)
