"""Sharded data parallelism as a layout (``Module.to_global(..., shard=axis)``, docs/training.md).

A sharded parameter is *stored* split over the data axis (the optimizer, ``state_dict`` and checkpoints see only
the stored parts) and *used* in its compute layout, the plan's SBP (broadcast on the data axis). The modules of
a model are grouped into units (by default the root and the model's blocks, ``default_units``). A unit's
parameters are gathered together, by one all-gather, when its forward starts; the gathered copies stand in for
the parameters during that forward and are freed when it ends (the root's when its gradients are reduced), so
autograd keeps no gathered weight alive: a tensor it saves that lies in a gathered copy is gathered again when
backward reads it. A unit's gradients are reduce-scattered together, started as soon as
backward has produced them and finished when the next unit's start (or backward ends). While a unit computes,
the next one's gather is in flight (forward order in forward, the reverse in backward).

Traced (``torch.compile``, ``explain``), each module that holds a sharded parameter converts it for its own
call, a plain conversion ``stored -> compute`` inside the program: the all-gather in its forward, the
reduce-scatter of the gradient in its backward, where the compiler schedules and frees them. (Per holding
module, not per unit: ``torch.compile(model)`` runs the root's own hooks outside the compiled forward, as
frames of their own, but the hooks of the modules called inside it within it.)"""

from __future__ import annotations

import enum
import fnmatch
import math
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._pytree import tree_map

