"""SBP: how the logical tensor maps to the local parts along one placement axis (``Split``, ``Broadcast``,
``Partial``). Objects are immutable, hashable and compare by value, so layouts can be cache keys."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """Each rank holds one balanced slice of tensor dimension ``dim`` (the first ``n % p`` get one more row);
    ``dim`` is normalised to non-negative when attached to a tensor."""

    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Broadcast:
    """Every rank of the axis holds the full value."""

    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a full-shape tensor; the logical value is their element-wise ``op`` ("sum", "max", "min")."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in REDUCE_OPS:
            raise ValueError(f"Partial reduction must be one of {sorted(REDUCE_OPS)}, got {self.op!r}")

    def __repr__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


SbpType = Split | Broadcast | Partial

REDUCE_OPS = ("sum", "max", "min")


def split(dim: int) -> Split:
    """Split the tensor along ``dim`` (negative dims count from the end)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"split(dim) takes an int, got {type(dim).__name__}")
    return Split(dim)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")
partial_min = Partial("min")


def partial(op: str = "sum") -> Partial:
    """Partial with the given reduction ("sum", "max" or "min")."""
    return Partial(op)


def reduction_identity(op: str, dtype: torch.dtype):
    """The value that leaves ``op`` unchanged, used to fill the slots a rank does not own."""
    if op == "sum":
        return False if dtype == torch.bool else 0
    if dtype == torch.bool:
        return op == "min"  # max is "or" (identity False), min is "and" (identity True)
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def check_partial_dtype(sbp: Partial, dtype: torch.dtype) -> None:
    """Raise where the reduction is undefined for ``dtype`` (sum of bools, max/min of complex numbers)."""
    if sbp.op == "sum" and dtype == torch.bool:
        raise TypeError("partial_sum is undefined for bool tensors (use partial_max for 'or', partial_min for 'and')")
    if sbp.op != "sum" and dtype.is_complex:
        raise TypeError(f"partial_{sbp.op} is undefined for complex tensors")
