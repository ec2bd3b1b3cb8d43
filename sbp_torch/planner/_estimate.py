"""From what a traced piece did to what it costs: seconds, bytes of memory, collectives (docs/planning.md).

``Estimate`` is additive: the step's estimate is the root's plus each unit's times the number of units like
it. Parameter traffic (gradient reductions, sharded gathers) and the optimizer are priced from the
parameters' layouts, as ``Module.to_global`` will run them; the trace prices everything else."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .._api._sharding import storage_sbp
from .._boxing import plan_boxing
from .._layout import GlobalMeta
from ._cost_model import CostModel
from ._counting import Measured

# Optimizer class name -> state tensors it keeps per parameter, each as large as the parameter.
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "SGD": 1, "Adagrad": 1, "RMSprop": 1, "Adafactor": 1, "none": 0}
OPTIMIZER_PASSES = 12  # elementwise passes over parameter-sized tensors one AdamW step makes (reads and writes)
BUCKET_BYTES = 25 * 2**20  # Module.to_global's gradient bucket


class GradientBuckets(NamedTuple):
    """What ``Module.to_global``'s reducer buckets gradients by: one collective on one placement axis (-1: every
    axis at once, a point-to-point step) from one layout."""

    axis: int
    collective: str
    layout: tuple


@dataclass
class Estimate:
    """Seconds and bytes on one rank, summed over pieces of a step."""

    compute_s: float = 0.0
    comm_s: float = 0.0  # activation collectives: on the critical path
    param_comm_s: float = 0.0  # gradient reductions and sharded gathers: beside compute
    optimizer_s: float = 0.0
    memory: dict = field(default_factory=dict)  # term -> bytes
    collectives: dict = field(default_factory=dict)  # kind -> count per step
    reduced: dict = field(default_factory=dict)  # GradientBuckets -> gradient bytes they move per step

    def __add__(self, other: Estimate) -> Estimate:
        return self.plus(other, 1.0)

    def __sub__(self, other: Estimate) -> Estimate:
        return self.plus(other, -1.0)

    def plus(self, other: Estimate, k: float) -> Estimate:
        """This estimate and ``k`` times ``other``."""
        return Estimate(
            self.compute_s + k * other.compute_s,
            self.comm_s + k * other.comm_s,
            self.param_comm_s + k * other.param_comm_s,
            self.optimizer_s + k * other.optimizer_s,
            _merged(self.memory, other.memory, k),
            _merged(self.collectives, other.collectives, k),
            _merged(self.reduced, other.reduced, k),
        )

    def step_s(self, costs: CostModel) -> float:
        """Predicted seconds per step: compute, activation collectives, the parameter traffic compute does not
        hide, and the optimizer."""
        return self.compute_s + self.comm_s + (1 - costs.overlap) * self.param_comm_s + self.optimizer_s

    def memory_bytes(self) -> float:
        return float(sum(self.memory.values()))


def _merged(a: dict, b: dict, k: float) -> dict:
    return {key: a.get(key, 0) + k * b.get(key, 0) for key in {**a, **b}}


def from_trace(measured: Measured, costs: CostModel) -> Estimate:
    """The estimate of a traced piece: its ops' roofline time, its collectives, its saved activations."""
    memory = {"activations": measured.saved_bytes, "temporaries": max(measured.peak_bytes - measured.saved_bytes, 0)}
    return _priced(measured.ops, measured.collectives, costs, memory)


def recomputed_forward(measured: Measured, costs: CostModel) -> Estimate:
    """What recomputing a traced unit in backward adds to its estimate: its forward's ops and collectives once
    more, and its inputs kept in place of its activations (the activations of the one unit whose backward runs,
    alive again, are the caller's to add: ``OptionCosts.unit_option``'s ``recomputed`` term)."""
    again = [c for c in measured.collectives if not c.backward]
    memory = {"activations": measured.input_bytes - measured.saved_bytes}
    return _priced(measured.ops[: measured.forward_ops], again, costs, memory)


def _priced(ops: list, collectives: list, costs: CostModel, memory: dict) -> Estimate:
    """Ops at their roofline time and collectives at theirs, with ``memory``."""
    compute = sum(costs.op_s(flops, nbytes, dtype) for flops, nbytes, dtype in ops)
    comm = sum(costs.collective_s(c.kind, c.ranks, _bytes(c)) for c in collectives)
    kinds = dict(collections.Counter(c.kind.split(" (")[0] for c in collectives))
    return Estimate(compute, comm, memory=memory, collectives=kinds)


def _bytes(collective) -> int:
    """What a collective puts in; for one whose size depends on values (routing), its size if routing is even."""
    return collective.bytes if collective.bytes is not None else collective.even_estimate or 0


def _local_bytes(meta: GlobalMeta) -> int:
    return math.prod(meta.local_shape(meta.placement.local_coord())) * meta.dtype.itemsize


def _axis_ranks(meta: GlobalMeta, axis: int) -> tuple[int, ...]:
    return meta.placement.axis_ranks(axis, meta.placement.local_coord())