from .. import _comm as comm
from .._boxing import box_local
from .._layout import Broadcast, GlobalMeta, Partial, Split, balanced_sizes
from .._tensor import GlobalTensor
from ._module_tensors import Slot, Swap


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes of sharded parameters in use (as FSDP2's ``MixedPrecisionPolicy``). Stored parameters keep
    their dtype, and the optimizer updates them in it; ``param_dtype`` is the dtype they are gathered and
    computed in (None: the stored dtype), and the floating-point tensors passed to each unit are cast to it;
    ``reduce_dtype`` the dtype their gradients are reduced in (None: ``param_dtype``); ``output_dtype`` the
    dtype the model's floating-point outputs are cast to (None: as computed). Gradients reach ``.grad`` in the
    stored dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None


def storage_sbp(name: str, compute: tuple, axis: int, ndim: int) -> tuple | None:
    """The layout a parameter used as ``compute`` is stored in when sharded over ``axis``; None where it stays
    as it is (already split on ``axis``, or every dim split by a later axis). Splits nest in axis order, so the
    stored split takes a dim no later axis splits: gathering over ``axis`` then gives back the compute part."""
    if any(isinstance(s, Partial) for s in compute):
        raise ValueError(
            f"module tensor {name!r}: a sharded parameter is gathered to its compute layout, which cannot be "
            f"partial (got {compute}); make it broadcast or split, or leave the parameter unsharded"
        )
    if not isinstance(compute[axis], Broadcast):
        return None
    later = {s.dim for s in compute[axis + 1 :] if isinstance(s, Split)}
    free = [d for d in range(ndim) if d not in later]
    return compute[:axis] + (Split(free[0]),) + compute[axis + 1 :] if free else None


class _ShardedParameter:
    """One stored parameter, where its module(s) hold it, and its gathered copy (``full``: this rank's compute
    part, whose storage is emptied when freed and refilled when gathered again)."""

    def __init__(self, stored: nn.Parameter, compute: GlobalMeta, axis: int, owners: list):
        self.stored, self.compute, self.owners = stored, compute, owners
        self.dim = stored.sbp[axis].dim
        coord = compute.placement.local_coord()
        self.shape = compute.local_shape(coord)
        self.sizes = balanced_sizes(self.shape[self.dim], compute.placement.shape[axis])
        self.numels = [math.prod(self.shape) // max(self.shape[self.dim], 1) * n for n in self.sizes]
        self.full: torch.Tensor | None = None

    def slots(self) -> list[Slot]:
        """Where modules hold the parameter (a tied parameter has several)."""
        return [Slot(module._parameters, name) for module, name in self.owners]


class UnitState(enum.Enum):
    """Where a unit's gathered copies are: ``FREE`` (storage released), ``GATHERING`` (an all-gather in flight,
    ``_Unit.in_flight`` finishes it), ``GATHERED`` (the copies hold the parameters)."""

    FREE = "free"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Unit:
    """Parameters gathered together: one all-gather of a flat row per rank, padded to the longest."""

    def __init__(self, name: str, params: list[_ShardedParameter], axis: int):
        self.name, self.params, self.axis = name, params, axis
        placement = params[0].compute.placement
        self.group = comm.axis_group(placement, axis)
        self.index = self.group.index
        self.row = max(sum(p.numels[k] for p in params) for k in range(self.group.size))
        self.state = UnitState.FREE
        self.in_flight = None  # finish() of the gather, while GATHERING
        # the copies stood in for the parameters while a forward uses them, a call inside another on top
        self.swaps: list[Swap] = []
        self.timeline: list | None = None  # where events go, when a timeline is recorded

    @property
    def gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    @property
    def nbytes(self) -> int:
        return sum(math.prod(p.shape) * p.compute.dtype.itemsize for p in self.params)

    def start(self) -> None:
        """Begin gathering, unless gathered or begun."""
        if self.state is not UnitState.FREE:
            return
        row = self.params[0].stored._local.new_zeros(self.row, dtype=self.params[0].compute.dtype)
        offset = 0
        for p in self.params:
            n = p.numels[self.index]
            row[offset : offset + n].copy_(p.stored._local.reshape(-1))
            offset += n
        self.in_flight = comm.start_gather_rows(row, self.group)
        self.state = UnitState.GATHERING
        self.note("gather begun")

    def ensure(self) -> None:
        """Wait for the gather (starting it if need be) and fill each parameter's gathered copy."""
        if self.gathered:
            return
        self.start()
        rows = self.in_flight()
        self.in_flight = None
        self.state = UnitState.FREE  # (until the copies are filled below)
        offsets = [0] * len(rows)
        for p in self.params:
            parts = []
            for k, row in enumerate(rows):
                shape = list(p.shape)
                shape[p.dim] = p.sizes[k]
                parts.append(row[offsets[k] : offsets[k] + p.numels[k]].view(shape))
                offsets[k] += p.numels[k]
            if p.full is None:
                p.full = torch.empty(p.shape, dtype=p.compute.dtype, device=rows.device)
            else:
                p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
            torch.cat(parts, dim=p.dim, out=p.full)
        self.state = UnitState.GATHERED
        self.note("gathered")

    def note(self, event: str) -> None:
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), self.name, event))

    def drop_in_flight(self) -> None:
        """Wait for a gather nobody will read (its values may be stale) and forget it: every rank still waits
        for what it started."""
        if self.state is UnitState.GATHERING:
            self.in_flight()
            self.in_flight, self.state = None, UnitState.FREE

    def free(self) -> None:
        for p in self.params:
            if p.full is not None:
                p.full.untyped_storage().resize_(0)
        if self.state is UnitState.GATHERED:
            self.state = UnitState.FREE


