"""Dispatch of aten ops on global tensors: check → decide → box → run locally → wrap.

1. ``_check_operands``: one placement for every global input; plain tensors only as 0-dim scalars.
2. ``_select.decide``: the cached or new signature decision (layout of each input, metadata of each output).
3. Each global input is boxed to its decided layout (``box_local``, no-op when it already has it).
4. The op (or the signature's kernel) runs on the local parts; ranks outside the placement skip it.
5. Outputs are wrapped with the decided metadata; in-place and ``out=`` ops return the tensors they wrote.

Ops with no rule, no fitting signature, or no meta kernel take the always-valid route: inputs boxed to
broadcast, op run on full values, broadcast outputs (``_fallback``), with a one-time warning naming the op,
or an error in strict mode.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from ._conversions import box_local
from ._foreach_norm import COALESCED
from . import _global_tensor
from ._global_tensor import GlobalTensor
from ._layout import GlobalMeta
from ._sbp import Broadcast
from ._boxing.plan import plan_boxing
from ._boxing.run import run_plan
from ._schema import argument_name, facts
from ._select import (
    Decision,
    NoSignature,
    argument_key,
    hashable,
    decide,
    global_slots,
    written_globals,
    written_names,
)
from ._signatures.core import KernelContext, bind
from ._signatures.foreach import split_foreach_call

aten = torch.ops.aten
BROADCAST = Broadcast()

# Ops whose result is a Python value (or a property of the full value): they gather quietly.
VALUE_OPS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.is_same_size.default,
}

_strict = [os.environ.get("SBP_TORCH_STRICT", "") not in ("", "0")]
_warned: set = set()


def set_strict(strict: bool) -> None:
    """In strict mode an op that would take the broadcast fallback raises instead (for developers finding
    ops that need a rule). Also set by the environment variable ``SBP_TORCH_STRICT=1``."""
    _strict[0] = bool(strict)


class MixedTensorError(RuntimeError):
    """A global tensor met a plain tensor with dims. (Not a TypeError: torch turns a TypeError raised for
    ``a + b`` into Python's generic "unsupported operand" message, which would hide this one.)"""


def _check_operands(func, flat: list) -> list[GlobalTensor]:
    globals_ = [a for a in flat if isinstance(a, GlobalTensor)]
    first = globals_[0]
    for g in globals_[1:]:
        if g.placement != first.placement:
            raise ValueError(f"{func}: inputs live on different placements: {first.placement} and {g.placement}")
    if not _implicit[0]:
        for a in flat:
            if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor) and a.dim() > 0:
                raise MixedTensorError(
                    f"{func}: cannot mix a global tensor with a plain tensor of shape {tuple(a.shape)}; convert "
                    "it with to_global(placement, sbp) first (0-dim tensors and Python scalars are allowed), or "
                    "run under sbp_torch.implicit_broadcast() if it holds the same values on every rank"
                )
    return globals_


_implicit = [False]


@contextlib.contextmanager
def implicit_broadcast():
    """Within this block a plain tensor meeting a global tensor in an op is taken as that tensor broadcast on
    its placement, like DTensor's ``implicit_replication``. Only for values equal on every rank (index lists,
    masks, constants that torch's own formulas build): nothing checks that, and differing values would give
    silently wrong results. Such a tensor is a constant: it gets no gradient."""
    previous, _implicit[0] = _implicit[0], True
    try:
        yield
    finally:
        _implicit[0] = previous


def _broadcast_plain_tensors(func, args, kwargs, placement):
    """``(args, kwargs)`` with every plain tensor with dims made a broadcast global tensor on ``placement``."""
    member = _is_member(placement)

    def lift(a):
        if not isinstance(a, torch.Tensor) or isinstance(a, GlobalTensor) or a.dim() == 0:
            return a
        if a.requires_grad:
            raise MixedTensorError(f"{func}: a plain tensor that requires grad cannot be broadcast implicitly")
        meta = GlobalMeta(tuple(a.shape), a.dtype, placement, (BROADCAST,) * placement.ndim)
        return GlobalTensor(a if member else a.new_empty(0), meta)

    return tree_map(lift, (args, kwargs))


