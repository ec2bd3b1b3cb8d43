"""Layout arithmetic: which region of the logical tensor each rank holds. Pure functions, no communication.

A rank at coordinates ``c`` holds the region found by applying the SBPs axis by axis: ``Split(d)`` on axis ``a``
keeps the balanced part ``c[a]`` (the first ``n % p`` parts get one more row) of the region's current extent
along ``d``, so axes splitting one dim nest in axis order, as in OneFlow; ``Broadcast`` and ``Partial`` keep it."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

from ._placement import placement as Placement
from ._sbp import Broadcast, Partial, SbpType, Split, broadcast, check_partial_dtype


def balanced_part(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part ``index`` when ``n`` rows are split into ``parts`` balanced parts."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def balanced_sizes(n: int, parts: int) -> list[int]:
    """The lengths of the ``parts`` balanced parts of ``n`` rows."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class ValueDependentShape(RuntimeError):
    """A shape every rank must know would depend on the values of the data: an op whose output size is known only
    when it runs (``nonzero``, a boolean mask, ``unique``, a slice by a number read from a tensor), traced into a
    program. A traced program fixes the shapes of its global tensors and of the parts it agrees on."""


def refuse_value_dependent(shape, what: str) -> None:
    """Raise ``ValueDependentShape`` if ``shape`` (of ``what``) holds a size that is a symbol of the data."""
    if has_free_unbacked_symbols(tuple(shape)):
        raise ValueDependentShape(
            f"{what} would have the shape {tuple(shape)}, whose sizes depend on the values of the data (symbols of "
            "the traced program), and every rank must know it when the program is traced: keep such sizes inside a "
            "local_map region whose outputs have a known shape (a mask, or a fixed capacity), or run this part "
            "eagerly"
        )


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape``."""
    try:
        return _contiguous_strides(shape)
    except TypeError:  # (symbolic sizes, which are no cache key)
        refuse_value_dependent(shape, "a global tensor")
        return _contiguous_strides.__wrapped__(shape)


def dense_strides(shape: tuple[int, ...], like: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims lie in memory in the order of the strides ``like``
    (those of a tensor of as many dims): outermost the dim of the largest stride, ties in dim order, as
    ``torch.empty_like`` orders a tensor it preserves. Contiguous where ``like`` is."""
    order = sorted(range(len(shape)), key=lambda d: -like[d])
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def narrow_to(x: torch.Tensor, starts, lengths, origin=None) -> torch.Tensor:
    """The view of ``x`` that holds the box ``starts``/``lengths`` of the logical tensor, where ``x`` itself
    is the box that starts at ``origin`` (default: ``x`` is the whole logical tensor)."""
    for d, (s, n) in enumerate(zip(starts, lengths)):
        x = x.narrow(d, s - (origin[d] if origin is not None else 0), n)
    return x


def partials_as_broadcast(sbp: tuple[SbpType, ...]) -> tuple[SbpType, ...]:
    """``sbp`` with each partial axis made broadcast: the layout of a partial tensor's reduced value."""
    return tuple(broadcast if isinstance(s, Partial) else s for s in sbp)


@dataclass(frozen=True)
class GlobalMeta:
    """What every rank knows about a global tensor: logical shape, dtype, placement, one SBP per axis, and the
    logical strides: those plain torch gives the logical tensor after the same calls (contiguous when not given).
    The local part may be laid out otherwise; the strides are what the tensor reports, and what code reading them
    (``reshape`` choosing a view or a copy, ``contiguous()``, autograd's layout of a gradient) decides by."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    sbp: tuple[SbpType, ...]
    strides: tuple[int, ...] | None = None
    # A view (to torch) whose part was computed as a copy (its input boxed first, or gathered): writes into it would
    # not reach its base, and are refused
    copied: bool = False

    def __post_init__(self):
        if self.strides is None:
            object.__setattr__(self, "strides", contiguous_strides(self.shape))

    @functools.cached_property
    def _hash(self) -> int:
        # Metadata is hashed on every dispatch (decision cache keys): compute the hash once, when first asked
        # (not on construction, which torch.compile traces where it cannot always hash a placement).
        return hash((self.shape, self.dtype, self.placement, self.sbp, self.strides, self.copied))

    def __hash__(self) -> int:
        return self._hash

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def contiguous(self) -> bool:
        """Whether the logical strides are those of a contiguous tensor (sizes of 1 may have any stride)."""
        if self.numel == 0:
            return True
        return all(n == 1 or s == c for n, s, c in zip(self.shape, self.strides, contiguous_strides(self.shape)))

    def with_sbp(self, sbp: tuple[SbpType, ...]) -> GlobalMeta:
        """The same logical tensor laid out as ``sbp``."""
        return GlobalMeta(self.shape, self.dtype, self.placement, sbp, self.strides)

    def region(self, coord: tuple[int, ...], axes: int | None = None) -> tuple[list[int], list[int]]:
        """(starts, lengths) of the region held at ``coord``, applying the first ``axes`` axes (default all)."""
        starts, lengths = [0] * len(self.shape), list(self.shape)
        for a, sbp in enumerate(self.sbp[:axes]):
            if isinstance(sbp, Split):
                offset, lengths[sbp.dim] = balanced_part(lengths[sbp.dim], self.placement.shape[a], coord[a])
                starts[sbp.dim] += offset
        return starts, lengths

    def local_shape(self, coord: tuple[int, ...] | None) -> tuple[int, ...]:
        """Shape of the local part at ``coord``; ``(0,)`` for a rank outside the placement."""
        return (0,) if coord is None else tuple(self.region(coord)[1])

    def __repr__(self) -> str:
        sbp = ", ".join(map(repr, self.sbp))
        strides = "" if self.contiguous else f", strides={tuple(self.strides)}"
        copied = ", a view computed as a copy" if self.copied else ""
        return (
            f"shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement}, sbp=({sbp}){strides}{copied}"
        )


def normalize_sbp(sbp, p: Placement, ndim: int, dtype: torch.dtype) -> tuple[SbpType, ...]:
    """Validate ``sbp`` for a tensor of ``ndim`` dims and ``dtype`` on ``p``; return it as a tuple with split
    dims made non-negative. Raises ValueError/TypeError naming the problem."""
    if isinstance(sbp, (Split, Broadcast, Partial)):
        sbp = (sbp,)
    if not isinstance(sbp, (tuple, list)) or not all(isinstance(s, (Split, Broadcast, Partial)) for s in sbp):
        raise TypeError(f"sbp must be an SBP or a tuple of SBPs (sbp_torch.sbp.split(d), ...), got {sbp!r}")
    if len(sbp) != p.ndim:
        raise ValueError(f"sbp {tuple(sbp)} has {len(sbp)} entries but the placement has {p.ndim} axes {p.shape}")
    out = []
    for s in sbp:
        if isinstance(s, Split):
            if not -ndim <= s.dim < ndim:
                raise ValueError(f"split dim {s.dim} is out of range for a tensor with {ndim} dims")
            s = Split(s.dim % ndim)
        elif isinstance(s, Partial):
            check_partial_dtype(s, dtype)
        out.append(s)
    return tuple(out)
