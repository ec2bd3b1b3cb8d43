"""``plan``: find the layout of a model's training step with the least predicted step time that fits a
memory limit, before anything runs (docs/planning.md).

For each mesh (every way to split the world into data x tensor ranks) the step is traced once with the
root's and the units' tensor-parallel decisions at ``replicate``, then each unit's options alone, from the
inputs that trace recorded, and each of the root's options; the estimates add up because the hidden state
is pinned to one layout at every unit's edges (``_pins.py``). A group with more option combinations than
``exhaustive_limit`` is searched by coordinate descent (``_search_group``). The choice of one option per decision
group, under the memory limit, is then an integer program, solved exactly (``_choose``, ``scipy.optimize.milp``).

What each option costs is ``OptionCosts``' (``_option_costs.py``: it traces the pieces with ``_tracing.py`` and
prices what they did with ``_estimate.py`` and the cost model, ``_cost_model.py``)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import nn

from .._api._experts import expert_regions
from .._layout import Placement, broadcast
from .._tensor import GlobalTensor
from ._cost_model import CPU_GLOO, CostModel
from ._decisions import groups_of, parameter_layouts
from ._estimate import OPTIMIZER_STATES, Estimate, step_estimate
from ._meshes import Mesh, meshes_for, planning_world
from ._option_costs import OptionCosts
from ._plan import Plan, Prediction, describe_mesh, sbp_text
from ._progress import Progress
from ._timing import step_seconds
from ._tracing import Tracer


class PlanError(ValueError):
    """No layout fits: the message names the smallest memory found and what dominates it."""


def optimizer_states(optimizer) -> int:
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)
    for known, states in OPTIMIZER_STATES.items():
        if known.lower() == str(name).lower():
            return states
    raise ValueError(f"unknown optimizer {name!r}: one of {sorted(OPTIMIZER_STATES)}")


def plan(
    model: nn.Module,
    example_batch,
    world: int | Placement,
    *,
    costs: CostModel = CPU_GLOO,
    memory_per_rank: float | None = None,
    optimizer="AdamW",
    loss=None,
    exhaustive_limit: int = 27,
    device: str = "cpu",
    progress: bool | None = None,
    measure: int = 0,
    compiled: bool = False,
) -> Plan:
    """The layout of ``model``'s training step on ``world`` ranks with the least predicted step time that fits
    ``memory_per_rank`` bytes (default: the cost model's), found by tracing on global tensors with meta parts: no
    data moves and no process group is needed (torch's fake backend stands in for any world size).

    Args:
        model: a plain model (not laid out yet); its parameters may be on the meta device.
        example_batch: one step's whole batch: a tensor, or a tuple (positional) or dict (keyword arguments).
        world: the number of ranks, or a placement whose shape is then the mesh (axis 0 data, axis 1 tensor).
        costs: the machine's constants (``H100``, ``A100``, ``CPU_GLOO``, or ``calibrate()``'s).
        optimizer: its class or name, for the state it keeps (``"AdamW"``: two tensors per parameter).
        loss: ``output -> scalar`` when the model's output is not the loss and has no ``.loss``.
        exhaustive_limit: a unit with more option combinations than this is searched by coordinate descent.
        device: the device type the plan's placement will have (tracing itself runs on meta parts).
        progress: report meshes and traces on stderr as the search goes; None: where stderr is a terminal (on
            rank 0 of a process group).
        measure: inside a process group of ``world`` ranks, time the ``measure`` layouts predicted fastest for a few
            real steps (eager, on copies of ``model``, with ``example_batch``) and take the fastest measured; the
            plan and its ``alternatives`` record the measured times. 0: take the fastest predicted.
        compiled: price the step as ``compile_step`` runs it (no host time per op) rather than eager; the plan
            records which (``Plan.step``).

    A layout that runs the whole step on every rank of its tensor axis (nothing split over it) is never taken
    while another fits: the same step without that axis does the same work on more data per rank.

    Raises ``PlanError`` when no layout fits. Inside a process group every rank must call it; the plan is
    rank 0's, the same on every rank."""
    started = time.perf_counter()
    step = "compiled" if compiled else "eager"
    costs = costs.for_step(compiled)
    budget = costs.memory_per_rank if memory_per_rank is None else float(memory_per_rank)
    states = optimizer_states(optimizer)
    if any(isinstance(p, GlobalTensor) for p in model.parameters()):
        raise ValueError("plan takes a model that is not laid out yet: plan first, then model.to_global(plan)")
    if measure and compiled:
        raise ValueError(f"plan(measure={measure}) times eager steps: plan with compiled=False to measure")
    if measure and not (dist.is_initialized() and dist.get_world_size() == _world_size(world)):
        raise ValueError(
            f"plan(measure={measure}) times real steps: call it on every rank of a process group of "
            f"{_world_size(world)} ranks"
        )
    if measure and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"plan(measure={measure}) times real steps: the model's parameters must hold data, not meta")
    if isinstance(world, Placement):
        size = math.prod(world.shape)
        if world.ndim == 2:  # (its shape, data over tensor, even where an axis has one rank)
            meshes = [Mesh(tuple(world.shape), 0, 1)]
        else:
            meshes = [m for m in meshes_for(size) if len(m.shape) == world.ndim]
    else:
        size, meshes = int(world), meshes_for(int(world))
    rows = [t.shape[0] for t in torch.utils._pytree.tree_flatten(example_batch)[0] if isinstance(t, torch.Tensor)]
    candidates, smallest, traces, methods = [], None, 0, set()
    reporter = Progress(len(meshes), progress)
    with planning_world(size), contextlib.closing(reporter), expert_regions(model):
        groups = None
        for mesh in meshes:
            reporter.mesh(describe_mesh(mesh.shape, mesh.data_axis, mesh.tensor_axis, False))
            tracer = Tracer(model, example_batch, mesh, loss)
            tracer.run_model({}, record=True)  # records the units' inputs and which modules share one
            reporter.traced()
            if groups is None:
                groups = groups_of(model, tracer.module_inputs)
            option_costs = OptionCosts(tracer, groups, costs, states, on_trace=reporter.traced)
            tables, searched = _tables(option_costs, exhaustive_limit, recompute=not compiled)
            methods.update(searched["methods"])
            traces += searched["traces"] + 1
            n_units = sum(len(g.units) for g in groups[1:])
            for sharded in (False, True) if mesh.data_axis is not None and mesh.shape[mesh.data_axis] > 1 else (False,):
                picks = _choose(tables, budget, costs, sharded)
                minimum = _assemble(
                    tables, [min(t, key=lambda o: t[o][sharded].memory_bytes()) for t in tables], sharded
                )
                if smallest is None or minimum.memory_bytes() < smallest[0].memory_bytes():
                    smallest = (minimum, describe_mesh(mesh.shape, mesh.data_axis, mesh.tensor_axis, sharded))
                if picks is None:
                    continue
                est = _assemble(tables, picks, sharded)
                est = est + step_estimate(costs, tracer.placement, mesh.data_axis, sharded, n_units + 1, est.reduced)
                choice = {index: option for index, (option, _) in enumerate(picks)}
                recomputed = tuple(index for index, (_, again) in enumerate(picks) if again)
                candidates.append(_Candidate(est, mesh, sharded, choice, tracer, recomputed))
            reporter.mesh_done()
    plans, failure = [], None
    if candidates:
        ranked = sorted(candidates, key=lambda c: (c.replicated(), c.est.step_s(costs)))
        if not ranked[0].replicated():
            ranked = [c for c in ranked if not c.replicated()]
        search = {
            "batch rows": rows[0] if rows else None,
            "traces": traces,
            "method": ", ".join(sorted(methods)) or "exhaustive",
            "seconds": 0.0,
        }
        alternatives = sorted((c.summary(costs) for c in candidates), key=lambda a: a["step_s"])
        plans = [c.plan(model, groups, size, costs, device, search, alternatives) for c in ranked[: max(measure, 1)]]
        for p in plans:
            p.step = step
    else:
        est, label = smallest
        term, nbytes = max(est.memory.items(), key=lambda kv: kv[1])
        failure = (
            f"no layout fits {budget / 2**20:.1f} MiB per rank: the smallest found needs "
            f"{est.memory_bytes() / 2**20:.1f} MiB ({label}), most of it {term} ({nbytes / 2**20:.1f} MiB)"
        )
    # In a real group every rank applies, and measures, rank 0's plans, or raises rank 0's failure: a rank traces its
    # own parts, so where splits are uneven the ranks' estimates, and whether a layout fits, may differ.
    plans, failure = _rank_0s(plans, failure)
    if failure is not None:
        raise PlanError(failure)
    found = plans[0]
    if measure:
        measured = {p.mesh_label: step_seconds(model, example_batch, p, optimizer, loss) for p in plans}
        found = min(plans, key=lambda p: measured[p.mesh_label])
        found.measured_s = measured[found.mesh_label]
        for alternative in found.alternatives:
            alternative["measured_s"] = measured.get(alternative["label"])
        found.search["measured"] = len(plans)
    found.search["seconds"] = round(time.perf_counter() - started, 2)
    return _rank_0s([found])[0][0]