def _is_member(placement) -> bool:
    return placement.coord_of(dist.get_rank()) is not None


@dataclass(frozen=True)
class CallPlan:
    """A decision compiled for one call shape (one decision-cache key): where the global tensors sit in the
    arguments, the boxing plan of each, and what to return. A repeated call runs it without searching,
    flattening or re-planning anything."""

    decision: Decision
    slots: tuple  # (position or keyword, index in a list or None) of each global argument
    plans: tuple  # per slot: the BoxingPlan to run, or None (already laid out, or an out= tensor)
    written: tuple  # slot numbers of the tensors the op writes into
    returns_written: bool
    member: bool  # this rank is in the placement
    local_shapes: tuple  # this rank's part shape of each output
    kernel_inputs: tuple  # GlobalMeta of each input in its decided layout (what a kernel is told)
    # The common case, run by ``_run_simple``: globals only as positional arguments, none boxed, no
    # kernel, a member rank, and one new output or the written self returned.
    simple: bool = False


def _compile(func, args, kwargs, decision: Decision, placement) -> CallPlan:
    slots = global_slots(args, kwargs)
    f = facts(func)
    outs, written = f.outs, written_names(func, args, kwargs)
    targets = iter(decision.input_sbps)
    plans, kernel_inputs = [], []
    for (where, _), g in slots:
        if argument_name(func, where) in outs:
            plans.append(None)  # written in its own layout
            continue
        target = next(targets)
        plan = plan_boxing(g._meta, target)
        plans.append(plan if plan.steps else None)
        kernel_inputs.append(g._meta.with_sbp(target))
    coord = placement.coord_of(dist.get_rank())
    written_slots = tuple(i for i, ((where, _), _) in enumerate(slots) if argument_name(func, where) in written)
    simple = (
        coord is not None
        and decision.kernel is None
        and all(index is None and not isinstance(where, str) for (where, index), _ in slots)
        and all(p is None for p in plans)
        and (
            (f.returns_written and written_slots == (0,) and slots[0][0] == (0, None))
            or (not written_slots and len(decision.outputs) == 1 and len(func._schema.returns) == 1)
        )
    )
    return CallPlan(
        decision,
        tuple(slot for slot, _ in slots),
        tuple(plans),
        written_slots,
        f.returns_written,
        coord is not None,
        tuple(m.local_shape(coord) for m in decision.outputs),
        tuple(kernel_inputs),
        simple,
    )


def _run_simple(plan: CallPlan, func, args, kwargs):
    """``_run`` for a simple plan: no boxing, no kernel, positional globals, one result."""
    out = func(*[a._local if isinstance(a, GlobalTensor) else a for a in args], **kwargs)
    return args[0] if plan.returns_written else _wrapped(func, out, plan, 0)


def _local_arguments(plan: CallPlan, args, kwargs):
    """The call's arguments with each global tensor replaced by its (boxed) local part, and the globals."""
    local_args, local_kwargs = list(args), dict(kwargs) if kwargs else kwargs
    copied_lists = set()
    globals_ = []
    for (where, index), boxing in zip(plan.slots, plan.plans):
        holder = local_kwargs if isinstance(where, str) else local_args
        if index is None:
            g = holder[where]
            holder[where] = g._local if boxing is None else run_plan(g._local, boxing)
        else:
            if where not in copied_lists:
                holder[where] = list(holder[where])
                copied_lists.add(where)
            g = holder[where][index]
            holder[where][index] = g._local if boxing is None else run_plan(g._local, boxing)
        globals_.append(g)
    return local_args, local_kwargs, globals_


