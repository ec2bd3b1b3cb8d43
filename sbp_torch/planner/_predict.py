"""``predict``: the planner's estimate for a layout written by hand, priced as a plan is, so that plans and hand
layouts can be compared (and the estimates checked against measured steps)."""

from __future__ import annotations

import math

from .._api._experts import expert_regions
from .._api._module import sbp_for
from .._layout import Placement
from ._cost_model import CPU_GLOO, CostModel
from ._decisions import unit_containers
from ._estimate import from_trace, parameters_estimate, step_estimate
from ._meshes import Mesh, planning_world
from ._plan import Prediction
from ._search import optimizer_states
from ._tracing import Tracer


def predict(
    model,
    example_batch,
    placement: Placement,
    sbp,
    *,
    data_axis: int | None = 0,
    tensor_axis: int | None = None,
    shard: bool = False,
    costs: CostModel = CPU_GLOO,
    optimizer="AdamW",
    loss=None,
    compiled: bool = False,
) -> Prediction:
    """What the planner expects a step of ``model`` laid out by hand to cost: ``sbp`` as ``Module.to_global``
    takes it, the batch split over ``data_axis`` (None: broadcast), parameters stored split over the data axis
    when ``shard``; ``compiled``: as ``compile_step`` runs it (``CostModel.for_step``). The whole step is traced (no
    units cut, nothing pinned), as it will run."""
    costs = costs.for_step(compiled)
    size = math.prod(placement.shape)
    with planning_world(size), expert_regions(model):
        tracer = Tracer(model, example_batch, Mesh(tuple(placement.shape), data_axis, tensor_axis), loss)
        layouts = {
            name: sbp_for(name, p, sbp, tracer.placement) for name, p in model.named_parameters(remove_duplicate=False)
        }
        measured, params = tracer.run_model(layouts, keep=None, pinned=False)
        units = [u for us in unit_containers(model).values() for u in us]
        by_unit: dict = {}  # unit (None: the root) -> its parameters' (compute layout, gradient layout)
        for name, p in params.items():
            unit = next((u for u in units if name.startswith(u + ".")), None)
            by_unit.setdefault(unit, []).append((tracer.metas[name], measured.grads.get(id(p))))
        common = dict(data_axis=data_axis, sharded=shard, optimizer_states=optimizer_states(optimizer))
        root = parameters_estimate(by_unit.pop(None, []), costs, kept_gathered=True, **common)
        unit_estimates = [parameters_estimate(ps, costs, kept_gathered=False, **common) for ps in by_unit.values()]
        est = sum(unit_estimates, from_trace(measured, costs) + root)
        gathered = sorted(e.memory["gathered"] for e in unit_estimates)
        est.memory["gathered"] = root.memory["gathered"] + sum(gathered[-2:])  # one unit computes, the next is gathered
        est = est + step_estimate(costs, tracer.placement, data_axis, shard, len(units) + 1, est.reduced)
    return Prediction.of(est, costs)
