"""The layout vocabulary: SBPs, placements, the metadata of a global tensor and the regions ranks hold.

Nothing here communicates. Every layer above speaks these types.
"""

from ._meta import (
    GlobalMeta,
    balanced_part,
    balanced_sizes,
    contiguous_strides,
    narrow_to,
    normalize_sbp,
    partials_as_broadcast,
)
from ._placement import placement as Placement
from ._random import random_region
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
