"""The signature table: one module per op family; importing them fills the registry in ``core``. A pure table:
rules see only metadata, local functions only their ``LocalContext``."""

from . import (  # noqa: F401  (registration by import)
    attention,
    convolution,
    embedding,
    factory,
    foreach,
    gradient_boundary,
    indexing,
    matmul,
    normalization,
    pointwise,
    random_ops,
    reductions,
    softmax_loss,
    sorting,
    views,
)
from .core import (
    RULES,
    LocalContext,
    NumberClass,
    OpCall,
    Rule,
    Signature,
    TensorInfo,
    UndeclaredArgument,
    number_class,
    register,
    rule_for,
    shown_arguments,
    sig,
)
from .gradient_boundary import GRADIENT_BOUNDARY
from .reductions import norm_statistic