def _rank_0s(plans: list[Plan], failure: str | None = None) -> tuple[list[Plan], str | None]:
    """Rank 0's plans and failure on every rank of a process group (as they are outside one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return plans, failure
    shared = [([p.to_json() for p in plans], failure)]
    dist.broadcast_object_list(shared, src=0)
    texts, failure = shared[0]
    return [Plan.from_json(text) for text in texts], failure


def _world_size(world) -> int:
    return math.prod(world.shape) if isinstance(world, Placement) else int(world)


class _Candidate(NamedTuple):
    """The best choice found for one mesh and storage."""

    est: Estimate
    mesh: Mesh
    sharded: bool
    choice: dict  # group index -> the option of each of its decisions
    tracer: Tracer
    recomputed: tuple = ()  # indices of the unit containers whose units are recomputed in backward

    def label(self) -> str:
        return describe_mesh(self.mesh.shape, self.mesh.data_axis, self.mesh.tensor_axis, self.sharded)

    def replicated(self) -> bool:
        """Whether every rank of the tensor axis runs the whole step (nothing split over it)."""
        axis = self.mesh.tensor_axis
        if axis is None or self.mesh.shape[axis] == 1:
            return False
        return all(option == "replicate" for options in self.choice.values() for option in options)

    def summary(self, costs: CostModel) -> dict:
        summary = {"label": self.label(), "step_s": self.est.step_s(costs), "memory_bytes": self.est.memory_bytes()}
        if self.replicated():
            summary["replicated"] = True
        if self.recomputed:
            summary["recomputed"] = True
        return summary

    def plan(self, model, groups, size, costs, device, search, alternatives) -> Plan:
        layouts = parameter_layouts(model, groups, self.choice)
        names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        return Plan(
            world_size=size,
            mesh=self.mesh.shape,
            data_axis=self.mesh.data_axis,
            tensor_axis=self.mesh.tensor_axis,
            sharded=self.sharded,
            parameters={name: sbp_text(self.tracer.sbp(layouts.get(name, broadcast))) for name in names},
            boundaries={g.pattern(): sbp_text(self.tracer.boundary) for g in groups[1:]},
            recompute=[groups[index].pattern() for index in self.recomputed],
            decisions={
                g.pattern(): {d.label: option for d, option in zip(g.decisions, self.choice[i])}
                for i, g in enumerate(groups)
            },
            predicted=Prediction.of(self.est, costs),
            cost_model=costs.name,
            device=device,
            search=dict(search),
            alternatives=[dict(a) for a in alternatives],
        )


def _tables(option_costs: OptionCosts, limit: int, recompute: bool) -> tuple[list[dict], dict]:
    """Per group (the root first) (option, recomputed) -> estimates by storage, for one mesh; and how the search
    went. ``recompute``: offer each unit container recomputed (not for a compiled step, whose trace of a
    checkpointed unit is not checked)."""
    groups, methods = option_costs.groups, set()
    tables: list[dict] = [{}]
    units_base = Estimate()  # the traced part of each container's first unit at "replicate": in the cut step
    for index in range(1, len(groups)):
        table, method = _search_group(option_costs, index, limit, lambda c, i=index: option_costs.unit_option(i, c))
        methods.add(method)
        # each option as it is and with the container's units recomputed in backward (priced from the same traces)
        tables.append(
            {
                (c, again): table[c] if not again else option_costs.recomputed[index, c]
                for c in table
                for again in ((False, True) if recompute else (False,))
            }
        )
        units_base = units_base + option_costs.traced[index, option_costs.replicate(groups[index])]
    root, method = _search_group(option_costs, 0, limit, lambda c: option_costs.root_option(c, units_base))
    tables[0] = {(c, False): estimates for c, estimates in root.items()}  # (the root is no unit: never recomputed)
    methods.add(method)
    return tables, {"methods": methods, "traces": option_costs.traces}


def _assemble(tables: list[dict], picks: list, sharded: bool) -> Estimate:
    total = Estimate()
    for table, pick in zip(tables, picks):
        total = total + table[pick][sharded]
    return total


def _search_group(option_costs: OptionCosts, index: int, limit: int, evaluate) -> tuple[dict, str]:
    """Option -> estimates by storage (``evaluate(option)``), for every option evaluated; and how the options
    were searched: all of them up to ``limit``, else coordinate descent."""
    group, costs = option_costs.groups[index], option_costs.costs
    combos = group.combinations() if option_costs.mesh.tensor_axis is not None else [option_costs.replicate(group)]
    if len(combos) <= limit:
        return {c: evaluate(c) for c in combos}, "exhaustive"
    found: dict = {}
    alternating = tuple(
        ("column", "row")[i % 2] if "column" in d.options else "replicate" for i, d in enumerate(group.decisions)
    )
    for seed in (option_costs.replicate(group), alternating):  # columns feeding rows: the pairing that needs least
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


def _choose(tables: list[dict], budget: float, costs: CostModel, sharded: bool):
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
