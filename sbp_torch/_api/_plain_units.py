"""Units that run as plain PyTorch: a block whose layout needs no collective computes on the local parts.

A laid-out model's units (its blocks, ``default_units``, and the ``units`` given to ``Module.to_global``) are where
data parallelism, sharded or not, communicates: between them. Inside one, with the batch split and the weights
broadcast (or gathered), every op runs on the local parts as they are, and deciding each op again on global tensors
only costs the dispatcher's toll. FSDP2's blocks and DTensor's parallel styles compute on plain tensors there; a
unit does the same where it may prove it gives the dispatcher's result:

* A call is keyed by what decides its ops: each global argument's layout, shape and whether it requires grad, the
  other arguments by value, the unit's parameters' and buffers' layouts, grad mode, the training flags of its
  modules, the default dtype. An argument that is none of a global tensor, a number, a string, None, a dtype, a
  device or a list, tuple or dict of them (a plain tensor with dims; a key/value cache object, which the unit would
  fill with parts) keeps the call on the dispatcher's path.
* A key's first call takes the dispatcher's path. Its second is learnt: it takes the dispatcher's path, recording
  each aten op and observing each collective, and the unit's forward then runs again on copies of the local parts
  as plain PyTorch. The key runs as plain PyTorch from its next call outside backward on, if

  - no collective was issued and no argument, parameter or buffer was written into;
  - the dispatcher ran every op on the parts as they were (a view or ``expand`` told its local sizes included; a
    random op the dispatcher runs otherwise, to draw the logical tensor's numbers, so it stays there);
  - the plain run dispatched the same aten ops with the same arguments: each global tensor's part where the
    dispatcher had the global tensor, an equal part where it had a global tensor it did not make itself (a
    factory's value under global mode, a region's output), the same sizes after a view; so it read no value either
    (the dispatcher would not have run that op as it was);
  - the outputs are new global tensors whose parts the plain run returned, beside the same other values;
  - the gradients follow from the parts as in a ``local_map`` region: on a placement axis where the unit computes
    per rank (something split or partial there), no input that needs a gradient is partial and no floating output
    that needs one is broadcast.

* Run plain, the unit's forward sees its arguments', parameters' and buffers' local parts as plain tensors, outside
  global mode, and its outputs are wrapped as learnt. Gradients reach the global tensors as a region's do: a split
  input's split, a broadcast one's partial(sum) on an axis where the unit computes per rank, broadcast elsewhere;
  ``Module.to_global``'s gradient reduction and a sharded model's reduce-scatter take them as any other. An experts
  module inside runs its own forward on its rows (its data-parallel case) and reaches every expert's parameters, as
  its region does, so every rank reduces the same gradients.

The plain path is never taken while torch.compile or ``compile_step`` traces, while ``explain`` or the planner
estimate, under a torch dispatch mode or autocast, on a rank outside the placement, or in backward for a key not
yet run plain in a forward (a recomputed forward takes its first run's path). ``SBP_TORCH_PLAIN_UNITS=0`` turns it
off. ``explain`` traces the dispatcher's path, so it lists every collective whichever path runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

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
_dispatch_modes = torch._C._len_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled


def on_parts() -> bool:
    """Whether the running code is a plain unit's body on local parts."""
    return _ON_PARTS.get() is not None


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
    elif t is list or t is tuple:
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
    if t is list or t is tuple:
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
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not self.paused and func is not _DETACH and tensors:
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
        self.learnt: dict = {}
        self.refusals: list[str] = []  # why the last keys refused stay on the dispatcher's path (the last 4)

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
        key = [torch.is_grad_enabled(), torch.get_default_dtype(), tuple(m.training for m in self.modules)]
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
        except (_Unkeyable, TypeError):  # (TypeError: an unhashable value)
            return self.original(*args, **kwargs)
        if type(entry) is PlainCall:
            return entry.run(self, args, kwargs, tensors, count)
        if entry is _REFUSED or torch._C._current_graph_task_id() != -1:
            return self.original(*args, **kwargs)
        if entry is None:
            self._remember(key, _SEEN)
            return self.original(*args, **kwargs)
        if type(entry) is _Pending:
            self.learnt[key] = entry.call
            return entry.call.run(self, args, kwargs, tensors, count)
        return self._learn(key, args, kwargs, tensors, count)

    def _remember(self, key, entry) -> None:
        self.learnt[key] = entry
        while len(self.learnt) > _KEYS_KEPT:
            del self.learnt[next(iter(self.learnt))]

    def _learn(self, key, args, kwargs, tensors: list, count: int):
        placements = {t.placement for t in tensors}
        if len(placements) != 1 or next(iter(placements)).local_coord() is None:
            self.refusals.append("its tensors are on two placements, or this rank is outside its placement")
            self._remember(key, _REFUSED)
            return self.original(*args, **kwargs)
        copies = {id(t): t._local.clone() for t in tensors}  # (before the dispatcher's run, which may write)
        versions = [t._version for t in tensors]
        recorded, issued = [], []
        with recording(recorded), comm.observing(lambda *collective: issued.append(collective)):
            result = self.original(*args, **kwargs)
        try:
            if issued:
                raise _Refused(f"it issued {len(issued)} collective(s), the first a {issued[0][0]}")
            if any(t._version != v for t, v in zip(tensors, versions)):
                raise _Refused("it wrote into an argument, parameter or buffer")
            entry = _Pending(self._qualify(args, kwargs, tensors, count, copies, recorded, result))
        except Exception as err:  # noqa: BLE001 - learning must never fail a call that ran: it stays on the dispatcher
            entry = _REFUSED
            self.refusals.append(str(err) if isinstance(err, _Refused) else f"learning raised {err!r}")
            del self.refusals[:-4]
        self._remember(key, entry)
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
        g_flat, g_spec = tree_flatten(g_value)
        l_flat, l_spec = tree_flatten(l_value)
        if g_spec != l_spec:
            return False
        for g, local in zip(g_flat, l_flat):
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
    g_flat, g_spec = tree_flatten(g_out)
    l_flat, l_spec = tree_flatten(l_out)
    if g_spec != l_spec:
        return False
    for g, local in zip(g_flat, l_flat):
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
