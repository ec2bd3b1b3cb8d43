"""A call plan: a decision compiled for one call key (where the global tensors sit among the arguments, the boxing plan
of each, what to return), which a repeated call runs without binding, searching or planning. In-place and ``out=`` ops
return the tensors they wrote; ranks outside the placement run no op: they return empty parts."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _comm as comm
from .._boxing import box_local, plan_boxing, run_plan
from .._layout import GlobalMeta
from .._signatures import LocalContext
from .._tensor import GlobalTensor, wrap_fresh
from ._bound import BoundCall, at, by_name, substitute
from ._decide import Decision
from ._schema import op_schema


@dataclass(frozen=True)
class CallPlan:
    func: object
    decision: Decision
    placement: object
    slots: tuple  # the slot of each global argument (``_bound.py``)
    plans: tuple  # per slot: the BoxingPlan to run, or None (already laid out, or an out= tensor)
    written: tuple  # slot numbers of the tensors the op writes into
    returns_written: bool
    coord: tuple | None  # this rank's coordinate; None outside the placement
    local_shapes: tuple  # this rank's part shape of each output
    local_inputs: tuple  # GlobalMeta of each input in its decided layout (what a local function is told)
    reduce_along: Callable  # (tensor, op, axis) -> tensor all-reduced along that placement axis, for local functions
    # Whether the op runs on the local parts unchanged: no boxing, no local function, a member rank.
    as_is: bool
    # The local function reshapes the one global input's part, the first argument, unboxed, to the output's local
    # shape (views): ``_run`` calls it; the C hit path runs ``part.reshape(local shape)`` itself.
    reshapes_part: bool
    # The op runs on the unboxed parts of a member rank, its local function telling it only the output's local sizes
    # (``sizes_only`` local functions: a view's reshape, ``expand``, ``new_zeros``); what plain units rely on.
    sizes_only: bool
    # The op runs on the parts as they are (``as_is``), its global arguments all positional (lists included) and
    # none written: ``_run`` runs it; the C hit path runs it itself, whatever it returns.
    runs_as_is: bool
    # The common case, run by ``_run_simple``: globals only as positional arguments, none boxed, no local
    # function, a member rank, and one new output or the written self returned.
    simple: bool

    def run(self, func, args, kwargs):
        return _run_simple(self, func, args, kwargs) if self.simple else _run(self, func, args, kwargs)


def compile_plan(bound: BoundCall, decision: Decision) -> CallPlan:
    plans, local_inputs = [], []
    targets = iter(decision.input_sbps)
    outs = set(bound.outs)
    for k, g in enumerate(bound.tensors):
        if k in outs:
            plans.append(None)  # written in its own layout
            continue
        target = next(targets)
        plan = plan_boxing(g._meta, target)
        plans.append(plan if plan.steps else None)
        local_inputs.append(g._meta.with_sbp(target))
    placement = bound.placement
    coord = placement.local_coord()
    func, slots, written = bound.func, bound.slots, bound.written
    returns_written = bound.schema.returns_written
    # the op on this member rank's parts, none boxed, no local function
    unboxed = coord is not None and decision.local_fn is None and all(p is None for p in plans)
    simple = (
        unboxed
        and all(index is None and not isinstance(where, str) for where, index in slots)
        and (
            (returns_written and written == (0,) and slots[0] == (0, None))
            or (not written and bound.schema.returns_one_tensor)
        )
    )
    local_fn = decision.rule.local_fns.get(decision.local_fn) if decision.local_fn else None
    reshapes_part = (
        coord is not None
        and getattr(local_fn, "reshapes_part", False)
        and decision.rule.outside is None
        and slots == ((0, None),)
        and plans == [None]
        and not written
        and len(decision.outputs) == 1
    )
    as_is = unboxed and decision.rule.outside is None
    sizes_only = (
        coord is not None
        and getattr(local_fn, "sizes_only", False)
        and decision.rule.outside is None
        and all(p is None for p in plans)
    )
    runs_as_is = as_is and not written and not any(isinstance(where, str) for where, _ in slots)
    return CallPlan(
        func,
        decision,
        placement,
        slots,
        tuple(plans),
        written,
        returns_written,
        coord,
        tuple(m.local_shape(coord) for m in decision.outputs),
        tuple(local_inputs),
        lambda x, op, axis: comm.all_reduce(x, op, comm.axis_group(placement, axis)),
        as_is,
        reshapes_part,
        sizes_only,
        runs_as_is,
        simple,
    )


def _run_simple(plan: CallPlan, func, args, kwargs):
    """``_run`` for a simple plan: no boxing, no local function, positional globals, one result."""
    try:
        out = func(*[a._local if isinstance(a, GlobalTensor) else a for a in args], **kwargs)
    except Exception as err:  # the others went on: closes this rank's world (docs/faults.md)
        comm.local_failure(func, err, plan.placement, plan.local_inputs)
        raise
    return (
        args[0] if plan.returns_written else checked_global(func, out, plan.decision.outputs[0], plan.local_shapes[0])
    )


def _context(plan: CallPlan, func, local_args, local_kwargs) -> LocalContext:
    decision = plan.decision
    return LocalContext(
        plan.placement,
        plan.coord,
        plan.local_inputs,
        decision.outputs,
        decision.local_axes,
        by_name(op_schema(func), local_args, local_kwargs),
        plan.reduce_along,
        box_local,
    )


def signature_text(decision: Decision) -> str:
    """``decision``'s signature as ``explain`` shows it: ``(input SBPs, ...) -> (output SBPs, ...)``."""
    inputs = ", ".join("".join(map(repr, sbp)) for sbp in decision.input_sbps)
    outputs = ", ".join("".join(map(repr, meta.sbp)) for meta in decision.outputs)
    return f"({inputs}) -> ({outputs})"