def _run(plan: CallPlan, func, args, kwargs):
    """Box, run the op (or the signature's kernel) on the local parts, wrap the results."""
    decision = plan.decision
    local_args, local_kwargs, globals_ = _local_arguments(plan, args, kwargs)
    written = [globals_[i] for i in plan.written]
    if not plan.member:
        if decision.rule.outside is not None:
            placement = globals_[0].placement
            context = KernelContext(placement, [], list(decision.outputs), decision.kernel_axes)
            decision.rule.outside(func, context, bind(func, args, kwargs))
        if written and plan.returns_written:
            return written[0] if len(written) == 1 else tuple(written)
        outs = [GlobalTensor(torch.empty(0, dtype=m.dtype, device=globals_[0].device), m) for m in decision.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)
    if decision.kernel is None:
        out = func(*local_args, **local_kwargs)
    else:
        context = KernelContext(
            globals_[0].placement,
            list(plan.kernel_inputs),
            list(decision.outputs),
            decision.kernel_axes,
            bind(func, local_args, local_kwargs),
        )
        out = decision.rule.kernels[decision.kernel](func, context, local_args, local_kwargs)
    if written and plan.returns_written:
        return written[0] if len(written) == 1 else tuple(written)
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return _wrapped(func, out, plan, 0)
    results, k = [], 0
    for o in out:
        if isinstance(o, torch.Tensor):
            results.append(_wrapped(func, o, plan, k))
            k += 1
        else:
            results.append(o)
    return type(out)(results) if isinstance(out, tuple) else results


def _wrapped(func, local: torch.Tensor, plan: CallPlan, k: int) -> GlobalTensor:
    """Output ``k`` as a global tensor (see ``_checked_global``)."""
    return _checked_global(func, local, plan.decision.outputs[k], plan.local_shapes[k], plan.decision.signatures)


def _checked_global(func, local: torch.Tensor, meta: GlobalMeta, shape: tuple, signatures) -> GlobalTensor:
    """``local`` wrapped as a part of ``meta``, after checking that it has the shape the layout says."""
    if local.shape != shape:
        raise RuntimeError(
            f"sbp_torch internal error: {func} with signature {signatures} gave a local part of "
            f"shape {tuple(local.shape)} where the layout {meta} needs {shape}"
        )
    return GlobalTensor(local, meta)


def _fallback(func, args, kwargs, globals_: list[GlobalTensor], why: str):
    """Box every input to broadcast, run the op on full values, return broadcast outputs; tensors the op
    writes into get the result boxed back into their own layout."""
    if func not in VALUE_OPS:
        if _strict[0]:
            raise NotImplementedError(f"sbp_torch strict mode: {func} would run on gathered inputs ({why})")
        if func not in _warned:
            _warned.add(func)
            warnings.warn(f"sbp_torch: {func} runs on broadcast (gathered) inputs: {why}", stacklevel=4)
    placement = globals_[0].placement
    replicated = (BROADCAST,) * placement.ndim
    member = _is_member(placement)
    full_values: dict[int, torch.Tensor] = {}

    def full(a):
        if not isinstance(a, GlobalTensor):
            return a
        if id(a) not in full_values:
            if member:  # contiguous, as the global tensor's strides say: as_strided and friends read them
                full_values[id(a)] = box_local(a._local, a._meta, replicated).contiguous()
            else:
                full_values[id(a)] = torch.empty(a.shape, dtype=a.dtype, device="meta")
        return full_values[id(a)]

    out = func(*tree_map(full, args), **tree_map(full, kwargs))
    written = written_globals(func, args, kwargs)
    for g in written:
        if member and full_values[id(g)] is not g._local:
            g._local.copy_(box_local(full_values[id(g)], g._meta.with_sbp(replicated), g.sbp))
    if written and facts(func).returns_written:
        return written[0] if len(written) == 1 else tuple(written)

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        meta = GlobalMeta(tuple(o.shape), o.dtype, placement, replicated)
        return GlobalTensor(o if member else o.new_empty(0, device=globals_[0]._local.device), meta)

    return tree_map(wrap, out)


