"""``OptionCosts``: the estimate of each option of each decision group on one mesh, by tracing it (the search
(``_search.py``) asks for the options it wants priced)."""

from __future__ import annotations

from ._cost_model import CostModel
from ._decisions import Group, in_unit, parameter_layouts
from ._estimate import Estimate, from_trace, parameters_estimate, recomputed_forward
from ._tracing import Tracer


def _pairs(params: dict, measured, metas) -> list:
    return [(metas[name], measured.grads.get(id(p))) for name, p in params.items()]


class OptionCosts:
    """Estimates per decision group and option on one mesh, for replicated and sharded storage."""

    def __init__(self, tracer: Tracer, groups: list[Group], costs: CostModel, states: int, on_trace=lambda: None):
        self.tracer, self.groups, self.costs, self.states = tracer, groups, costs, states
        self.on_trace = on_trace  # called after each trace (the search's progress)
        self.mesh = tracer.mesh
        self.traces = 0
        self.traced: dict[tuple, Estimate] = {}  # (group, option) -> the traced part of its first unit
        self.recomputed: dict[tuple, dict] = {}  # (group, option) -> by storage, with every unit recomputed

    def layouts(self, choice: dict) -> dict:
        return parameter_layouts(self.tracer.model, self.groups, choice)

    def replicate(self, group: Group) -> tuple:
        return tuple("replicate" for _ in group.decisions)

    def params_estimate(self, pairs, sharded: bool, kept: bool) -> Estimate:
        return parameters_estimate(
            pairs,
            self.costs,
            data_axis=self.mesh.data_axis,
            sharded=sharded,
            optimizer_states=self.states,
            kept_gathered=kept,
        )

    def unit_option(self, index: int, option: tuple) -> dict[bool, Estimate]:
        """A container's estimate (all its units) for ``option``, by storage (False: replicated). The first two
        units are traced; the second stands for the rest, and is the first again when they look alike. The same
        with every unit recomputed in backward goes to ``recomputed[index, option]``, from the same traces."""
        group = self.groups[index]
        layouts = self.layouts({index: option})
        n = len(group.units)
        per_unit = []
        for position, unit in enumerate(group.units[:2]):
            if position == 1 and self.tracer.alike(group.units[0], unit):
                per_unit.append(per_unit[0])
                continue
            measured, params = self.tracer.run_unit(unit, layouts)
            self.traces += 1
            self.on_trace()
            pairs = _pairs(params, measured, self.tracer.metas)
            per_unit.append((from_trace(measured, self.costs), pairs, recomputed_forward(measured, self.costs)))
        self.traced[index, option] = per_unit[0][0]
        weights = [1] + [n - 1] if n > 1 else [1]
        results: dict[bool, dict[bool, Estimate]] = {False: {}, True: {}}
        for recompute in (False, True):
            for sharded in (False, True):
                total = Estimate()
                gathered = 0.0
                for (trace_est, pairs, again), weight in zip(per_unit, weights):
                    est = trace_est + self.params_estimate(pairs, sharded, kept=False)
                    if recompute:
                        est = est + again
                    gathered = max(gathered, est.memory.get("gathered", 0))
                    total = total.plus(est, weight)
                total.memory["gathered"] = gathered * min(n, 2)  # one unit computes while the next is gathered
                # one unit's temporaries are alive at a time, not every unit's
                total.memory["temporaries"] = max(e.memory.get("temporaries", 0) for e, _, _ in per_unit)
                if recompute:  # the activations of the unit whose backward runs, recomputed
                    total.memory["recomputed"] = max(e.memory.get("activations", 0) for e, _, _ in per_unit)
                results[recompute][sharded] = total
        self.recomputed[index, option] = results[True]
        return results[False]

    def root_option(self, option: tuple, units_base: Estimate) -> dict[bool, Estimate]:
        layouts = self.layouts({0: option})
        measured, params = self.tracer.run_model(layouts, keep=1)
        self.traces += 1
        self.on_trace()
        root_params = {k: v for k, v in params.items() if not in_unit(k, list(self.tracer.containers))}
        trace_est = from_trace(measured, self.costs) - units_base
        trace_est.memory["temporaries"] = max(trace_est.memory.get("temporaries", 0), 0)
        pairs = _pairs(root_params, measured, self.tracer.metas)
        return {s: trace_est + self.params_estimate(pairs, s, kept=True) for s in (False, True)}
