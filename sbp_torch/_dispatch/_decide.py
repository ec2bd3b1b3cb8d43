"""Choosing an op's N-D signature, once per call shape: of the products over placement axes of the rule's 1-D
signatures, the valid one whose input boxing moves the fewest bytes (the boxing planner's figure, summed over ranks); on
equal costs, the one changing fewest inputs' layouts, then the rule's order (``docs/signatures.md``). Nothing here
depends on hashing order, object ids or timing, so every rank, running the same program, decides the same."""

import itertools
from dataclasses import dataclass

import torch

from .._boxing import plan_boxing
from .._layout import GlobalMeta, Partial, Split, broadcast, check_partial_dtype
from .._signatures import OpCall, Rule, Signature, TensorInfo, rule_for, shown_arguments
from .._tensor import GlobalTensor
from ._bound import BoundCall
from ._outputs import UnknownOutputs, infer_outputs


@dataclass(frozen=True)
class Decision:
    """How to run one call: the layout each global input is boxed to, a GlobalMeta per tensor output (flattened
    order), and ``cost``, the bytes the input boxing moves, summed over ranks."""

    input_sbps: tuple[tuple, ...]
    outputs: tuple[GlobalMeta, ...]
    signatures: tuple[Signature, ...]  # the 1-D signature on each placement axis
    rule: Rule
    cost: int

    @property
    def local_fn(self) -> str | None:
        """The rule's local function, if the chosen signature names one."""
        return next((s.local_fn for s in self.signatures if s.local_fn), None)

    @property
    def local_axes(self) -> tuple[int, ...]:
        """The placement axes whose signature names the local function."""
        return tuple(a for a, s in enumerate(self.signatures) if s.local_fn)


class NoSignature(Exception):
    """No rule, no valid signature, or the op cannot run on meta tensors: use the broadcast fallback."""


@dataclass(frozen=True)
class _Resolved:
    """A rule's 1-D signature resolved against one call: the SBP of each global input in flattened argument order, of
    each tensor output, and the signature itself (what ``check_nd`` and local functions see)."""

    inputs: tuple
    outputs: tuple
    signature: Signature


def _describe(value):
    return TensorInfo(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


def shown_call(bound: BoundCall, rule: Rule, mesh_shape: tuple[int, ...] | None = None) -> OpCall:
    """The call as ``rule`` sees it (``_signatures/core.py``), with no outputs yet, on the placement's mesh (or
    ``mesh_shape``)."""
    names = {bound.schema.name_of(bound.slots[i][0]) for i in bound.inputs}
    shown = shown_arguments(bound.func, bound.by_name, rule.reads, _describe)
    return OpCall(bound.func, shown, (), mesh_shape or bound.placement.shape, frozenset(names))


def _plain_tensor_slots(bound: BoundCall) -> list[tuple[str, int | None]]:
    """(name, index in a list or None) of every plain tensor argument: it is broadcast, whatever a signature says."""
    slots = []
    for name, value in bound.by_name.items():
        for index, v in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            if isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor):
                slots.append((name, index))
    return slots


@dataclass(frozen=True)
class _CallFacts:
    """What resolving a signature reads of a call, gathered once per decision: each plain tensor's (name, index),
    each global input's (name, index), how many tensor outputs there are, and the (ndim, dtype) of each global input,
    then of each output."""

    plain: list
    inputs: list
    outputs: int
    tensors: list

    @staticmethod
    def of(bound: BoundCall, inputs: list[GlobalTensor], outputs: list[TensorInfo]) -> "_CallFacts":
        name_of = bound.schema.name_of
        named = [(name_of(where), index) for where, index in (bound.slots[i] for i in bound.inputs)]
        tensors = [(g.dim(), g.dtype) for g in inputs] + [(o.ndim, o.dtype) for o in outputs]
        return _CallFacts(_plain_tensor_slots(bound), named, len(outputs), tensors)


