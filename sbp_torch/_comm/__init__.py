"""Communication on ``torch.distributed``: process groups per placement axis, collectives along one axis (uneven
parts included), point-to-point exchanges, and the metadata agreement that lets every rank raise alike."""

from ._agreement import agree
from ._collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    send_recv,
    start_all_reduce,
)
from ._groups import AxisGroup, axis_group, ensure_groups, forget_groups
from ._primitives import observing
