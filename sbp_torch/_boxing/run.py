"""Execute a boxing plan on this rank's local part."""

import torch

from .._comm import axis_group, empty_from
from .._layout import GlobalMeta
from .pieces import box_of, send_pieces
from .plan import POINT_TO_POINT, BoxingPlan, axis_view, plan_boxing
from .transitions import transition


def run_plan(local: torch.Tensor, plan: BoxingPlan) -> torch.Tensor:
    """This rank's local part after ``plan``. Ranks outside the placement and empty tensors move no data."""
    meta: GlobalMeta = plan.meta
    coord = meta.placement.local_coord()
    target = meta.with_sbp(plan.dst_sbp)
    if coord is None or meta.numel == 0:  # (made from ``local``: a traced exchange may take it in)
        return empty_from(local, target.local_shape(coord))
    for step in plan.steps:
        if step.collective == POINT_TO_POINT:
            out = local.new_empty(target.local_shape(coord))
            local = send_pieces(local, box_of(meta, coord)[0], step.pieces, out, box_of(target, coord)[0])
            meta = target
            continue
        row = transition(step.src, step.dst)
        group = None if row.is_local else axis_group(meta.placement, step.axis)
        local = row.run(local, step.src, step.dst, axis_view(meta, step.axis, coord), group)
        meta = meta.with_sbp(meta.sbp[: step.axis] + (step.dst,) + meta.sbp[step.axis + 1 :])
    return local


def box_local(local: torch.Tensor, meta: GlobalMeta, dst_sbp: tuple) -> torch.Tensor:
    """This rank's part of the tensor ``(local, meta)`` laid out as ``dst_sbp`` (same placement)."""
    return run_plan(local, plan_boxing(meta, dst_sbp))
