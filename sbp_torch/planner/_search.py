"""``plan``: find the layout of a model's training step with the least predicted step time that fits a
memory limit, before anything runs (docs/planning.md).

For each mesh (every way to split the world into data x tensor ranks) the step is traced once with the
root's and the units' tensor-parallel decisions at ``replicate``, then each unit's options alone, from the
inputs that trace recorded, and each of the root's options; the estimates add up because the hidden state
is pinned to one layout at every unit's edges (``_pins.py``). The choice of one option per decision group,
under the memory limit, is then an integer program, solved exactly (``scipy.optimize.milp``)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from .. import _comm as comm
from .._api._global_mode import GlobalMode
from .._layout import GlobalMeta, Placement, Split, broadcast
from .._tensor import GlobalTensor
from ._costs import CPU_GLOO, CostModel
from ._estimate import OPTIMIZER_STATES, Estimate, from_trace, latency_estimate, parameters_estimate
from ._pins import BoundaryPin
from ._plan import Plan, Prediction, describe_mesh, sbp_text
from ._structure import Group, groups_of, options_of, parameter_layouts, unit_containers
from ._trace import measure, meta_global


class PlanError(ValueError):
    """No layout fits: the message names the smallest memory found and what dominates it."""


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    data_axis: int | None
    tensor_axis: int | None


def meshes_for(world: int) -> list[Mesh]:
    """Data parallel, tensor parallel, and every data x tensor grid of ``world`` ranks."""
    if world == 1:
        return [Mesh((1,), 0, None)]
    found = [Mesh((world,), 0, None), Mesh((world,), None, 0)]
    return found + [Mesh((d, world // d), 0, 1) for d in range(2, world) if world % d == 0]


@contextlib.contextmanager
def planning_world(world: int):
    """A process group of ``world`` ranks to trace in: the default one when it has that size, else torch's fake
    backend (one process standing for rank 0 of any world), taken down afterwards."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ValueError(
                f"planning for {world} ranks inside a process group of {dist.get_world_size()}: plan for the "
                "group's size, or plan in a process without a process group"
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _optimizer_states(optimizer) -> int:
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)
    for known, states in OPTIMIZER_STATES.items():
        if known.lower() == str(name).lower():
            return states
    raise ValueError(f"unknown optimizer {name!r}: one of {sorted(OPTIMIZER_STATES)}")


def _loss_of(output, loss):
    if loss is not None:
        return loss(output)
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    raise TypeError(f"the model returned {type(output).__name__}: pass loss=<output -> scalar tensor> to plan")


def _detached(a):
    if isinstance(a, GlobalTensor):
        return a.detach().requires_grad_(a.requires_grad)
    return a


