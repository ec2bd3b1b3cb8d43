"""Units that run as plain PyTorch: a block whose layout needs no collective computes on the local parts.

A laid-out model's units (its blocks, ``default_units``, and the ``units`` given to ``Module.to_global``) are where
data parallelism, sharded or not, communicates: between them. Inside one, with the batch split and the weights
broadcast (or gathered), every op runs on the local parts as they are, and deciding each op again on global tensors
only costs the dispatcher's toll. FSDP2's blocks and DTensor's parallel styles compute on plain tensors there; a
unit does the same where it may prove it gives the dispatcher's result:

* A call is keyed by what decides its ops: each global argument's layout, shape and whether it requires grad, the
  other arguments by value, the unit's parameters' and buffers' layouts, grad mode, the default dtype, its modules'
  attributes that are numbers, strings or None (``training``, a dropout's ``p``) and their number of hooks. Other
  Python state a forward reads (a config object, globals, Python's ``random``) is not in the key. An argument that is
  none of a global tensor, a number, a string, None, a dtype, a device or a list, tuple or dict of them (a plain
  tensor with dims; a key/value cache object, which the unit would fill with parts) keeps the call on the dispatcher's
  path.
* A key's first call takes the dispatcher's path. Its second is learnt: it takes the dispatcher's path, recording
  each aten op and observing each collective, and the unit's forward then runs again on copies of the local parts
  as plain PyTorch. The key runs as plain PyTorch from its next call outside backward on, if

  - no collective was issued, no argument, parameter or buffer was written into, no module's attribute was set,
    no module inside it has a hook that is not sbp_torch's (it would see plain parts), nor is a global module hook
    registered, and no region inside is other than per rank (experts split over an axis);
  - the dispatcher ran every op on the parts as they were (a view or ``expand`` told its local sizes included; a
    random op the dispatcher runs otherwise, to draw the logical tensor's numbers, so it stays there);
  - the plain run dispatched the same aten ops with the same arguments: each global tensor's part where the
    dispatcher had the global tensor, an equal part where it had a global tensor it did not make itself (a
    factory's value under global mode, a region's output), the same sizes after a view; so it read no value either
    (the dispatcher would not have run that op as it was);
  - the outputs are new global tensors whose parts the plain run returned, beside the same other values;
  - the gradients follow from the parts as in a ``local_map`` region: on a placement axis where the unit computes
    per rank (something split or partial there), no input that needs a gradient is partial and no floating output
    that needs one is broadcast;
  - and all of this holds on every rank of the placement (one small all-reduce per axis, once per key): a rank may
    find otherwise on its own parts (a rank with no rows whose view cannot infer a size), and ranks that took
    different paths would reduce gradients in different orders.

* Run plain, the unit's forward sees its arguments', parameters' and buffers' local parts as plain tensors, outside
  global mode, and its outputs are wrapped as learnt. Gradients reach the global tensors as a region's do: a split
  input's split, a broadcast one's partial(sum) on an axis where the unit computes per rank, broadcast elsewhere;
  ``Module.to_global``'s gradient reduction and a sharded model's reduce-scatter take them as any other. An experts
  module inside runs its own forward on its rows (its data-parallel case) and reaches every expert's parameters, as
  its region does, so every rank reduces the same gradients.

The plain path is never taken while torch.compile or ``compile_step`` traces, while ``explain`` or the planner
estimate, under a torch dispatch mode or autocast, or on a rank outside the placement. A forward recomputed in
backward (activation checkpointing) takes the path its first run took: a forward on the dispatcher's path notes its
first global argument, which the recomputation is given again. A backward with ``create_graph=True`` through a unit
run plain raises (its gradients would lose their second-order terms). An in-place write, after the unit, into a
tensor its plain run saved for backward is not caught as autograd catches it on plain tensors (the part's version
counter is not the global tensor's): plain PyTorch refuses such a program, and here its gradients would read the
written values. ``SBP_TORCH_PLAIN_UNITS=0`` turns the plain path off. ``explain`` traces the dispatcher's path, so it
lists every collective whichever path runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _comm as comm
from .._dispatch import recording
from .._layout import Broadcast, GlobalMeta, dense_strides
from .._tensor import GlobalTensor, wrap_fresh
from ._global_mode import outside_global_mode
from ._local_map import divided_axes, input_gradient_sbp, wrap_part
from ._module_tensors import Slot, Swap, module_tensors

ENABLED = os.environ.get("SBP_TORCH_PLAIN_UNITS", "1") not in ("0", "")
_KEYS_KEPT = 16  # learnt keys per unit (one per batch shape and mode, in a loop with a few)
_SEEN = object()  # a key seen once: learnt on its next call
_REFUSED = object()  # a key that stays on the dispatcher's path
_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device)
# Not compared: autograd detaches what it saves on one path and not the other (a detached value a later op reads is
# then compared by its value, as a tensor the dispatcher did not make)
_DETACH = torch.ops.aten.detach.default

# Set while a unit's body runs on parts (plain or replayed): an experts module inside runs its own forward there.
_ON_PARTS: contextvars.ContextVar = contextvars.ContextVar("sbp_torch_unit_on_parts", default=None)
# Set while a unit learns on the dispatcher's path: what inside it says keeps the unit there (``keeps_dispatching``).
_LEARNING: contextvars.ContextVar = contextvars.ContextVar("sbp_torch_unit_learning", default=None)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled


def on_parts() -> bool:
    """Whether the running code is a plain unit's body on local parts."""
    return _ON_PARTS.get() is not None


