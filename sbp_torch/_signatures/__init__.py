"""The signature table: one module per op family; importing them fills the registry in ``core``."""

from . import matmul, pointwise  # noqa: F401  (registration by import)
from .core import RULES, rule_for

__all__ = ["RULES", "rule_for"]