def _input_sbps(signature: Signature, call: _CallFacts, func) -> tuple | None:
    """The SBP the signature asks of each global input, or None where it asks a plain tensor to be laid out otherwise
    than broadcast. A global input the signature does not name is a defect of the rule: an error."""
    sbp_of = signature.sbp_of
    for name, index in call.plain:
        if sbp_of(name, index) not in (None, broadcast):
            return None
    sbps = []
    for name, index in call.inputs:
        sbp = sbp_of(name, index)
        if sbp is None:
            raise RuntimeError(
                f"sbp_torch internal error: a signature of the rule of {func} names no SBP for argument "
                f"{name!r}: {signature}"
            )
        sbps.append(sbp)
    return tuple(sbps)


def _resolve(signature: Signature, call: _CallFacts, sbps: tuple) -> _Resolved | None:
    """The signature, asking ``sbps`` of the global inputs, as a ``_Resolved`` for this call, or None where it does
    not fit: another number of outputs, a split of a dim the tensor lacks, a partial its dtype cannot hold."""
    out_sbps = signature.output_sbps(call.outputs)
    if len(out_sbps) != call.outputs:
        return None
    for s, (ndim, dtype) in zip(sbps + tuple(out_sbps), call.tensors):
        if isinstance(s, Split):
            if not 0 <= s.dim < ndim:
                return None
        elif isinstance(s, Partial):
            try:
                check_partial_dtype(s, dtype)
            except TypeError:
                return None
    return _Resolved(sbps, tuple(out_sbps), signature)


def _partial_allowed(combo, inputs: list[GlobalTensor]) -> bool:
    """An input may be made partial locally (free, but the result must be reduced later) only where the op
    yields a partial result anyway: some input already is partial with that op on that axis, or the
    signature turns non-partial inputs into a partial output (a bias joining a split-contraction product)."""
    for axis, sig in enumerate(combo):
        current = [g.sbp[axis] for g in inputs]
        inherent = any(isinstance(o, Partial) for o in sig.outputs) and any(isinstance(w, Split) for w in sig.inputs)
        for want, have in zip(sig.inputs, current):
            if isinstance(want, Partial) and want != have and want not in current and not inherent:
                return False
    return True


def _joins_partial(combo, inputs: list[GlobalTensor]) -> bool:
    """Whether the signature makes a non-partial input partial to join a partial one (``b + p`` as ``P + P``)
    rather than the op making the partial result itself (a split contraction)."""
    for axis, sig in enumerate(combo):
        inherent = any(isinstance(o, Partial) for o in sig.outputs) and any(isinstance(w, Split) for w in sig.inputs)
        if not inherent and any(
            isinstance(want, Partial) and not isinstance(g.sbp[axis], Partial) for want, g in zip(sig.inputs, inputs)
        ):
            return True
    return False


def _deferred_reduction(outputs: list[TensorInfo], out_sbps: list[tuple], placement) -> int:
    """What keeping the outputs partial defers: reducing them to broadcast later (plus one byte, so that on
    equal bytes reducing now wins). A residual stream kept partial is reduced anyway by the next layer norm,
    and again in backward for the copy autograd saved, so joining a partial only pays when nothing follows."""
    deferred = 1
    for info, sbp in zip(outputs, out_sbps):
        if any(isinstance(s, Partial) for s in sbp):
            whole = tuple(broadcast if isinstance(s, Partial) else s for s in sbp)
            deferred += _decision_cost(plan_boxing(GlobalMeta(info.shape, info.dtype, placement, sbp), whole))
    return deferred