class _Held:
    """A tensor autograd saved that lies in a unit's gathered copy."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: _Unit, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


class _GatherForUse(torch.autograd.Function):
    """The gathered copies of a unit's stored parameters; backward hands their gradients to the model's
    reduce-scatter (which fills the stored parameters' ``.grad``) and returns none itself."""

    @staticmethod
    def forward(ctx, sharded, unit, *stored):
        ctx.sharded, ctx.unit = sharded, unit
        ctx.set_materialize_grads(False)  # a copy no gradient reached gets none, not a tensor of zeros
        copies = tuple(GlobalTensor(p.full, p.compute) for p in unit.params)
        frozen = [copy for copy, wanted in zip(copies, ctx.needs_input_grad[2:]) if not wanted]
        ctx.mark_non_differentiable(*frozen)  # (a frozen parameter's copy takes no gradient either)
        return copies

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharded.reduce(ctx.unit, grads)
        return (None, None, *(None for _ in grads))


class ShardedModel:
    """The hooks and state of one sharded model: gathers on use, frees after use, reduce-scatters gradients."""

    def __init__(self, root: nn.Module, units: list[tuple[nn.Module, _Unit]], policy: MixedPrecision):
        self.units = [unit for _, unit in units]
        self.root_unit = next((unit for module, unit in units if module is root), None)
        self.policy = policy
        self.reduce_dtype = policy.reduce_dtype or policy.param_dtype
        self.order: list[_Unit] = []  # the units in the order the last forward entered them
        self.reductions: list = []
        self.flush_queued = False
        self.by_storage: dict[int, _Unit] = {}
        self.peak_gathered = 0
        # traced: a module's parameters converted for its call (an entry per module: a list per module, as a stack
        # for nested calls, broke the compiled graph in two)
        self.converted: dict[nn.Module, Swap] = {}
        # traced whole: a unit's parameters converted at its first use, until its call ends (``_converted``)
        self.traced_copies: dict[_Unit, tuple] = {}
        self.saved: set[int] = set()  # the storages autograd saved in this step's forward
        self.saved_bytes = 0  # theirs, together
        self.peak_saved = 0
        self.saving = None
        root.register_forward_pre_hook(lambda m, a: self._begin_step(), prepend=True)
        for module, unit in units:
            module.register_forward_pre_hook(lambda m, a, k, unit=unit: self._enter(unit, a, k), with_kwargs=True)
            module.register_forward_hook(lambda m, a, o, unit=unit: self._leave(unit), always_call=True)
        root.register_forward_hook(lambda m, a, o: self._end_step(o), always_call=True)
        held: dict[nn.Module, list] = {}
        for _, unit in units:
            for p in unit.params:
                for module, name in p.owners:
                    held.setdefault(module, []).append((name, p, unit))
        for module, entries in held.items():
            module.register_forward_pre_hook(lambda m, a, entries=entries: self._convert(m, entries))
            module.register_forward_hook(lambda m, a, o: self._restore(m), always_call=True)

    # forward
    def _enter(self, unit: _Unit, args: tuple, kwargs: dict):
        """Gather ``unit`` and stand its copies in for its parameters; returns the call's arguments, cast to
        the policy's ``param_dtype``."""
        if self.policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.policy.param_dtype)
        if _traced():
            return args, kwargs
        unit.ensure()
        self._register(unit)
        self._note_gathered()
        if unit not in self.order:
            self.order.append(unit)
        following = self._neighbour(unit, +1)
        if following is not None and not _in_backward():
            following.start()
        stored = [p.stored for p in unit.params]
        if torch.is_grad_enabled() and any(s.requires_grad for s in stored):
            used = _GatherForUse.apply(self, unit, *stored)
            unit.note("forward begun")
        else:
            used = [GlobalTensor(p.full, p.compute) for p in unit.params]
        swap = Swap(
            [slot for p in unit.params for slot in p.slots()],
            [tensor for p, tensor in zip(unit.params, used) for _ in p.owners],
        )
        swap.put()
        unit.swaps.append(swap)
        return args, kwargs

    def _leave(self, unit: _Unit) -> None:
        if _traced():
            self.traced_copies.pop(unit, None)
            return
        if unit.swaps:
            unit.swaps.pop().put_back()
        unit.note("forward done")
        # A forward recomputed inside backward (activation checkpointing) keeps its copies: the recomputed
        # tensors saved for the rest of this backward lie in them; the unit's gradient reduction frees them.
        # The root's copies are kept for the backward that follows at once (as FSDP2 keeps its root's).
        keep = unit is self.root_unit and torch.is_grad_enabled() and any(p.stored.requires_grad for p in unit.params)
        if not _in_backward() and not keep:
            unit.free()

    def _convert(self, module: nn.Module, entries: list) -> None:
        """Traced: ``module`` sees its sharded parameters converted to their compute layout for this call, but
        those of a unit gathered eagerly (its hooks ran outside the compiled program: ``model.forward``
        compiled, not the root's hooks)."""
        if not _traced():
            return
        converting = [(name, p, unit) for name, p, unit in entries if not unit.gathered]
        swap = Swap(
            [Slot(module._parameters, name) for name, _, _ in converting],
            [self._converted(unit, p) for _, p, unit in converting],
        )
        swap.put()
        self.converted[module] = swap

    def _converted(self, unit: _Unit, p: _ShardedParameter) -> GlobalTensor:
        """Traced: ``p`` in its compute layout (cast first: gathered in the compute dtype, as eagerly). In a program
        traced whole (``compile_step``), a unit's parameters are converted together at its first use, so that its
        gathers are issued back to back, as one bucket eagerly, and the program's bucketing merges them; they are
        converted again after the unit's call ends, at the model's next forward, and in another grad mode. Dynamo
        traces Python state apart: there each module converts its own."""

        def convert(q: _ShardedParameter) -> GlobalTensor:
            return q.stored.to(q.compute.dtype).to_global(sbp=q.compute.sbp)

        if torch.compiler.is_dynamo_compiling():
            return convert(p)
        mode = get_proxy_mode()
        if mode is None:
            return convert(p)
        held = self.traced_copies.get(unit)
        grad = torch.is_grad_enabled()
        if held is None or held[0]() is not mode or held[1] != grad:  # (none yet, another trace's, other grad mode)
            with comm.issued_together():
                copies = {id(q): convert(q) for q in unit.params}
            held = self.traced_copies[unit] = (weakref.ref(mode), grad, copies)
        return held[2][id(p)]

    def _restore(self, module: nn.Module) -> None:
        swap = self.converted.pop(module, None)
        if swap is not None:
            swap.put_back()

    def _begin_step(self) -> None:
        """A forward of the whole model starts: copies gathered before it may be stale (an optimizer step
        since), so they are dropped; what autograd saves is watched until it ends."""
        if not torch.compiler.is_dynamo_compiling() and not _in_backward():
            self.traced_copies.clear()
        if _traced() or _in_backward():
            return
        for unit in self.units:
            unit.drop_in_flight()
            unit.free()
        self.saved, self.saved_bytes = set(), 0
        if self.saving is None:
            self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saving.__enter__()

    def _end_step(self, output):
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        if self.policy.output_dtype is not None:
            return _cast_floats(output, self.policy.output_dtype)
        return None

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        order = self.order
        if unit in order and 0 <= order.index(unit) + step < len(order):
            return order[order.index(unit) + step]
        return None

    def _register(self, unit: _Unit) -> None:
        for p in unit.params:
            self.by_storage[p.full.untyped_storage()._cdata] = unit

    def _note_gathered(self) -> None:
        self.peak_gathered = max(self.peak_gathered, sum(u.nbytes for u in self.units if u.gathered))

    # what autograd saves
    def _pack(self, x: torch.Tensor):
        local = x._local if isinstance(x, GlobalTensor) else x
        if local.layout != torch.strided:
            return x
        storage = local.untyped_storage()
        unit = self.by_storage.get(storage._cdata)
        if unit is not None:
            return _Held(unit, x)
        if storage._cdata not in self.saved:
            self.saved.add(storage._cdata)
            self.saved_bytes += storage.nbytes()
            self.peak_saved = max(self.peak_saved, self.saved_bytes)
        return x

    def _unpack(self, packed):
        if isinstance(packed, _Held):
            if not packed.unit.gathered:
                packed.unit.ensure()
                self._note_gathered()
                earlier = self._neighbour(packed.unit, -1)
                if earlier is not None:
                    earlier.start()
            return packed.tensor
        return packed

    # gradients
    def reduce(self, unit: _Unit, grads) -> None:
        """Begin reducing the gradients of ``unit``'s gathered copies into its stored parameters' ``.grad``: a
        gradient partial (sum) on the data axis and laid out like the copy elsewhere joins the unit's one
        reduce-scatter; another is boxed to the stored layout alone."""
        unit.note("backward done")
        bucket = []
        for p, grad in zip(unit.params, grads):
            if grad is None:
                continue
            local = grad._local.to(self.reduce_dtype or grad.dtype)
            on_axis = grad.sbp[unit.axis]
            elsewhere = all(g == c for a, (g, c) in enumerate(zip(grad.sbp, p.compute.sbp)) if a != unit.axis)
            if elsewhere and isinstance(on_axis, Partial) and on_axis.op == "sum":
                bucket.append((p, local))
            else:
                meta = GlobalMeta(grad._meta.shape, local.dtype, grad.placement, grad.sbp, grad._meta.strides)
                _accumulate(p, box_local(local, meta, p.stored.sbp))
        unit.free()
        while self.reductions:  # one in flight while backward goes on: buffers do not pile up
            self._finish(*self.reductions.pop(0))
        if bucket:
            parts = [local.split(p.sizes, dim=p.dim) for p, local in bucket]
            finish = comm.start_reduce_scatter_parts(parts, "sum", unit.group)
            unit.note("reduce-scatter begun")
            self.reductions.append((unit, [p for p, _ in bucket], finish))
        if not self.flush_queued:
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_reductions)

    def _finish_reductions(self) -> None:
        self.flush_queued = False
        for unit in self.units:  # a gather started for a backward that no longer needs it
            unit.drop_in_flight()
        reductions, self.reductions = self.reductions, []
        for reduction in reductions:
            self._finish(*reduction)

    def _finish(self, unit: _Unit, params: list, finish) -> None:
        for p, mine in zip(params, finish()):
            _accumulate(p, mine)
        unit.note("reduced")

    def record_timeline(self, events: list | None) -> None:
        """Append ``(time.perf_counter(), unit name, event)`` to ``events`` from now on (None: stop): each unit's
        gathers begun and done, forward begun and done, backward done, reduce-scatters begun and done."""
        for unit in self.units:
            unit.timeline = events

    def memory(self) -> dict:
        """Bytes on this rank: the most gathered copies alive at once, and the most bytes autograd held saved
        for backward in one step (gathered copies not counted)."""
        return {"gathered_peak": self.peak_gathered, "saved_for_backward_peak": self.peak_saved}