@dataclass(frozen=True)
class ForeachPlan:
    """A foreach call each of whose indices runs on its local parts as they are (no boxing, no kernel): the
    whole call runs as one local foreach call, as torch's optimizers expect for speed."""

    lists: tuple  # positions of the arguments that are lists of global tensors
    singles: tuple  # positions of the arguments that are one global tensor
    outputs: tuple  # per index, the GlobalMeta of its output (ops that return new tensors)
    local_shapes: tuple


_foreach_plans: dict = {}


def _run_foreach(func, args, kwargs):
    """A foreach op. The first call of a call shape runs index by index, each index deciding its own layout
    (see ``_signatures/foreach.py``); if every index then ran locally, later calls run as one local call.
    Ops in ``COALESCED`` (norms, which reduce across ranks) have their own path for lists of global tensors."""
    coalesced = COALESCED.get(func)
    if coalesced is not None and all(isinstance(t, GlobalTensor) for t in args[0]):
        return coalesced(func, args, kwargs)
    key = argument_key(func, args, kwargs)
    try:
        plan = _foreach_plans.get((func, key))
    except TypeError:
        plan = key = None
    if plan is not None:
        return _run_foreach_plan(plan, func, args, kwargs)
    results, index_plans = [], []
    for one_args, one_kwargs in split_foreach_call(func, args, kwargs):
        has_global = any(isinstance(a, GlobalTensor) for a in tree_flatten((one_args, one_kwargs))[0])
        results.append(_dispatch_one(func, one_args, one_kwargs) if has_global else func(*one_args, **one_kwargs))
        index_plans.append(_cached_plan(func, one_args, one_kwargs) if has_global else None)
    if key is not None and hashable(key) and all(_runs_as_is(p) for p in index_plans):
        outputs = tuple(p.decision.outputs[0] for p in index_plans) if facts(func).returns_tensors else ()
        slots = [slot for slot, _ in global_slots(args, kwargs)]
        if all(not isinstance(where, str) for where, _ in slots):  # globals passed by keyword: stay per index
            lists = tuple(sorted({where for where, index in slots if index is not None}))
            singles = tuple(where for where, index in slots if index is None)
            if all(all(isinstance(t, GlobalTensor) for t in args[where]) for where in lists):
                shapes = tuple(m.local_shape(m.placement.coord_of(dist.get_rank())) for m in outputs)
                _foreach_plans[(func, key)] = ForeachPlan(lists, singles, outputs, shapes)
    if not func._schema.returns:
        return None
    return [r[0] for r in results]


def _cached_plan(func, args, kwargs) -> CallPlan | None:
    key = argument_key(func, args, kwargs)
    plans = _plans.get(func)
    return plans.get(key) if plans is not None and hashable(key) else None


def _runs_as_is(plan: CallPlan | None) -> bool:
    """Whether a call plan runs the op on the local parts unchanged: no boxing, no kernel, a member rank."""
    return (
        plan is not None
        and plan.member
        and plan.decision.kernel is None
        and plan.decision.rule.outside is None
        and all(boxing is None for boxing in plan.plans)
    )


def ran_as_is(func, args, kwargs) -> bool:
    """Whether this call, already dispatched once, ran the op on the local parts as they were: its cached
    plan runs as is (``_runs_as_is``), or it is a foreach call with a ``ForeachPlan``. In-place view ops,
    coalesced foreach ops and fallbacks do not."""
    f = facts(func)
    if f.inplace_view or func in COALESCED:
        return False
    if f.foreach:
        try:
            return (func, argument_key(func, args, kwargs)) in _foreach_plans
        except TypeError:
            return False
    return _runs_as_is(_cached_plan(func, args, kwargs))