def keeps_dispatching(reason: str) -> None:
    """Called on the dispatcher's path by code whose work a plain run would not repeat (a region whose layout is not
    per rank): the unit learning around it, if any, stays on the dispatcher's path for ``reason``."""
    notes = _LEARNING.get()
    if notes is not None:
        notes.append(reason)


@contextlib.contextmanager
def opaque():
    """Within the block, a unit's replay records no op: a region inside is compared by its outputs alone."""
    recorder = _ON_PARTS.get()
    if recorder is None:
        yield
        return
    recorder.paused += 1
    try:
        yield
    finally:
        recorder.paused -= 1


class _Refused(Exception):
    """Why a key stays on the dispatcher's path (``PlainUnit.refusals``)."""


class _Unkeyable(Exception):
    """An argument the key cannot hold: the call takes the dispatcher's path."""


def _describe(value, key: list, found: list) -> None:
    """Append ``value``'s key to ``key`` and its global tensors, in order, to ``found``."""
    t = type(value)
    if t is GlobalTensor:
        key.append((value._meta, value.requires_grad))
        found.append(value)
    elif t is list or t is tuple or t is torch.Size:
        key.append((t, len(value)))
        for v in value:
            _describe(v, key, found)
    elif t is dict:
        key.append((dict, tuple(value)))
        for v in value.values():
            _describe(v, key, found)
    elif t in _ATOMS:
        key.append((t, value))
    else:
        raise _Unkeyable


def _substituted(value, parts):
    """``value`` with each global tensor replaced by the next of ``parts`` (an iterator), in ``_describe``'s order."""
    t = type(value)
    if t is GlobalTensor:
        return next(parts)
    if t is list or t is tuple or t is torch.Size:
        return t(_substituted(v, parts) for v in value)
    if t is dict:
        return {k: _substituted(v, parts) for k, v in value.items()}
    return value


