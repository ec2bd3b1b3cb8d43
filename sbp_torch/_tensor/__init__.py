"""The global tensor type, its differentiable conversions and its gradient rule."""

from ._callers import OWN_DIR, TORCH_DIR, first_outside
from ._conversions import to_placement, to_sbp
from ._global_tensor import (
    GlobalTensor,
    connect,
    from_whole,
    full_tensor,
    gradient,
    mark_reduced_at_use,
    plain_tangent_as_global,
    reduced_at_use,
    to_local,
    wrap_fresh,
)
from ._gradient import gradient_part, gradient_sbp, has_extreme