def parameters_estimate(
    params: list[tuple[GlobalMeta, GlobalMeta | None]],
    costs: CostModel,
    *,
    data_axis: int | None,
    sharded: bool,
    optimizer_states: int,
    kept_gathered: bool,
) -> Estimate:
    """Memory and traffic of some parameters: (compute layout, the layout backward left its gradient in).

    Replicated storage: each gradient partial on an axis is all-reduced there (bucketed). Sharded storage on the
    data axis: the parameters are gathered in forward and again in backward (freed between, unless
    ``kept_gathered``, as the root's are), and their gradients reduce-scattered, one collective per unit."""
    est = Estimate(memory=dict.fromkeys(("parameters", "gradients", "optimizer state", "gathered"), 0))
    stored_total = 0
    for compute, grad in params:
        stored = compute
        if sharded and data_axis is not None:
            sbp = storage_sbp("", compute.sbp, data_axis, len(compute.shape))
            stored = compute.with_sbp(sbp) if sbp is not None else compute
        nbytes = _local_bytes(stored)
        stored_total += nbytes
        est.memory["parameters"] += nbytes
        est.memory["gradients"] += nbytes
        est.memory["optimizer state"] += optimizer_states * nbytes
        if stored is not compute:
            est.memory["gathered"] += _local_bytes(compute)
            ranks = _axis_ranks(compute, data_axis)
            gathers = 1 if kept_gathered else 2
            est.param_comm_s += gathers * _bandwidth_s(costs, "all-gather", ranks, nbytes)
            est.param_comm_s += _bandwidth_s(costs, "reduce-scatter", ranks, _local_bytes(compute))
        if grad is not None and tuple(grad.sbp) != tuple(compute.sbp):
            # Module.to_global's reducer boxes each gradient to its parameter's layout, by the boxing planner's
            # steps; a sharded parameter's reduce-scatter over the data axis is counted above
            current = tuple(grad.sbp)
            for step in plan_boxing(grad, tuple(compute.sbp)).steps:
                before = grad.with_sbp(current)
                if step.axis >= 0:
                    current = current[: step.axis] + (step.dst,) + current[step.axis + 1 :]
                else:  # a point-to-point step changes every axis at once
                    current = tuple(step.dst)
                if step.collective.startswith("local") or (stored is not compute and step.axis == data_axis):
                    continue
                ranks = _axis_ranks(compute, step.axis) if step.axis >= 0 else tuple(compute.placement.flat_ranks)
                nbytes = _local_bytes(before)
                est.param_comm_s += _bandwidth_s(costs, step.collective, ranks, nbytes)
                key = GradientBuckets(step.axis, step.collective, tuple(before.sbp))
                est.reduced[key] = est.reduced.get(key, 0) + nbytes
                if step.collective == "all-reduce":  # each bucket reduces a flat copy; all are in flight at once
                    est.memory["gradient buckets"] = est.memory.get("gradient buckets", 0) + nbytes
    est.optimizer_s = OPTIMIZER_PASSES * (stored_total / costs.memory_bandwidth / costs.efficiency)
    if not costs.optimizer_foreach:  # one call per pass and parameter (a foreach step's calls: ``step_estimate``)
        est.optimizer_s += OPTIMIZER_PASSES * len(params) * costs.op_overhead_s
    return est


def _bandwidth_s(costs: CostModel, kind: str, ranks, nbytes: int) -> float:
    """A collective's time without its latency (latencies are counted per bucket or unit, ``step_estimate``)."""
    return costs.collective_s(kind, ranks, nbytes) - costs.latency_s(kind, ranks)


def step_estimate(costs: CostModel, placement, data_axis, sharded: bool, units: int, reduced: dict) -> Estimate:
    """What a step pays per call rather than per byte: the latencies of the parameter collectives, per unit
    when sharded (two gathers, one reduce-scatter) and per gradient bucket for each axis, collective and layout
    in ``reduced``; and a foreach optimizer's calls, one per pass for all parameters."""
    est = Estimate()
    if costs.optimizer_foreach:
        est.optimizer_s = OPTIMIZER_PASSES * costs.op_overhead_s
    coord = placement.local_coord()
    if sharded and data_axis is not None and placement.shape[data_axis] > 1:
        ranks = placement.axis_ranks(data_axis, coord)
        gather, scatter = costs.latency_s("all-gather", ranks), costs.latency_s("reduce-scatter", ranks)
        est.param_comm_s += units * (2 * gather + scatter)
        est.collectives = {"all-gather": 2 * units, "reduce-scatter(sum)": units}
    for (axis, collective, _), nbytes in reduced.items():
        ranks = placement.axis_ranks(axis, coord) if axis >= 0 else placement.flat_ranks
        if nbytes > 0 and len(ranks) > 1:
            buckets = math.ceil(nbytes / BUCKET_BYTES)
            est.param_comm_s += buckets * costs.latency_s(collective, ranks)
            kind = f"{collective}(sum)" if collective in ("all-reduce", "reduce-scatter") else collective
            est.collectives = _merged(est.collectives, {kind: buckets}, 1)
    return est
