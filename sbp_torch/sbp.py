"""The SBP vocabulary: ``split(dim)``, ``broadcast``, ``partial_sum``, ``partial_max``, ``partial_min``."""

from ._layout._sbp import Broadcast, Partial, Split, broadcast, partial, partial_max, partial_min, partial_sum, split

__all__ = [
    "Broadcast",
    "Partial",
    "Split",
    "broadcast",
    "partial",
    "partial_max",
    "partial_min",
    "partial_sum",
    "split",
]
