"""The signature table: one module per op family; importing them fills the registry in ``core``."""

from . import (  # noqa: F401  (registration by import)
    convolution,
    embedding,
    factory,
    foreach,
    indexing,
    kernels,
    matmul,
    normalization,
    pointwise,
    random_ops,
    reductions,
    softmax_loss,
    views,
)
from .core import RULES, rule_for

__all__ = ["RULES", "rule_for"]