class _Tracer:
    """Traces pieces of one model's step on one mesh; parameters get their layouts per run."""

    def __init__(self, model, batch, mesh: Mesh, loss):
        self.model, self.batch, self.mesh, self.loss = model, batch, mesh, loss
        ranks = np.arange(math.prod(mesh.shape)).reshape(mesh.shape).tolist()
        self.placement = Placement("cpu", ranks)
        comm.ensure_groups(self.placement)
        self.boundary = tuple(Split(0) if a == mesh.data_axis else broadcast for a in range(len(mesh.shape)))
        self.containers = unit_containers(model)
        self.modules = dict(model.named_modules())  # (taken before any truncation)
        self.unit_args: dict[str, tuple] = {}
        self.module_inputs: dict[str, int] = {}
        self.metas: dict[str, GlobalMeta] = {}  # parameter name -> compute meta of the last run

    def sbp(self, tensor_sbp) -> tuple:
        return tuple(tensor_sbp if a == self.mesh.tensor_axis else broadcast for a in range(len(self.mesh.shape)))

    def batch_globals(self):
        def one(x):
            if not isinstance(x, torch.Tensor):
                return x
            sbp = tuple(
                Split(0) if a == self.mesh.data_axis and x.dim() > 0 else broadcast for a in range(len(self.mesh.shape))
            )
            return meta_global(GlobalMeta(tuple(x.shape), x.dtype, self.placement, sbp))

        return tree_map(one, self.batch)

    @contextlib.contextmanager
    def swapped(self, scope: nn.Module, layouts: dict[str, object], prefix: str):
        """``scope``'s parameters and buffers replaced by fake global ones (parameters by ``layouts``, full
        names; everything else broadcast) for the block; yields the fake parameters by name."""
        fakes: dict[int, GlobalTensor] = {}
        named: dict[str, GlobalTensor] = {}
        saved = []
        for sub_name, sub in scope.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                table = getattr(sub, kind)
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    full = ".".join(filter(None, (prefix, sub_name, name)))
                    if id(t) not in fakes:
                        sbp = self.sbp(layouts.get(full, broadcast)) if kind == "_parameters" else self.sbp(broadcast)
                        meta = GlobalMeta(tuple(t.shape), t.dtype, self.placement, sbp)
                        fakes[id(t)] = meta_global(meta, requires_grad=t.requires_grad)
                        if kind == "_parameters":
                            self.metas[full] = meta
                            named[full] = fakes[id(t)]
                    saved.append((table, name, t))
                    table[name] = fakes[id(t)]
        try:
            yield named
        finally:
            for table, name, t in saved:
                table[name] = t

    @contextlib.contextmanager
    def truncated(self, keep: int = 2):
        """Each unit container holds only its first ``keep`` units for the block."""
        modules = self.modules
        kept = []
        for container in self.containers:
            holder = modules[container]
            kept.append((holder, holder._modules))
            holder._modules = type(holder._modules)(list(holder._modules.items())[:keep])
        try:
            yield
        finally:
            for holder, original in kept:
                holder._modules = original

    @contextlib.contextmanager
    def hooks(self, record: bool):
        modules = self.modules
        handles = []
        for units in self.containers.values():
            for unit in units[:2]:
                pin = BoundaryPin.install(modules[unit], self.boundary)
                handles += [pin]
                if record:
                    handles.append(modules[unit].register_forward_pre_hook(self._recorder(unit), with_kwargs=True))
        keep_alive = []
        if record:
            for name, module in modules.items():
                if options_of(module) is not None:
                    handles.append(module.register_forward_pre_hook(self._input_recorder(name, keep_alive)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _recorder(self, unit):
        def record(module, args, kwargs):
            self.unit_args[unit] = tree_map(_detached, (args, kwargs))

        return record

    def _input_recorder(self, name, keep_alive):
        def record(module, args):
            if args and isinstance(args[0], torch.Tensor):
                keep_alive.append(args[0])  # ids stay unique while the pass runs
                self.module_inputs[name] = id(args[0])

        return record

    def run_model(self, layouts: dict, record: bool = False, keep: int = 2):
        """The step with the units cut to ``keep`` per container: (measured, fake parameters by name)."""
        with self.truncated(keep), self.hooks(record), self.swapped(self.model, layouts, "") as params:

            def step():
                with GlobalMode(self.placement, broadcast):
                    batch = self.batch_globals()
                    if isinstance(batch, dict):
                        output = self.model(**batch)
                    elif isinstance(batch, (tuple, list)):
                        output = self.model(*batch)
                    else:
                        output = self.model(batch)
                    return _loss_of(output, self.loss)

            measured, _ = measure(step, list(params.values()))
        return measured, params

    def alike(self, first: str, second: str) -> bool:
        """Whether two units have the same parameters and were called with inputs of the same layouts."""
        modules = self.modules

        def signature(unit):
            params = [(n, tuple(p.shape)) for n, p in modules[unit].named_parameters()]
            inputs = tree_map(lambda a: a._meta if isinstance(a, GlobalTensor) else type(a), self.unit_args[unit])
            return params, inputs

        return signature(first) == signature(second)

    def run_unit(self, unit: str, layouts: dict):
        """One unit alone, from the inputs the recording run gave it, its hidden state pinned at both edges."""
        module = self.modules[unit]
        args, kwargs = self.unit_args[unit]
        args, kwargs = tree_map(_detached, (args, kwargs))
        pin = BoundaryPin.install(module, self.boundary)
        try:
            with self.swapped(module, layouts, unit) as params:

                def forward():
                    with GlobalMode(self.placement, broadcast):
                        return module(*args, **kwargs)

                measured, _ = measure(forward, list(params.values()))
        finally:
            pin.remove()
        return measured, params


def _pairs(params: dict, measured, metas) -> list:
    return [(metas[name], measured.grads.get(id(p))) for name, p in params.items()]


class _Costing:
    """Estimates per decision group and option on one mesh, for replicated and sharded storage."""

    def __init__(self, tracer: _Tracer, groups: list[Group], costs: CostModel, states: int):
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
            results[sharded] = total
        return results

    def root_option(self, option: tuple, units_base: Estimate) -> dict[bool, Estimate]:
        layouts = self.layouts({0: option})
        measured, params = self.tracer.run_model(layouts, keep=1)
        self.traces += 1
        root_params = {k: v for k, v in params.items() if not _in_containers(k, self.tracer.containers)}
        trace_est = from_trace(measured, self.costs) - units_base
        pairs = _pairs(root_params, measured, self.tracer.metas)
        return {s: trace_est + self.params_estimate(pairs, s, kept=True) for s in (False, True)}


def _in_containers(name: str, containers: dict) -> bool:
    return any(name.startswith(c + ".") for c in containers)


def _search_group(costing: _Costing, index: int, limit: int, costs: CostModel) -> tuple[dict, str]:
    """Option -> estimates by storage, for every option evaluated; and how the options were searched."""
    group = costing.groups[index]
    combos = group.combinations() if costing.mesh.tensor_axis is not None else [costing.replicate(group)]
    if len(combos) <= limit:
        return {c: costing.unit_option(index, c) for c in combos}, "exhaustive"
    found: dict = {}
    alternating = tuple(
        ("column", "row")[i % 2] if "column" in d.options else "replicate" for i, d in enumerate(group.decisions)
    )
    for seed in (costing.replicate(group), alternating):  # columns feeding rows: the pairing that needs least
        found[seed] = costing.unit_option(index, seed)
    current = min(found, key=lambda c: found[c][False].step_s(costs))
    improved = True
    while improved:  # coordinate descent on the replicated step time
        improved = False
        for i, decision in enumerate(group.decisions):
            for option in decision.options:
                candidate = current[:i] + (option,) + current[i + 1 :]
                if candidate not in found:
                    found[candidate] = costing.unit_option(index, candidate)
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
    from scipy.optimize import Bounds, LinearConstraint, milp

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
) -> Plan:
    """The layout of ``model``'s training step on ``world`` ranks with the least predicted step time that fits
    ``memory_per_rank`` bytes (default: the cost model's), found by tracing on fake tensors: no data moves and
    no process group is needed (torch's fake backend stands in for any world size).

    Args:
        model: a plain model (not laid out yet); its parameters may be on the meta device.
        example_batch: one step's whole batch: a tensor, or a tuple (positional) or dict (keyword arguments).
        world: the number of ranks, or a placement whose shape is then the mesh (axis 0 data, axis 1 tensor).
        costs: the machine's constants (``H100``, ``A100``, ``CPU_GLOO``, or ``calibrate()``'s).
        optimizer: its class or name, for the state it keeps (``"AdamW"``: two tensors per parameter).
        loss: ``output -> scalar`` when the model's output is not the loss and has no ``.loss``.
        exhaustive_limit: a unit with more option combinations than this is searched by coordinate descent.
        device: the device type the plan's placement will have (tracing itself runs on fake CPU parts).

    Raises ``PlanError`` when no layout fits. Inside a process group every rank must call it; the plan is
    rank 0's, the same on every rank."""
    started = time.perf_counter()
    budget = costs.memory_per_rank if memory_per_rank is None else float(memory_per_rank)
    states = _optimizer_states(optimizer)
    if any(isinstance(p, GlobalTensor) for p in model.parameters()):
        raise ValueError("plan takes a model that is not laid out yet: plan first, then model.to_global(plan)")
    if isinstance(world, Placement):
        size = math.prod(world.shape)
        meshes = [m for m in meshes_for(size) if m.shape == tuple(world.shape)] if world.ndim == 2 else None
        meshes = meshes or [m for m in meshes_for(size) if len(m.shape) == world.ndim]
    else:
        size, meshes = int(world), meshes_for(int(world))
    rows = [t.shape[0] for t in torch.utils._pytree.tree_flatten(example_batch)[0] if isinstance(t, torch.Tensor)]
    best, alternatives, smallest, traces, methods = None, [], None, 0, set()
    with planning_world(size):
        groups = None
        for mesh in meshes:
            tracer = _Tracer(model, example_batch, mesh, loss)
            base, _ = tracer.run_model({}, record=True)
            if groups is None:
                groups = groups_of(model, tracer.module_inputs)
            costing = _Costing(tracer, groups, costs, states)
            tables: list[dict] = [{}]
            units_base = Estimate()
            for index in range(1, len(groups)):
                table, method = _search_group(costing, index, exhaustive_limit, costs)
                methods.add(method)
                tables.append(table)
                units_base = units_base + costing.traced[index, costing.replicate(groups[index])]
            root_combos = groups[0].combinations() if mesh.tensor_axis is not None else [costing.replicate(groups[0])]
            for combo in root_combos:
                tables[0][combo] = costing.root_option(combo, units_base)
            traces += costing.traces + 1
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
                grad_bytes = est.memory.get("gradients", 0)
                est = est + latency_estimate(costs, tracer.placement, mesh.data_axis, sharded, n_units + 1, grad_bytes)
                label = describe_mesh(mesh.shape, mesh.data_axis, mesh.tensor_axis, sharded)
                alternatives.append({"label": label, "step_s": est.step_s(costs), "memory_bytes": est.memory_bytes()})
                if best is None or est.step_s(costs) < best[0].step_s(costs):
                    best = (est, mesh, sharded, dict(enumerate(picks)), tracer)
    if best is None:
        est, label = smallest
        term, nbytes = max(est.memory.items(), key=lambda kv: kv[1])
        raise PlanError(
            f"no layout fits {budget / 2**20:.1f} MiB per rank: the smallest found needs "
            f"{est.memory_bytes() / 2**20:.1f} MiB ({label}), most of it {term} ({nbytes / 2**20:.1f} MiB)"
        )
    est, mesh, sharded, choice, tracer = best
    layouts = parameter_layouts(model, groups, choice)
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    found = Plan(
        world_size=size,
        mesh=mesh.shape,
        data_axis=mesh.data_axis,
        tensor_axis=mesh.tensor_axis,
        sharded=sharded,
        parameters={name: sbp_text(tracer.sbp(layouts.get(name, broadcast))) for name in names},
        boundaries={g.pattern(): sbp_text(tracer.boundary) for g in groups[1:]},
        predicted=Prediction(
            est.step_s(costs),
            est.compute_s,
            est.comm_s,
            est.param_comm_s,
            est.optimizer_s,
            {k: float(v) for k, v in est.memory.items()},
            {k: float(v) for k, v in est.collectives.items() if v},
        ),
        cost_model=costs.name,
        device=device,
        search={
            "batch rows": rows[0] if rows else None,
            "traces": traces,
            "method": ", ".join(sorted(methods)) or "exhaustive",
            "seconds": round(time.perf_counter() - started, 2),
        },
        alternatives=sorted(alternatives, key=lambda a: a["step_s"]),
    )
    if dist.is_initialized() and dist.get_world_size() > 1:  # a real group: every rank applies rank 0's plan
        shared = [found.to_json()]
        dist.broadcast_object_list(shared, src=0)
        found = Plan.from_json(shared[0])
    return found


def _assemble(tables: list[dict], picks: list, sharded: bool) -> Estimate:
    total = Estimate()
    for table, pick in zip(tables, picks):
        total = total + table[pick][sharded]
    return total
