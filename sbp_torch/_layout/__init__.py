"""The layout vocabulary that every layer above speaks: SBPs, placements, global metadata, regions. No communication."""

from ._meta import (
    GlobalMeta,
    ValueDependentShape,
    balanced_part,
    balanced_sizes,
    contiguous_strides,
    dense_strides,
    narrow_to,
    normalize_sbp,
    partials_as_broadcast,
    refuse_value_dependent,
)
from ._placement import placement as Placement
from ._random import device_draws_refused, random_region
from ._sbp import (
    REDUCE_OPS,
    Broadcast,
    Partial,
    SbpType,
    Split,
    broadcast,
    check_partial_dtype,
    partial_max,
    partial_min,
    partial_sum,
    reduction_identity,
)
