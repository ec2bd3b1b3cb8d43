"""Counter-based random numbers (Philox4x32-10) built from plain torch tensor ops; see docs/randomness.md.

A random global tensor must have the same logical value however it is split. Here logical element ``i`` is a
pure function of ``(seed, offset, i)``, so every rank computes exactly its own slice (``region_flat_indices``)
and the pieces agree with the unsplit tensor. Only integer and elementwise float ops are used, so the same code
runs on CPU and CUDA without custom kernels.

Integer arithmetic is done in int64 tensors holding values in ``[0, 2**32)``; 32x32->64-bit products are split
into 16-bit pieces so that no intermediate exceeds 2**49 (signed int64 overflow is never relied upon)."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["philox4x32", "random_values", "counters_used", "region_flat_indices"]

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_ROUNDS = 10


def _mulhilo(m: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product of constant ``m`` and ``x``."""
    p0 = m * (x & 0xFFFF)  # < 2**48
    p1 = m * (x >> 16)  # < 2**48;  m*x == p0 + p1 * 2**16
    low = p0 + ((p1 & 0xFFFF) << 16)  # < 2**49
    return (p1 >> 16) + (low >> 32), low & _MASK32


def philox4x32(counter_lo: Tensor, counter_hi: Tensor, seed: int) -> Tensor:
    """Philox4x32-10 block function; returns int64 words in ``[0, 2**32)``, shape ``(*shape, 4)``. The 128-bit
    counter words ``(c0, c1, c2, c3)`` are the low and high 32 bits of ``counter_lo``, then of ``counter_hi``,
    reading the int64 tensors as two's-complement 64-bit values (``-1`` is all ones). The key is
    ``(k0, k1) = (seed mod 2**32, (seed >> 32) mod 2**32)``. Output lane ``j`` is Random123's ``v[j]``."""
    counter_lo, counter_hi = torch.broadcast_tensors(counter_lo.long(), counter_hi.long())
    c0, c1 = counter_lo & _MASK32, (counter_lo >> 32) & _MASK32
    c2, c3 = counter_hi & _MASK32, (counter_hi >> 32) & _MASK32
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for r in range(_ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def counters_used(numel: int) -> int:
    """Counter values consumed by ``numel`` elements (4 per counter); advance offsets by this."""
    return (int(numel) + 3) // 4


# Mantissa bits that a uniform in [0, 1) on a 2**-bits grid can use exactly per dtype.
_UNIFORM_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 32}


def random_values(kind: str, flat_indices: Tensor, seed: int, offset: int, dtype: torch.dtype) -> Tensor:
    """Random values for the logical elements ``flat_indices`` (row-major linear indices), of their shape and
    device, in ``dtype``. Element ``i`` uses lane ``i % 4`` of ``philox4x32(offset + i // 4, 0, seed)``, so it
    depends only on ``(seed, offset, i)``.

    * ``"uniform"``: in ``[0, 1)`` like ``torch.rand``: the top ``b`` bits of the lane's 32-bit word scaled by
      ``2**-b``, ``b`` = 11/8/24/32 for float16/bfloat16/float32/float64 (float64 uses one 32-bit word: a
      2**-32 grid). Every value is exactly representable in ``dtype``, so rounding never produces 1.0.
    * ``"normal"``: standard normal like ``torch.randn``, by Box-Muller on the lane pairs (0, 1) and (2, 3) of
      the element's own counter: lane 0/2 gives ``r*cos(t)``, lane 1/3 ``r*sin(t)``, with ``r = sqrt(-2 log u1)``,
      ``u1 = (w_even + 1) * 2**-32`` in ``(0, 1]`` (log never sees 0) and ``t = 2*pi*w_odd * 2**-32``.
      Computed in float64, then rounded to ``dtype``."""
    if dtype not in _UNIFORM_BITS:
        raise TypeError(f"unsupported dtype {dtype}")
    idx = flat_indices.long()
    lane = (idx % 4).unsqueeze(-1)
    words = philox4x32(idx // 4 + int(offset), torch.zeros_like(idx), seed)
    if kind == "uniform":
        bits = _UNIFORM_BITS[dtype]
        w = words.gather(-1, lane).squeeze(-1) >> (32 - bits)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return (w.to(work) * 2.0**-bits).to(dtype)
    if kind == "normal":
        even = lane - lane % 2  # first lane of the element's Box-Muller pair
        w1 = words.gather(-1, even).squeeze(-1).double()
        w2 = words.gather(-1, even + 1).squeeze(-1).double()
        radius = torch.sqrt(-2.0 * torch.log((w1 + 1.0) * 2.0**-32))
        theta = w2 * (2.0 * math.pi * 2.0**-32)
        z = radius * torch.where(lane.squeeze(-1) % 2 == 0, torch.cos(theta), torch.sin(theta))
        return z.to(dtype)
    raise ValueError(f"unknown kind {kind!r}; expected 'uniform' or 'normal'")


def region_flat_indices(
    global_shape: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device=None
) -> Tensor:
    """Row-major linear indices of the box ``[starts, starts + lengths)`` of a
    logical tensor of ``global_shape``; int64, shaped ``lengths`` (0-dim -> ``tensor(0)``)."""
    shape, starts, lengths = tuple(map(int, global_shape)), tuple(map(int, starts)), tuple(map(int, lengths))
    if not len(shape) == len(starts) == len(lengths):
        raise ValueError("global_shape, starts and lengths must have the same length")
    out = torch.zeros((), dtype=torch.int64, device=device)
    stride, ndim = 1, len(shape)
    for d in reversed(range(ndim)):
        if starts[d] < 0 or lengths[d] < 0 or starts[d] + lengths[d] > shape[d]:
            raise ValueError(
                f"region [{starts[d]}, {starts[d] + lengths[d]}) out of range for dim {d} of size {shape[d]}"
            )
        ar = torch.arange(starts[d], starts[d] + lengths[d], dtype=torch.int64, device=device) * stride
        out = out + ar.view((1,) * d + (-1,) + (1,) * (ndim - d - 1))
        stride *= shape[d]
    return out
