"""Communication on ``torch.distributed``: process groups per placement axis, collectives along one axis (uneven
parts included), point-to-point exchanges, the metadata agreement that lets every rank raise alike, and what a
rank does when it can no longer stay in step with the others (``_faults.py``)."""

from ._agreement import agree
from ._bucketing import bucket_collectives, issued_together
from ._collectives import (
    POINT_TO_POINT,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    empty_from,
    generator_state_from,
    reduce_scatter,
    send_recv,
    start_all_reduce,
    start_gather_rows,
    start_reduce_scatter_parts,
)
from ._compiled import (
    RanksDisagree,
    check_program,
    compiling,
    gather_call_facts,
    holds_collectives,
    note_placement,
    tracing_program,
)
from ._faults import (
    CollectiveError,
    caller_stops_one_rank_failures,
    close_world,
    collective_failed,
    ops_on_some_ranks,
    posted_failures,
)
from ._groups import AxisGroup, axis_group, ensure_groups, forget_groups
from ._observer import UNNAMED, DataDependent, cause, caused_by, estimating, naming_cause, notify, observed, observing
from ._primitives import local_failure, traced
from ._step_calls import (
    announce_call,
    announce_step,
    refuse_a_lone_trace,
    refuse_other_programs,
    step_arguments,
)