def _cast_floats(tree, dtype: torch.dtype):
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tree_map(cast, tree)


def _traced() -> bool:
    """Whether the program is being traced (torch.compile, ``explain``); Dynamo reads the first test as a
    constant, and traces nothing of the second."""
    return torch.compiler.is_compiling() or comm.traced()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _accumulate(p: _ShardedParameter, local: torch.Tensor) -> None:
    local = local.to(p.stored.dtype)
    grad = p.stored.grad
    if grad is None:
        p.stored.grad = GlobalTensor(local.contiguous(), p.stored._meta)
    else:
        grad._local.add_(local)


def default_units(module: nn.Module) -> list[str]:
    """The module names a sharded model gathers by: the root, and the blocks of a model: each child of the
    outermost ``nn.ModuleList`` or ``nn.Sequential`` whose two or more children are of one class and hold
    parameters (a transformer's layers, not an MLP's ``Linear, GELU, Linear``)."""
    names = [""]
    for name, sub in module.named_modules():
        children = list(sub.named_children())
        inside = any(name.startswith(unit + ".") for unit in names[1:])
        if inside or not isinstance(sub, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
            continue
        if len({type(c) for _, c in children}) == 1 and any(True for _ in sub.parameters()):
            names += [f"{name}.{child}" if name else child for child, _ in children]
    return names


def shard_model(
    module: nn.Module, computes: dict, axis: int, units: list[str] | None, policy: MixedPrecision
) -> ShardedModel | None:
    """Install gather-on-use for the sharded parameters of ``module``. ``computes`` maps each stored parameter
    (by id) to (the parameter, its compute meta); ``units``: glob patterns on module names (None: the default)."""
    patterns = default_units(module) if units is None else ["", *units]
    if not computes or next(iter(computes.values()))[1].placement.local_coord() is None:
        return None  # nothing sharded, or not a rank of the placement (another pipeline stage's): nothing runs
    unit_names = [name for name, _ in module.named_modules() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    modules = dict(module.named_modules(remove_duplicate=False))
    owner_unit: dict[int, str] = {}
    owners: dict[int, list] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        nearest = max((u for u in unit_names if u == "" or prefix == u or prefix.startswith(u + ".")), key=len)
        for name, tensor in sub._parameters.items():
            if tensor is None or id(tensor) not in computes:
                continue
            owners.setdefault(id(tensor), []).append((sub, name))
            seen = owner_unit.setdefault(id(tensor), nearest)
            if seen != nearest:  # tied across units: the root gathers it for the whole forward
                owner_unit[id(tensor)] = ""
    groups: dict[str, list[_ShardedParameter]] = {}
    for key, (param, compute) in computes.items():
        groups.setdefault(owner_unit[key], []).append(_ShardedParameter(param, compute, axis, owners[key]))
    units = [(modules[name], _Unit(name, groups[name], axis)) for name in unit_names if name in groups]
    return ShardedModel(module, units, policy)