def decide(bound: BoundCall) -> Decision:
    """The cheapest valid N-D signature for the call (see the module docstring); raises NoSignature."""
    rule = rule_for(bound.func)
    if rule is None:
        raise NoSignature(f"{bound.func} has no SBP rule")
    inputs = [bound.tensors[i] for i in bound.inputs]
    outs = [bound.tensors[i] for i in bound.outs]
    placement = bound.placement
    call = shown_call(bound, rule)
    try:
        outputs = infer_outputs(bound, call, rule)
    except UnknownOutputs as why:
        raise NoSignature(str(why)) from why
    call.outputs = tuple(outputs)
    facts = _CallFacts.of(bound, inputs, outputs)
    offered = [(s, sbps) for s in rule.offered(call) if (sbps := _input_sbps(s, facts, bound.func)) is not None]
    written = {id(bound.tensors[i]) for i in bound.written}
    written_inputs = [k for k, g in enumerate(inputs) if id(g) in written]
    aliased_outputs = _outputs_aliasing_inputs(bound, inputs)

    def candidate(combo):
        """(combo, targets, out_sbps) if the N-D signature ``combo`` is valid for this call, else None."""
        if len({s.signature.local_fn for s in combo if s.signature.local_fn}) > 1:
            return None
        if not _partial_allowed(combo, inputs):
            return None
        if rule.check_nd is not None and not rule.check_nd(call, tuple(s.signature for s in combo)):
            return None
        targets = [tuple(s.inputs[i] for s in combo) for i in range(len(inputs))]
        out_sbps = [tuple(s.outputs[j] for s in combo) for j in range(len(outputs))]
        if any(targets[i] != inputs[i].sbp for i in written_inputs):
            return None  # an in-place op keeps its tensor's layout; the other operands are boxed instead
        if any(out_sbps[j] != inputs[i].sbp for j, i in aliased_outputs):
            return None
        if outs and (len(outs) != len(out_sbps) or any(o.sbp != s for o, s in zip(outs, out_sbps))):
            return None
        if any(tuple(o.shape) != info.shape for o, info in zip(outs, outputs)):
            return None
        return combo, targets, out_sbps

    # The first valid signature that keeps every input's layout costs nothing and changes nothing, so none can
    # beat it (costs are never negative; ties go to fewer changes, then the rule's order): found among those
    # that keep the layouts on every axis (in the full product's order), it is taken without costing the
    # others (on a new shape, each cost is an N-D boxing search), nor resolving the signatures that change a layout.
    keeping = []
    for axis in range(placement.ndim):
        current = tuple(g.sbp[axis] for g in inputs)
        resolved = (_resolve(s, facts, sbps) for s, sbps in offered if sbps == current)
        keeping.append([r for r in resolved if r is not None])
    kept = next(filter(None, map(candidate, itertools.product(*keeping))), None)
    if kept is not None and not _joins_partial(kept[0], inputs):
        candidates = [kept]
    else:
        one_d = [r for r in (_resolve(s, facts, sbps) for s, sbps in offered) if r is not None]
        candidates = list(filter(None, map(candidate, itertools.product(one_d, repeat=placement.ndim))))
    best = None
    viewing = getattr(bound.func, "is_view", False)  # (a view of a boxed input is a copy: see GlobalMeta.copied)
    for combo, targets, out_sbps in candidates:
        cost = sum(_decision_cost(plan_boxing(g._meta, t)) for g, t in zip(inputs, targets))
        if _joins_partial(combo, inputs):
            cost += _deferred_reduction(outputs, out_sbps, placement)
        changes = sum(t != g.sbp for g, t in zip(inputs, targets))
        if best is None or (cost, changes) < best[0]:
            copied = viewing and (changes > 0 or any(g._meta.copied for g in inputs))
            metas = tuple(
                GlobalMeta(o.shape, o.dtype, placement, s, o.strides, copied) for o, s in zip(outputs, out_sbps)
            )
            signatures = tuple(s.signature for s in combo)
            best = ((cost, changes), Decision(tuple(targets), metas, signatures, rule, cost))
    if best is None:
        raise NoSignature(f"no signature of {bound.func} fits these inputs")
    return best[1]


def _decision_cost(plan) -> int:
    """What boxing an input costs a decision: the plan's cost, where a reduce-scatter also counts the all-gather
    it defers. A split activation soon meets an op that needs it whole (the next layer's matmul), so a partial
    input is reduced to broadcast, as Megatron-style tensor parallelism does, unless the op needs it split."""
    return plan.cost + sum(
        step.cost for step in plan.steps if isinstance(step.src, Partial) and isinstance(step.dst, Split)
    )


def _outputs_aliasing_inputs(bound: BoundCall, inputs: list[GlobalTensor]) -> list[tuple[int, int]]:
    """(output index, input index) for each tensor output that the schema says is a written input (the
    ``self`` that ``add_`` returns), which must keep that input's layout."""
    named = bound.by_name
    pairs = []
    for j, name in bound.schema.written_returns:
        g = named.get(name)
        if isinstance(g, GlobalTensor):
            index = next((i for i, x in enumerate(inputs) if x is g), None)
            if index is not None:
                pairs.append((j, index))
    return pairs
