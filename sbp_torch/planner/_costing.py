"""Estimates per decision group and option on one mesh, and the choice of one option per group."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ._costs import CostModel
from ._estimate import Estimate, from_trace, parameters_estimate
from ._structure import Group, in_unit, parameter_layouts
from ._tracer import Tracer


def _pairs(params: dict, measured, metas) -> list:
    return [(metas[name], measured.grads.get(id(p))) for name, p in params.items()]


class Costing:
    """Estimates per decision group and option on one mesh, for replicated and sharded storage."""

    def __init__(self, tracer: Tracer, groups: list[Group], costs: CostModel, states: int):
        self.tracer, self.groups, self.costs, self.states = tracer, groups, costs, states
        self.mesh = tracer.mesh
        self.traces = 0
        self.traced: dict[tuple, Estimate] = {}  # (group, option) -> the traced part of its first unit

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
        units are traced; the second stands for the rest, and is the first again when they look alike."""
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
            per_unit.append((from_trace(measured, self.costs), _pairs(params, measured, self.tracer.metas)))
        self.traced[index, option] = per_unit[0][0]
        weights = [1] + [n - 1] if n > 1 else [1]
        results = {}
        for sharded in (False, True):
            total = Estimate()
            gathered = 0.0
            for (trace_est, pairs), weight in zip(per_unit, weights):
                est = trace_est + self.params_estimate(pairs, sharded, kept=False)
                gathered = max(gathered, est.memory.get("gathered", 0))
                total = total.plus(est, weight)
            total.memory["gathered"] = gathered * min(n, 2)  # one unit computes while the next is gathered
            # one unit's temporaries are alive at a time, not every unit's
            total.memory["temporaries"] = max(e.memory.get("temporaries", 0) for e, _ in per_unit)
            results[sharded] = total
        return results

    def root_option(self, option: tuple, units_base: Estimate) -> dict[bool, Estimate]:
        layouts = self.layouts({0: option})
        measured, params = self.tracer.run_model(layouts, keep=1)
        self.traces += 1
        root_params = {k: v for k, v in params.items() if not in_unit(k, list(self.tracer.containers))}
        trace_est = from_trace(measured, self.costs) - units_base
        trace_est.memory["temporaries"] = max(trace_est.memory.get("temporaries", 0), 0)
        pairs = _pairs(root_params, measured, self.tracer.metas)
        return {s: trace_est + self.params_estimate(pairs, s, kept=True) for s in (False, True)}


def search_group(costing: Costing, index: int, limit: int, costs: CostModel, evaluate) -> tuple[dict, str]:
    """Option -> estimates by storage (``evaluate(option)``), for every option evaluated; and how the options
    were searched: all of them up to ``limit``, else coordinate descent."""
    group = costing.groups[index]
    combos = group.combinations() if costing.mesh.tensor_axis is not None else [costing.replicate(group)]
    if len(combos) <= limit:
        return {c: evaluate(c) for c in combos}, "exhaustive"
    found: dict = {}
    alternating = tuple(
        ("column", "row")[i % 2] if "column" in d.options else "replicate" for i, d in enumerate(group.decisions)
    )
    for seed in (costing.replicate(group), alternating):  # columns feeding rows: the pairing that needs least
        found[seed] = evaluate(seed)
    current = min(found, key=lambda c: found[c][False].step_s(costs))
    improved = True
    while improved:  # coordinate descent on the replicated step time
        improved = False
        for i, decision in enumerate(group.decisions):
            for option in decision.options:
                candidate = current[:i] + (option,) + current[i + 1 :]
                if candidate not in found:
                    found[candidate] = evaluate(candidate)
                if found[candidate][False].step_s(costs) < found[current][False].step_s(costs) - 1e-12:
                    current, improved = candidate, True
    return found, f"local search ({len(found)} of {len(combos)})"


def choose(tables: list[dict], budget: float, costs: CostModel, sharded: bool):
    """One option per group minimising the summed step time with the summed memory under ``budget``: an
    integer program (exact); None when nothing fits."""
    options = [list(t) for t in tables]
    times = [[t[o][sharded].step_s(costs) for o in opts] for t, opts in zip(tables, options)]
    mems = [[t[o][sharded].memory_bytes() for o in opts] for t, opts in zip(tables, options)]
    if not math.isfinite(budget):
        return [opts[int(np.argmin(ts))] for opts, ts in zip(options, times)]
    sizes = [len(o) for o in options]
    c = np.concatenate([np.array(t) for t in times])
    one_each = np.zeros((len(sizes), sum(sizes)))
    start = 0
    for g, size in enumerate(sizes):
        one_each[g, start : start + size] = 1
        start += size
    memory = np.concatenate([np.array(m) for m in mems])[None, :]
    result = milp(
        c,
        integrality=np.ones_like(c),
        bounds=Bounds(0, 1),
        constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(memory, -np.inf, budget)],
    )
    if not result.success:
        return None
    picks, start = [], 0
    for opts, size in zip(options, sizes):
        picks.append(opts[int(np.argmax(result.x[start : start + size]))])
        start += size
    return picks