@comm.naming_cause(lambda plan, func, *_: f"{func} as {signature_text(plan.decision)}")
def _run(plan: CallPlan, func, args, kwargs):
    """Box, run the op (or the signature's local function) on the local parts, wrap the results."""
    decision = plan.decision
    tensors = [at(args, kwargs, slot) for slot in plan.slots]
    parts = [g._local if boxing is None else run_plan(g._local, boxing) for g, boxing in zip(tensors, plan.plans)]
    local_args, local_kwargs = substitute(args, kwargs, plan.slots, parts)
    written = [tensors[i] for i in plan.written]
    if plan.coord is None:
        if decision.rule.outside is not None:
            decision.rule.outside(func, _context(plan, func, local_args, local_kwargs))
        if written and plan.returns_written:
            return written[0] if len(written) == 1 else tuple(written)
        device = tensors[0]._local.device
        outs = [GlobalTensor(torch.empty(0, dtype=m.dtype, device=device), m) for m in decision.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)
    try:
        if decision.local_fn is None:
            out = func(*local_args, **local_kwargs)
        else:
            out = decision.rule.local_fns[decision.local_fn](func, _context(plan, func, local_args, local_kwargs))
    except Exception as err:
        comm.local_failure(func, err, plan.placement, None if decision.local_fn else plan.local_inputs)
        raise
    if written and plan.returns_written:
        return written[0] if len(written) == 1 else tuple(written)
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return checked_global(func, out, decision.outputs[0], plan.local_shapes[0])
    results, k = [], 0
    for o in out:
        if isinstance(o, torch.Tensor):
            results.append(checked_global(func, o, decision.outputs[k], plan.local_shapes[k]))
            k += 1
        else:
            results.append(o)
    return type(out)(results) if isinstance(out, tuple) else results


def checked_global(func, local: torch.Tensor, meta: GlobalMeta, shape: tuple) -> GlobalTensor:
    """``local`` wrapped as a part of ``meta``, after checking that it has the shape the layout says."""
    if local.shape != shape:
        raise RuntimeError(
            f"sbp_torch internal error: {func} gave a local part of shape {tuple(local.shape)} where the layout "
            f"{meta} needs {shape}"
        )
    if local.is_conj() or local.is_neg():
        return GlobalTensor(local, meta)
    return wrap_fresh(local, meta)