class _Parts(torch.autograd.Function):
    """The local parts of global tensors that need gradients; backward hands each its gradient as the global tensor
    of its gradient meta."""

    @staticmethod
    def forward(ctx, grad_metas, *tensors):
        ctx.grad_metas = grad_metas
        ctx.set_materialize_grads(False)  # a part no output reached gets no gradient, as on the dispatcher's path
        return tuple(t._local.view_as(t._local) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # (create_graph=True: the gradients below would not carry their own graph)
            raise RuntimeError(
                "a backward with create_graph=True through a unit run as plain PyTorch: its gradients would lose "
                "their second-order terms; set SBP_TORCH_PLAIN_UNITS=0 for double backward"
            )
        return (None, *(None if g is None else _gradient(g, m) for g, m in zip(grads, ctx.grad_metas)))


def _gradient(local: torch.Tensor, meta: GlobalMeta) -> GlobalTensor:
    """``local`` as the gradient part of ``meta``, whose strides say how the part lies in memory, as the
    dispatcher's do (a transposed part, from the backward of ``t()``: autograd then gives ``.grad`` the
    parameter's layout, as for a plain gradient)."""
    if not local.is_contiguous():
        meta = GlobalMeta(meta.shape, meta.dtype, meta.placement, meta.sbp, dense_strides(meta.shape, local.stride()))
    return GlobalTensor(local, meta)


class PlainCall:
    """What a learnt key runs: the unit's forward on the parts, its outputs wrapped as ``outputs``."""

    def __init__(self, spec, outputs: tuple, local_shapes: tuple, grad_metas: tuple):
        self.spec = spec  # the result's tree structure
        self.outputs = outputs  # per tensor output (tree order), its GlobalMeta
        self.local_shapes = local_shapes  # per tensor output, this rank's part shape
        self.grad_metas = grad_metas  # per global input (arguments, then slots): its gradient's meta, or None
        self.needing = tuple(i for i, m in enumerate(grad_metas) if m is not None)

    def run(self, unit: PlainUnit, args, kwargs, tensors: list, count: int):
        """The call on the parts of ``tensors`` (the global arguments, the first ``count``, then the slots')."""
        parts = [t._local for t in tensors]
        if self.needing and torch.is_grad_enabled():
            metas = tuple(self.grad_metas[i] for i in self.needing)
            for i, part in zip(self.needing, _Parts.apply(metas, *[tensors[i] for i in self.needing])):
                parts[i] = part
        local_args, local_kwargs = _substituted((args, kwargs), iter(parts[:count]))
        token = _ON_PARTS.set(_NOT_RECORDING)
        try:
            with outside_global_mode(), Swap(unit.slots, parts[count:]):
                result = unit.original(*local_args, **local_kwargs)
        finally:
            _ON_PARTS.reset(token)
        flat, spec = tree_flatten(result)
        if spec != self.spec:
            raise RuntimeError(
                f"{unit.what}: its forward returned {spec} run on the parts where it returned {self.spec} when "
                "learnt, for the same arguments' layouts and modes; it must return the same structure for them"
            )
        k = 0
        for i, value in enumerate(flat):
            if isinstance(value, torch.Tensor):
                meta = self.outputs[k]
                if tuple(value.shape) != self.local_shapes[k] or value.dtype != meta.dtype:
                    raise RuntimeError(
                        f"{unit.what}: output {k}'s part has shape {tuple(value.shape)} and dtype {value.dtype} run on "
                        f"the parts, where {self.local_shapes[k]} and {meta.dtype} were learnt"
                    )
                flat[i] = wrap_part(value, meta) if value.requires_grad else wrap_fresh(value, meta)
                k += 1
        return spec.unflatten(flat)


class _Pending:
    """A key learnt in the last call: it runs plain from the next call outside backward on (a forward recomputed in
    backward repeats the learning call, which took the dispatcher's path)."""

    def __init__(self, call: PlainCall):
        self.call = call


class _Replay(TorchDispatchMode):
    """Records (op, args, kwargs, result) of every aten op the replay dispatches, but ``detach`` and those of ops with
    no tensor argument (factories, compared by their values where used) and those inside ``opaque`` blocks."""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused or func is _DETACH:
            return out
        if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
            self.calls.append((func, args, kwargs or {}, out))
        return out


_NOT_RECORDING = _Replay()  # (what ``on_parts`` reads while a learnt key runs: nothing records)


class PlainUnit:
    """The forward of one unit: the dispatcher's path, or plain PyTorch on the parts for a learnt key."""

    def __init__(self, module: nn.Module, name: str):
        self.module, self.original = module, module.forward
        self.what = f"unit {name or '(root)'} ({type(module).__name__})"
        self.slots = [Slot(table, key) for _, _, table, key, _ in module_tensors(module)]
        self.modules = list(module.modules())
        self.learnt: OrderedDict = OrderedDict()  # key -> _SEEN, _REFUSED, _Pending or PlainCall, least recent first
        self.refusals: list[str] = []  # why the last keys refused stay on the dispatcher's path (the last 4)
        # The first global argument of each forward with grad that took the dispatcher's path for a key that may
        # run plain later: its recomputation in backward (activation checkpointing) takes that path again.
        self.dispatched: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def plain_keys(self) -> int:
        """How many of the keys it holds run as plain PyTorch."""
        return sum(type(e) is PlainCall for e in self.learnt.values())

    def __call__(self, *args, **kwargs):
        if (
            not ENABLED
            or torch.compiler.is_compiling()
            or comm.traced()
            or comm.observed()
            or _dispatch_modes()
            or _autocast()
        ):
            return self.original(*args, **kwargs)
        key = [torch.is_grad_enabled(), torch.get_default_dtype(), self._module_state()]
        tensors: list = []  # the global arguments, then the slots' tensors
        try:
            _describe((args, kwargs), key, tensors)
            count = len(tensors)
            for slot in self.slots:
                t = slot.get()
                if type(t) is not GlobalTensor:
                    raise _Unkeyable
                key.append((t._meta, t.requires_grad))
                tensors.append(t)
            key = tuple(key)
            entry = self.learnt.get(key)
        except (_Unkeyable, TypeError, KeyError):  # (an unhashable value; a slot removed since)
            return self.original(*args, **kwargs)
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and count and self.dispatched.get(id(tensors[0])) is tensors[0]:
            return self.original(*args, **kwargs)  # (a recomputation of a forward that took the dispatcher's path)
        if type(entry) is PlainCall:
            self.learnt.move_to_end(key)
            return entry.run(self, args, kwargs, tensors, count)
        if entry is _REFUSED or in_backward:
            return self.original(*args, **kwargs)
        if type(entry) is _Pending:
            self.learnt[key] = entry.call
            return entry.call.run(self, args, kwargs, tensors, count)
        if count and torch.is_grad_enabled():
            self.dispatched[id(tensors[0])] = tensors[0]
        if entry is None:
            self._remember(key, _SEEN)
            return self.original(*args, **kwargs)
        return self._learn(key, args, kwargs, tensors, count)

    def _module_state(self) -> tuple:
        """What the modules hold besides tensors that a forward may branch on: their attributes that are numbers,
        strings or None (``training``, a dropout's ``p``), and how many hooks they have."""
        state = [v for m in self.modules for v in m.__dict__.values() if type(v) in _ATOMS]
        state.append(sum(len(h) for m in self.modules for h in _hooks_of(m)))
        return tuple(state)

    def _remember(self, key, entry) -> None:
        self.learnt[key] = entry
        while len(self.learnt) > _KEYS_KEPT:
            self.learnt.popitem(last=False)

    def _refuse(self, key, reason: str) -> None:
        self.refusals.append(reason)
        del self.refusals[:-4]
        self._remember(key, _REFUSED)

    def _learn(self, key, args, kwargs, tensors: list, count: int):
        placement = tensors[0].placement if tensors else None
        if placement is None or any(t.placement != placement for t in tensors) or placement.local_coord() is None:
            self._refuse(key, "its tensors are on two placements, or this rank is outside its placement")
            return self.original(*args, **kwargs)
        versions = [t._version for t in tensors]
        attributes = [(m, dict(m.__dict__)) for m in self.modules]
        recorded, issued, notes = [], [], []
        token = _LEARNING.set(notes)
        try:
            with recording(recorded), comm.observing(lambda *collective: issued.append(collective)):
                result = self.original(*args, **kwargs)
        finally:
            _LEARNING.reset(token)
        call, reason = None, None
        try:
            reason = _why_dispatching(self.modules[1:], attributes, issued, notes)
            if reason is None and any(t._version != v for t, v in zip(tensors, versions)):
                reason = "it wrote into an argument, parameter or buffer"
            if reason is None:
                copies = {id(t): t._local.clone() for t in tensors}
                call = self._qualify(args, kwargs, tensors, count, copies, recorded, result)
        except Exception as err:  # noqa: BLE001 - learning must never fail a call that ran: it stays on the dispatcher
            reason = str(err) if isinstance(err, _Refused) else f"learning raised {err!r}"
        # Each rank decides on its own parts (a replay may raise, or a value differ, on one rank alone): the unit runs
        # plain only where every rank of its placement may, so that all take the same path and reduce alike.
        if not _everywhere(placement, call is not None, tensors[0]._local.device) and reason is None:
            reason = "another rank of its placement found it cannot run on its parts"
        if reason is None:
            self._remember(key, _Pending(call))
        else:
            self._refuse(key, reason)
        return result

    def _qualify(self, args, kwargs, tensors, count, copies, recorded, result) -> PlainCall:
        """The plain call learnt from the dispatcher's run (``recorded``, ``result``); raises ``_Refused``."""
        recorded = [call for call in recorded if call[0] is not _DETACH]
        for op, _, _, _, as_is, sizes_only in recorded:
            # (an op run as it was draws what the dispatcher's run drew, seeded or not: dropout with p=0, say)
            if not (as_is or sizes_only):
                raise _Refused(f"the dispatcher ran {op} otherwise than on the parts as they were")
        parts = {}  # id(global tensor) -> the plain tensor the replay had in its place
        for t in tensors:
            if id(t) not in parts:
                part = copies[id(t)]
                parts[id(t)] = part.requires_grad_() if t.requires_grad and part.is_floating_point() else part
        inputs = [parts[id(t)] for t in tensors]
        local_args, local_kwargs = _substituted((args, kwargs), iter(inputs[:count]))
        replay = _Replay()
        cuda = sorted({p.device.index or 0 for p in inputs if p.is_cuda})
        token = _ON_PARTS.set(replay)
        try:
            # (saved tensors kept to themselves: a checkpoint or a sharded model around counts what it saves)
            with torch.random.fork_rng(devices=cuda, device_type="cuda"), _kept_to_itself(), replay:
                with outside_global_mode(), Swap(self.slots, inputs[count:]):
                    local_result = self.original(*local_args, **local_kwargs)
        except Exception as err:  # noqa: BLE001 - the forward does not run on its parts: it stays on the dispatcher
            raise _Refused(f"its forward on the parts raised {type(err).__name__}: {err}") from err
        finally:
            _ON_PARTS.reset(token)
        if len(replay.calls) != len(recorded):
            raise _Refused(f"on the parts it dispatched {len(replay.calls)} ops, the dispatcher {len(recorded)}")
        for (op, g_args, g_kwargs, g_out, _, sizes_only), (local_op, l_args, l_kwargs, l_out) in zip(
            recorded, replay.calls
        ):
            if op is not local_op:
                raise _Refused(f"on the parts it dispatched {local_op} where the dispatcher had {op}")
            if not _same_arguments((g_args, g_kwargs), (l_args, l_kwargs), parts, sizes_only):
                raise _Refused(f"on the parts {op} had other arguments")
            if not _same_outputs(g_out, l_out, parts):
                raise _Refused(f"on the parts {op} gave another shape, strides or dtype")
        return self._outputs(tensors, count, parts, inputs, result, local_result)

    def _outputs(self, tensors, count, parts, inputs, result, local_result) -> PlainCall:
        flat, spec = tree_flatten(result)
        local_flat, local_spec = tree_flatten(local_result)
        if spec != local_spec:
            raise _Refused("on the parts it returned another structure")
        storages = {p.untyped_storage()._cdata for p in inputs}
        ids = {id(t) for t in tensors}
        outputs, shapes = [], []
        for g, local in zip(flat, local_flat):
            if not isinstance(g, torch.Tensor):
                if isinstance(local, torch.Tensor) or type(g) is not type(local) or not _equal(g, local):
                    raise _Refused("on the parts it returned other values")
                continue
            if (
                type(g) is not GlobalTensor
                or id(g) in ids
                or parts.get(id(g)) is not local
                or local.untyped_storage()._cdata in storages
            ):
                raise _Refused("an output is not a new global tensor whose part the plain run returned")
            outputs.append(g)
            shapes.append(tuple(g._local.shape))
        placement = tensors[0].placement
        divided = divided_axes(placement, [t.sbp for t in tensors] + [g.sbp for g in outputs])
        grad_metas = []
        needs_grad = torch.is_grad_enabled()
        for t in tensors:
            if needs_grad and t.requires_grad:
                try:
                    grad_metas.append(t._meta.with_sbp(input_gradient_sbp(t.sbp, divided, self.what)))
                except ValueError as err:  # partial where the unit computes per rank: no gradient of a part
                    raise _Refused(str(err)) from err
            else:
                grad_metas.append(None)
        for g in outputs:
            if g.requires_grad and any(divided[a] and isinstance(s, Broadcast) for a, s in enumerate(g.sbp)):
                raise _Refused(  # which rank's share would its gradient be?
                    f"an output needing a gradient is broadcast ({g.sbp}) where the unit computes per rank"
                )
        return PlainCall(spec, tuple(g._meta for g in outputs), tuple(shapes), tuple(grad_metas))


def _hooks_of(module: nn.Module) -> tuple:
    return (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)


def _ours(hook) -> bool:
    return (getattr(hook, "__module__", None) or "").startswith("sbp_torch.")


def _why_dispatching(inner: list, attributes: list, issued: list, notes: list) -> str | None:
    """Why a unit's dispatcher run keeps it there, from what the run did and what its modules hold; or None."""
    if issued:
        return f"it issued {len(issued)} collective(s), the first a {issued[0][0]}"
    if notes:
        return notes[0]
    if any(not _ours(h) for m in inner for hooks in _hooks_of(m) for h in hooks.values()):
        return "a module inside it has a hook, which would see plain parts"
    globals_ = torch.nn.modules.module
    if any(not _ours(h) for hooks in (globals_._global_forward_hooks, globals_._global_forward_pre_hooks)
           for h in hooks.values()):  # fmt: skip
        return "a global module hook is registered, which would see plain parts"
    for module, before in attributes:
        after = module.__dict__
        if after.keys() != before.keys() or any(after[k] is not v for k, v in before.items()):
            return f"its forward sets attributes of {type(module).__name__}, which would hold plain parts"
    return None


def _everywhere(placement, mine: bool, device) -> bool:
    """Whether ``mine`` holds on every rank of ``placement`` (one small all-reduce per axis)."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    for axis in range(placement.ndim):
        flag = comm.all_reduce(flag, "min", comm.axis_group(placement, axis))
    return bool(flag.item())


def _kept_to_itself():
    """Saved-tensor hooks that keep what autograd saves as it is, hiding it from any hooks outside."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(x):
    return x


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def _same_arguments(global_call, local_call, parts: dict, sizes_only: bool) -> bool:
    """Whether the replay's aten call had the dispatcher's arguments: each global tensor's part where it had one
    (an equal tensor where it had a global tensor it did not make, which joins ``parts``), equal plain tensors and
    equal other values; but sizes (lists of integers) where the dispatcher told the op its local ones, which the
    outputs' shapes then decide."""
    (g_args, g_kwargs), (l_args, l_kwargs) = global_call, local_call
    if len(g_args) != len(l_args) or g_kwargs.keys() != l_kwargs.keys():
        return False
    for g_value, l_value in zip([*g_args, *g_kwargs.values()], [*l_args, *l_kwargs.values()]):
        if sizes_only and _is_sizes(g_value) and _is_sizes(l_value):
            continue
        pairs = _paired_leaves(g_value, l_value)
        if pairs is None:
            return False
        for g, local in pairs:
            if isinstance(g, GlobalTensor):
                if id(g) in parts:
                    if parts[id(g)] is not local:
                        return False
                elif _same_tensor(g._local, local):
                    parts[id(g)] = local
                else:
                    return False
            elif isinstance(g, torch.Tensor):
                if not _same_tensor(g, local):
                    return False
            elif type(g) is not type(local) or g != local:
                return False
    return True


def _paired_leaves(a, b) -> list | None:
    """The leaves of ``a`` and ``b`` in pairs; None where their structures differ."""
    a_flat, a_spec = tree_flatten(a)
    b_flat, b_spec = tree_flatten(b)
    return list(zip(a_flat, b_flat)) if a_spec == b_spec else None


def _is_sizes(value) -> bool:
    return isinstance(value, (list, tuple, torch.Size)) and all(type(n) is int for n in value)


def _same_tensor(a: torch.Tensor, b) -> bool:
    return (
        type(b) is torch.Tensor
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and torch.equal(a, b)
    )


def _same_outputs(g_out, l_out, parts: dict) -> bool:
    """Whether the replay's op returned, where the dispatcher returned a global tensor, a plain tensor of its part's
    shape, strides and dtype (which then stands for it in ``parts``)."""
    pairs = _paired_leaves(g_out, l_out)
    if pairs is None:
        return False
    for g, local in pairs:
        if isinstance(g, GlobalTensor):
            part = g._local
            if not (
                isinstance(local, torch.Tensor)
                and local.shape == part.shape
                and local.stride() == part.stride()
                and local.dtype == part.dtype
            ):
                return False
            parts[id(g)] = local
    return True


def install_plain_units(model: nn.Module, names: list[str]) -> None:
    """Make the forward of each module of ``model`` named in ``names`` (the root excluded) a ``PlainUnit``, once."""
    modules = dict(model.named_modules())
    for name in dict.fromkeys(names):
        module = modules.get(name)
        if name and module is not None and not isinstance(module.__dict__.get("forward"), PlainUnit):
            module.forward = PlainUnit(module, name)


def plain_units_of(model: nn.Module) -> list[PlainUnit]:
    """The plain units installed in ``model``."""
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), PlainUnit)]