def _run_foreach_plan(plan: ForeachPlan, func, args, kwargs):
    local_args = list(args)
    for where in plan.lists:
        local_args[where] = [t._local for t in args[where]]
    for where in plan.singles:
        local_args[where] = args[where]._local
    out = func(*local_args, **kwargs)
    if not plan.outputs:
        return None if not func._schema.returns else out
    return [
        _checked_global(func, local, meta, shape, "(one per index)")
        for local, meta, shape in zip(out, plan.outputs, plan.local_shapes)
    ]


def _out_of_place(func):
    """The view op with the same arguments as in-place view ``func`` (``aten.transpose_.default`` →
    ``aten.transpose.int``), or None."""
    packet = getattr(aten, func._schema.name.split("::")[1].rstrip("_"), None)
    signature = [(a.name, str(a.type)) for a in func._schema.arguments]
    for name in packet.overloads() if packet is not None else ():
        overload = getattr(packet, name)
        if [(a.name, str(a.type)) for a in overload._schema.arguments] == signature:
            return overload
    return None


def _run_inplace_view(func, args, kwargs):
    """An in-place view op (``squeeze_``, ``transpose_``, ...) changes the shape of ``self`` itself: run its
    out-of-place view, move the resulting part and metadata into ``self``, and restride the wrapper."""
    view = _out_of_place(func)
    self = args[0]
    if view is None or not isinstance(self, GlobalTensor):
        raise NotImplementedError(f"sbp_torch: {func} on a global tensor is not supported")
    result = _dispatch_one(view, args, kwargs)
    self._local, self._meta = result._local, result._meta
    with torch._C._DisableTorchDispatch():  # set the wrapper's own sizes; no data to move
        torch.Tensor.as_strided_(self, result.shape, result.stride())
    return self


def _bump_written_lists(f, args) -> None:
    """Bump the version of each global tensor in the lists a foreach op wrote into. Torch bumps a plain
    tensor's version in its kernel, and a global tensor's in its autograd layer for other in-place ops, but
    not for foreach ones; without it, autograd would not see a saved tensor changed by an optimizer step."""
    for position, name in enumerate(f.names[: len(args)]):
        if name in f.written:
            torch._C._increment_version([t for t in args[position] if isinstance(t, GlobalTensor)])


def dispatch(func, args, kwargs):
    f = facts(func)
    if f.foreach:
        out = _run_foreach(func, args, kwargs)
        if f.written:
            _bump_written_lists(f, args)
        return out
    if f.inplace_view:
        return _run_inplace_view(func, args, kwargs)
    return _dispatch_one(func, args, kwargs)


# op -> {argument key: CallPlan}; two levels, so that the op (whose hash is computed in Python) is hashed once
_plans: dict = {}


def _dispatch_one(func, args, kwargs):
    key = argument_key(func, args, kwargs)
    plans = _plans.get(func)
    try:
        plan = plans.get(key) if plans is not None else None
    except TypeError:  # an unhashable argument: no caching for this call
        plan = key = None
    if plan is not None:  # the steady state of a training loop: no checks, search, flattening or planning
        return _run_simple(plan, func, args, kwargs) if plan.simple else _run(plan, func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    globals_ = _check_operands(func, flat)
    if _implicit[0]:
        args, kwargs = _broadcast_plain_tensors(func, args, kwargs, globals_[0].placement)
        key = argument_key(func, args, kwargs) if key is not None else None
    if func in VALUE_OPS:
        return _fallback(func, args, kwargs, globals_, "its result is a plain value")
    try:
        decision = decide(func, args, kwargs)
    except NoSignature as why:
        return _fallback(func, args, kwargs, globals_, str(why))
    plan = _compile(func, args, kwargs, decision, globals_[0].placement)
    if key is not None and hashable(key):
        _plans.setdefault(func, {})[key] = plan
    return _run(plan, func, args, kwargs)


_global_tensor.dispatch = dispatch  # route __torch_dispatch__ here (see _global_tensor.py)
