"""``compile_step``: a whole training step traced once into one program on this rank's parts, then compiled.

A step (forward, loss, backward, ``optimizer.step()``) on global tensors is traced by ``make_fx`` on fake parts:
every op goes through the dispatcher once, which leaves the local ops and the collectives it decided, and nothing
of sbp_torch, in the graph. The graph's inputs are plain tensors, in a fixed order:

* the learning rate of each parameter group of an optimizer that takes a tensor one (``_TENSOR_LR``: Adam, AdamW,
  ...), as a 0-dim tensor, so a scheduler changes it without a new trace;
* the *state*: each parameter's part, its gradient's part, each module buffer and each optimizer state entry
  (a global one's part, a plain one itself);
* the tensors among the step's arguments (a global one's part).

The program updates the state in place (the optimizer's writes, and gradients copied into the tensors that held
them on entry), so later calls pass the same tensors at the same addresses: per call, the step checks that the
state is still held by the same tensors (else by tensors of the same forms, which it then passes), reads the
key of the traced program (the arguments' metadata, modes and flags, the optimizer's hyperparameters), fills
the learning rates and runs the compiled program. No global tensor, guard or dispatch runs per parameter.

A new key traces again; the first call of all runs eagerly, so that the optimizer creates its state and the
model its gradients before the trace sees them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import pathlib
import sysconfig
import traceback
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain, count, repeat
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .. import _comm as comm
from .._layout import ValueDependentShape, device_draws_refused
from .._tensor import GlobalTensor
from . import _step_graph as step_graph
from ._gradient_reducer import drop_pending_reductions
from ._module_tensors import Swap

# The optimizers whose capturable arithmetic takes a tensor learning rate (the others read it as a number)
_TENSOR_LR = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_TRACES_PER_STEP = 16  # a step traced more often than this is re-laid out every call: refused, not slowed down
_KEYS_KEPT = 8  # traced programs kept per step (one per argument shape, in a loop with a few)
_MADE = count()  # steps made so far in this process: each rank makes its steps in the same order
_PORTABLE = (bool, int, float, complex, str, type(None))  # values whose pickle means the same on every rank
_TORCH_RELEASE = tuple(int(n) for n in torch.__version__.split(".")[:2])
_grad_of = torch._C.TensorBase.grad.__get__
_training = operator.attrgetter("training")
_local_of = operator.attrgetter("_local")
_requires_grad = operator.attrgetter("requires_grad")
_set_grad = torch._C.TensorBase.grad.__set__


class StepNotTraceable(RuntimeError):
    """``compile_step`` cannot trace the step as one program; the message says what it met."""


class StepKey(NamedTuple):
    """What a traced program depends on, beside the forms of the tensors holding the state: a program runs for the
    key it was traced for (``CompiledStep.__call__``)."""

    nesting: Any  # the arguments' pytree spec (or their count, for a flat call of tensors)
    arguments: tuple  # per argument leaf, ``_describe``
    grad_mode: bool
    autocast: tuple  # ``_autocast()``: autocast per device and the default dtype
    training: tuple  # each module's training flag
    requires_grad: tuple  # which parameters require grad
    no_grads: tuple  # which gradients are None
    hyperparameters: tuple  # the optimizers' hyperparameters but the lifted learning rates
    peers: tuple | None  # every rank's arguments but the global ones, once a program was laid out on them

    def differences(self, other: StepKey) -> str | None:
        """The parts in which two keys differ, in words (None: in none)."""
        changed = [_KEY_PARTS[name] for name, a, b in zip(self._fields, self, other) if a != b]
        return " and ".join(changed) or None


# What each part of a StepKey is, in words (messages that say what changed)
_KEY_PARTS = {
    "nesting": "the arguments' nesting",
    "arguments": "the arguments' shapes, dtypes, layouts or values",
    "grad_mode": "grad mode",
    "autocast": "autocast or the default dtype",
    "training": "a module's training flag",
    "requires_grad": "which parameters require grad",
    "no_grads": "which gradients are None",
    "hyperparameters": "the optimizer's hyperparameters",
    "peers": "the ranks' arguments",
}


class _StateKey(NamedTuple):
    """Where an optimizer keeps one state tensor: ``optimizer.state[param][name]``."""

    param: Any
    name: str


class _Holder(NamedTuple):
    """Where one state tensor is kept: ``kind`` "part" (a parameter's ``_local``), "grad" (its ``.grad``), "buffer"
    (``owner[key]``, a module's buffers) or "state" (``owner.state[p][name]`` of an optimizer, ``key`` a ``_StateKey``:
    read through the optimizer, so a state dict created after the trace is the one written)."""

    kind: str
    owner: Any
    key: Any = None

    def get(self):
        if self.kind == "part":
            return self.owner._local
        if self.kind == "grad":
            with torch._C.DisableTorchFunctionSubclass():  # (no Python entry per parameter)
                return _grad_of(self.owner)
        if self.kind == "state":
            state = self.owner.state.get(self.key.param)
            return None if state is None else state.get(self.key.name)
        return self.owner.get(self.key)

    def set(self, value) -> None:
        if self.kind == "part":
            self.owner._local = value
        elif self.kind == "grad":
            with torch._C.DisableTorchFunctionSubclass():
                _set_grad(self.owner, value)
        elif self.kind == "state":
            if value is not None:
                self.owner.state[self.key.param][self.key.name] = value
            elif self.key.param in self.owner.state:
                self.owner.state[self.key.param].pop(self.key.name, None)
        elif value is None:
            self.owner.pop(self.key, None)
        else:
            self.owner[self.key] = value


def _part(value):
    return value._local if isinstance(value, GlobalTensor) else value


def _rewrap(value, like):
    """``value`` (a part) in the form ``like`` held it: a global tensor of ``like``'s metadata, or itself."""
    return GlobalTensor(value, like._meta) if isinstance(like, GlobalTensor) else value


def _same_form(a, b) -> bool:
    """Whether ``b`` can be copied into ``a`` in place, leaving ``a``'s holder as it is."""
    if isinstance(a, GlobalTensor) != isinstance(b, GlobalTensor):
        return False
    if isinstance(a, GlobalTensor) and a._meta != b._meta:
        return False
    pa, pb = _part(a), _part(b)
    return pa.shape == pb.shape and pa.dtype == pb.dtype and pa.device == pb.device


@dataclasses.dataclass
class _Outcome:
    """What the traced step left for its program's runtime (set while ``make_fx`` traces it): the results' nesting,
    each result leaf's form (``_form``), and the holders that take a new value per call (``_write_back``)."""

    results: pytree.TreeSpec | None = None
    forms: list = dataclasses.field(default_factory=list)
    writes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Program:
    """One traced and compiled step, for one key."""

    run: Callable
    held: list  # ``CompiledStep._held()`` when last run: checked per call, by identity, else by form
    forms: list  # the form of each of ``held`` (``_form_of``)
    state: list  # the state's parts, the program's inputs after the learning rates
    holders: list  # the holders of ``state``, in its order
    results: pytree.TreeSpec
    result_forms: list  # per result leaf: a GlobalTensor's metadata, "plain", or ("constant", value)
    writes: list  # (holder, form): holders given a new value per call (no tensor held it on entry to copy into)
    number: int  # the step's traces when it was traced: the same program on every rank has the same number


class CompiledStep:
    """A step function traced once per key into one program on the local parts (see ``compile_step``)."""

    def __init__(self, fn, models: list[nn.Module], optimizers: list[torch.optim.Optimizer], backend, cuda_graphs):
        self.fn, self.models, self.optimizers, self.backend = fn, models, optimizers, backend
        self.cuda_graphs, self.graph_pool = cuda_graphs, None
        self._collect()
        if cuda_graphs:
            step_graph.keep_step_counts_on_the_device(optimizers)
        self.programs: OrderedDict = OrderedDict()
        self.lr_tensors: list[torch.Tensor] = []
        self.traces = 0
        self.called = False
        self.peers_in_key = False  # whether a program was traced on metadata agreed with the other ranks
        self.number = next(_MADE)
        self.name = f"step #{self.number} ({getattr(fn, '__qualname__', type(fn).__name__)})"
        self.calls = 0  # calls so far, the first (eager) one included: counted alike on every rank
        self.last_run = 0  # the number of the program the last call ran
        if dist.get_world_size() > 1:
            comm.announce_step(self.number, self.name)

    # -- what the state is ---------------------------------------------------------------------------------------
    def _collect(self) -> None:
        """The modules, parameters and buffer dicts of the models: when the step is made, and again after its first
        (eager) call, which may register more (lazy modules, caches)."""
        self.params = list(dict.fromkeys(p for m in self.models for p in m.parameters()))
        plain = [p for p in self.params if not isinstance(p, GlobalTensor)]
        if plain:
            raise TypeError(
                f"compile_step: {len(plain)} parameter(s) of the model are plain tensors; lay the whole model out "
                "with Module.to_global first (a plain parameter has no part to trace)"
            )
        self.modules = [m for model in self.models for m in model.modules()]
        self.buffer_dicts = [m._buffers for m in self.modules]  # (empty ones too: a buffer may come later)

    def _held(self) -> tuple[list, tuple]:
        """Everything the state's holders hold, in a fixed order: each parameter's part, each gradient and its
        part, each buffer and optimizer state value (numbers too) and, for a global one, its part. Built by list
        operations, with no dispatch: the per-call check that a program still fits the state. And which gradients
        are None (part of the key: gradients accumulate into tensors, or start from none)."""
        params = self.params
        held = list(map(_local_of, params))
        with torch._C.DisableTorchFunctionSubclass():
            grads = list(map(_grad_of, params))
        held += grads
        held += map(getattr, grads, repeat("_local"), grads)  # (C-level loops: this runs every call)
        values = list(chain.from_iterable(map(dict.values, self.buffer_dicts)))
        names = list(chain.from_iterable(map(dict.keys, self.buffer_dicts)))
        for optimizer in self.optimizers:
            values += chain.from_iterable(map(dict.values, optimizer.state.values()))
            names += chain.from_iterable(map(dict.keys, optimizer.state.values()))
        held += names  # (a value under another name is another holder)
        held += values
        held += map(getattr, values, repeat("_local"), values)  # (a global value's part may change: transpose_)
        return held, tuple(g is None for g in grads)

    def _holders(self) -> list[_Holder]:
        holders = [_Holder("part", p) for p in self.params]
        holders += [_Holder("grad", p) for p in self.params]
        for buffers in self.buffer_dicts:
            holders += [_Holder("buffer", buffers, k) for k, v in buffers.items() if isinstance(v, torch.Tensor)]
        for optimizer in self.optimizers:
            for p in self.params:
                state = optimizer.state.get(p)
                if state:
                    holders += [
                        _Holder("state", optimizer, _StateKey(p, k))
                        for k, v in state.items()
                        if isinstance(v, torch.Tensor)
                    ]
        return holders

    def _groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def _lifted(self) -> list[dict]:
        """The groups whose learning rate is an input of the program: those of the optimizers whose capturable
        arithmetic takes a tensor learning rate (``_TENSOR_LR``); other optimizers' is part of the key."""
        return [g for o in self.optimizers if isinstance(o, _TENSOR_LR) for g in o.param_groups]

    def _hyperparameters(self) -> tuple:
        key = []
        for optimizer in self.optimizers:
            lifted = isinstance(optimizer, _TENSOR_LR)
            for group in optimizer.param_groups:
                for name, value in group.items():
                    if name == "params" or (name == "lr" and lifted):
                        continue
                    if isinstance(value, torch.Tensor):
                        raise StepNotTraceable(
                            f"compile_step: the {type(optimizer).__name__} optimizer's {name!r} is a tensor; a "
                            "tensor hyperparameter is taken only as the learning rate of "
                            f"{', '.join(c.__name__ for c in _TENSOR_LR)}"
                        )
                    key.append((name, tuple(value) if isinstance(value, list) else value))
        return tuple(key)

    def reset(self) -> None:
        """Forget the traced programs: the next call traces again. For a change the key does not see (see
        ``compile_step``); every rank must call it at the same point."""
        self.programs.clear()

    # -- calling --------------------------------------------------------------------------------------------------
    @torch.compiler.disable  # (inside a compiled function, the step runs as it is: its own program)
    def __call__(self, *args, **kwargs):
        if not self.called:  # the optimizer's state and the gradients appear here, before any trace
            result = self.fn(*args, **kwargs)
            self.called, self.calls = True, 1
            self._collect()
            return result
        if self.cuda_graphs and not all(g.get("capturable", True) for g in self._groups()):
            step_graph.keep_step_counts_on_the_device(self.optimizers)  # (a loaded state dict set it back)
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # (the common call, without pytree)
            leaves, spec = args, len(args)
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
        held, no_grads = self._held()
        with torch._C.DisableTorchFunctionSubclass():
            frozen = tuple(map(_requires_grad, self.params))
        described = tuple(_describe(leaf) for leaf in leaves)
        key = StepKey(
            nesting=spec,
            arguments=described,
            grad_mode=torch.is_grad_enabled(),
            autocast=_autocast(),
            training=tuple(map(_training, self.modules)),
            requires_grad=frozen,
            no_grads=no_grads,
            hyperparameters=self._hyperparameters(),
            peers=self._peer_arguments(described) if self.peers_in_key else None,
        )
        program = self.programs.get(key)
        if program is not None and not _same_state(held, program):
            program = None
        self.calls += 1
        shared, call, held_one = dist.get_world_size() > 1, self.calls, program is not None
        if shared:
            comm.announce_call(self.number, call, program.number if held_one else 0)
        if not held_one:
            if shared:
                self._refuse_a_lone_trace(key, call)
            holders = self._holders()
            program = self._trace(key, leaves, spec, holders, [h.get() for h in holders], held)
        else:
            self.programs.move_to_end(key)
        lrs = []
        for group, tensor in zip(self._lifted(), self.lr_tensors):
            lr = group["lr"]
            tensor.copy_(lr) if isinstance(lr, torch.Tensor) else tensor.fill_(lr)  # (the traced dtype and device)
            lrs.append(tensor)
        inputs = [_part(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
        try:
            outputs = program.run(*lrs, *program.state, *inputs)
        except Exception as err:
            if shared and comm.posted_failures():  # (their collectives failed here: say why)
                raise comm.collective_failed(f"compile_step, {self.name}: a collective of its program", err) from err
            if shared:  # this rank's failure: posted, its groups closed, so that no rank waits for it
                comm.local_failure(f"compile_step's program ({self.name})", err)
            raise
        if shared and held_one and program.number != self.last_run:  # (see _refuse_other_programs)
            self._refuse_other_programs(key, program, call)
        self.last_run = program.number
        count = len(program.result_forms)
        values = iter(outputs[count:])
        for holder, form in program.writes:
            holder.set(None if form is None else next(values) if form == "plain" else GlobalTensor(next(values), form))
        return _results(program, outputs[:count])

    def _peer_arguments(self, described: tuple) -> tuple | None:
        """Every rank's arguments but the global ones (plain tensors and values: what may differ between ranks),
        exchanged: a rank whose arguments change alone must neither trace alone nor run a program laid out on what
        the ranks agreed of their old ones (docs/compile.md)."""
        if dist.get_world_size() == 1:
            return None
        # (a value other than a number or string goes by its type's name and repr, which every rank can read)
        mine = [
            d if d[0] == "plain" or isinstance(d[2], _PORTABLE) else (d[1].__qualname__, repr(d[2]))
            for d in described
            if d[0] != "global"
        ]
        return comm.step_arguments(self.name, tuple(mine))

    def _refuse_a_lone_trace(self, key: StepKey, call: int) -> None:
        """Raise on every rank where this one would trace alone (``comm.refuse_a_lone_trace``)."""
        comm.refuse_a_lone_trace(self.number, call, self.name, lambda: _what_changed(key, self.programs))

    def _refuse_other_programs(self, key: StepKey, program: _Program, call: int) -> None:
        """Raise where the ranks this one ran with ran other programs (``comm.refuse_other_programs``)."""

        def why(number: int) -> str:
            theirs = next((k for k, p in self.programs.items() if p.number == number), None)
            return f"its key differs from this one's in {key.differences(theirs)}" if theirs else "not held here"

        comm.refuse_other_programs(self.number, call, self.name, program.number, why)

    def _trace(self, key, leaves, spec, holders, values, held) -> _Program:
        self.traces += 1
        groups = self._lifted()
        device = self.params[0]._local.device if self.params else torch.device("cpu")
        while len(self.lr_tensors) < len(groups):
            self.lr_tensors.append(torch.zeros((), dtype=torch.float64, device=device))
        present = [(h, v) for h, v in zip(holders, values) if v is not None]
        arg_leaves = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        outcome = _Outcome()

        def program(*flat):
            lrs, rest = flat[: len(groups)], flat[len(groups) :]
            state, inputs = rest[: len(present)], rest[len(present) :]
            for (holder, value), part in zip(present, state):
                holder.set(part if holder.kind == "part" else _rewrap(part, value))
            for group, lr in zip(groups, lrs):  # (capturable: its arithmetic on tensors, no read of the step count)
                group["lr"], group["capturable"] = lr, True
            parts = iter(inputs)
            rebuilt = [_rewrap(next(parts), leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            call_args, call_kwargs = (rebuilt, {}) if isinstance(spec, int) else pytree.tree_unflatten(rebuilt, spec)
            versions = [lr._version for lr in lrs]
            result = self.fn(*call_args, **call_kwargs)
            if [lr._version for lr in lrs] != versions or any(g["lr"] is not lr for g, lr in zip(groups, lrs)):
                raise StepNotTraceable(
                    "compile_step: the step sets the learning rate (a scheduler's step() inside it?); the program "
                    "reads it from the parameter group at each call: change it outside the step"
                )
            result_leaves, outcome.results = pytree.tree_flatten(result)
            outcome.forms = [_form(leaf) for leaf in result_leaves]
            returned = [_part(leaf) for leaf in result_leaves if isinstance(leaf, torch.Tensor)]
            return returned + _write_back(present, state, self._holders(), outcome)

        examples = [*self.lr_tensors[: len(groups)], *[_part(v) for _, v in present], *map(_part, arg_leaves)]
        gm, run, failure = None, None, None
        try:
            _refuse_before_tracing(self.traces, arg_leaves)
            with _restored(self, holders), comm.tracing_program() as agreed, device_draws_refused():
                gm = make_fx(program, tracing_mode="fake", decomposition_table=_decompositions(self.backend))(*examples)
            comm.bucket_collectives(gm)  # (one round trip per bucket, not per gradient: eager's reducer does too)
            if self.cuda_graphs:  # (before the backend's compilation, the long part)
                _refuse(step_graph.refusal_of_program(comm.holds_collectives(gm)))
                _refuse(step_graph.refusal_of_inputs(examples, [_part(a) for a in arg_leaves]))
            with _compiler_settings(self.backend):
                run = _compiled(self.backend, gm)
            if self.cuda_graphs:
                if self.graph_pool is None:  # (one pool for the step's programs: they replay one at a time)
                    self.graph_pool = torch.cuda.graph_pool_handle()
                run = step_graph.GraphedProgram(run, len(groups) + len(present), self.graph_pool)
        except Exception as err:  # noqa: BLE001 - every cause is reported the same way, with its chain
            failure = err
            drop_pending_reductions()  # (a backward that stopped midway left its buckets)
        # every rank learns whether some rank could not trace, so none waits for the others' program
        why = None if failure is None else str(failure) if isinstance(failure, StepNotTraceable) else _why_not(failure)
        failed = comm.check_program(gm, "compile_step's program", failed=why)
        if failed or failure is not None:
            raise StepNotTraceable(why or failed) from failure
        if agreed and not self.peers_in_key:  # (alike on every rank: agreeing takes them all)
            self.peers_in_key = True
            key = key._replace(peers=self._peer_arguments(key.arguments))  # (what was agreed: the parts held now)
        forms = [_form_of(v) for v in held]
        state, order = [_part(v) for _, v in present], [h for h, _ in present]
        compiled = _Program(run, held, forms, state, order, outcome.results, outcome.forms, outcome.writes, self.traces)
        self.programs[key] = compiled
        self.programs.move_to_end(key)
        while len(self.programs) > _KEYS_KEPT:
            self.programs.popitem(last=False)
        return compiled


def _what_changed(key: StepKey, programs: OrderedDict) -> str:
    """What differs between ``key``, for which this rank traces, and the program it ran last, in words."""
    if key in programs:
        return "the forms of the tensors holding the state (parameters, gradients, buffers, optimizer state) changed"
    if not programs:
        return "no program is held: reset() was called"
    changed = key.differences(next(reversed(programs)))
    if changed is None:
        return "the program for this key was dropped: reset() was called, or the step met more keys than it keeps"
    return changed + " changed"


def _refuse(why: str | None) -> None:
    if why is not None:
        raise StepNotTraceable(why)


def _refuse_before_tracing(traces: int, arg_leaves: list) -> None:
    """Raise what refuses a trace before it starts (inside the exchange that tells the other ranks)."""
    if traces > _TRACES_PER_STEP:
        raise StepNotTraceable(
            f"compile_step traced this step {traces - 1} times: its arguments' shapes or layouts, the optimizer's "
            "hyperparameters, or the forms of the tensors holding the state change from call to call"
        )
    if any(leaf.requires_grad for leaf in arg_leaves):
        raise StepNotTraceable(
            "compile_step: an argument of the step requires grad; the program would not give it a gradient (only "
            "the model's parameters get theirs): detach it, or make it a parameter"
        )


def _same_state(held: list, program: _Program) -> bool:
    """Whether ``program`` fits the state ``held``: the tensors it last ran on (the common call), or tensors of the
    same forms and equal numbers (an optimizer's number is a constant of the program), which it then runs on."""
    if len(held) == len(program.held) and all(map(operator.is_, held, program.held)):
        return True
    if [_form_of(v) for v in held] != program.forms:
        return False
    state = [_part(v) for v in (h.get() for h in program.holders) if v is not None]
    if len(state) != len(program.holders):
        return False
    program.held, program.state = held, state
    return True


def _form_of(value):
    """What a program depends on of a value the state holds: a tensor's metadata, a number's value."""
    if isinstance(value, GlobalTensor):
        return ("global", value._meta)
    if isinstance(value, torch.Tensor):
        return ("plain", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return ("value", type(value), value)


def _autocast() -> tuple:
    """The autocast state a traced program depends on (and the default dtype, which factories read)."""
    dtype = torch.get_default_dtype()
    if not torch._C._is_any_autocast_enabled():
        return (dtype,)
    return (dtype, *((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


def _describe(leaf):
    """What of an argument the traced program depends on."""
    if isinstance(leaf, GlobalTensor):
        return ("global", leaf._meta, tuple(leaf._local.shape), tuple(leaf._local.stride()), leaf.requires_grad)
    if isinstance(leaf, torch.Tensor):
        return ("plain", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        raise StepNotTraceable(
            f"compile_step: an argument of type {type(leaf).__name__} is neither a tensor nor hashable; the "
            "program is traced for the values of its other arguments"
        ) from None
    return ("value", type(leaf), leaf)


def _form(leaf):
    if isinstance(leaf, GlobalTensor):
        return leaf._meta
    if isinstance(leaf, torch.Tensor):
        return "plain"
    if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        # a number read from a tensor while tracing: as a constant, every call would return the traced one
        raise StepNotTraceable(
            "compile_step could not trace the step as one program: the step reads a value (item(), float(), "
            "tolist()) and returns it: return the tensor instead, and read it after the call"
        )
    return ("constant", leaf)


def _results(program: _Program, values) -> Any:
    values = iter(values)
    leaves = []
    for form in program.result_forms:
        if isinstance(form, tuple):
            leaves.append(form[1])
        elif form == "plain":
            leaves.append(next(values))
        else:
            leaves.append(GlobalTensor(next(values), form))
    return pytree.tree_unflatten(leaves, program.results)


def _write_back(present, state, holders_after, outcome: _Outcome) -> list:
    """In the traced program, after the step: copy each state value the step replaced into the tensor that held
    it on entry, where the forms agree; return the values that need a holder of their own. ``outcome.writes``
    says whose, and in what form (a metadata, "plain", or None for a value removed); the runtime sets them."""
    entry = {(h.kind, id(h.owner), h.key): (h, v, part) for (h, v), part in zip(present, state)}
    writes, returned, seen = [], [], set()
    for holder in holders_after:
        ident = (holder.kind, id(holder.owner), holder.key)
        seen.add(ident)
        now = holder.get()
        if now is None:
            continue
        if ident in entry:
            _, was, part = entry[ident]
            if _part(now) is part:
                continue
            if holder.kind == "part" or _same_form(was, now):
                part.copy_(_part(now))
                continue
        writes.append((holder, now._meta if isinstance(now, GlobalTensor) else "plain"))
        returned.append(_part(now))
    writes += [(h, None) for ident, (h, _, _) in entry.items() if ident not in seen or h.get() is None]
    outcome.writes = writes
    return returned


@contextlib.contextmanager
def _restored(step: CompiledStep, holders):
    """Put back every parameter's part and gradient, parameter group, buffer and state dict as it was before the
    trace."""
    groups = [dict(g) for g in step._groups()]
    states = [{p: dict(o.state[p]) for p in step.params if p in o.state} for o in step.optimizers]
    buffers = [dict(b) for b in step.buffer_dicts]
    parts_and_grads = Swap(h for h in holders if h.kind in ("part", "grad"))
    try:
        parts_and_grads.put()
        yield
        changed = _numbers_changed(step, groups, states)
        if changed:
            raise StepNotTraceable(
                f"compile_step: the step changes {changed}, a number the optimizer keeps in Python; a traced program "
                "would keep the traced value. Keep it in a tensor, or run the step eagerly"
            )
    finally:
        for group, saved in zip(step._groups(), groups):
            group.clear()
            group.update(saved)
        for optimizer, saved in zip(step.optimizers, states):
            for p in step.params:
                if p in saved:
                    optimizer.state[p].clear()
                    optimizer.state[p].update(saved[p])
                else:
                    optimizer.state.pop(p, None)
        for live, saved in zip(step.buffer_dicts, buffers):
            live.clear()
            live.update(saved)
        parts_and_grads.put_back()


def _numbers_changed(step: CompiledStep, groups: list, states: list) -> str | None:
    """The first number (not a tensor) of a parameter group or optimizer state that the traced step changed."""
    lifted = {id(g) for g in step._lifted()}
    for group, saved in zip(step._groups(), groups):
        for name in set(group) | set(saved):
            if name == "params" or (id(group) in lifted and name in ("lr", "capturable")):
                continue
            now, was = group.get(name), saved.get(name)
            if not isinstance(now, torch.Tensor) and not isinstance(was, torch.Tensor) and now != was:
                return f"the parameter group's {name!r} ({was} to {now})"
    for optimizer, saved in zip(step.optimizers, states):
        for p in step.params:
            now, was = optimizer.state.get(p, {}), saved.get(p, {})
            for name in set(now) | set(was):
                a, b = now.get(name), was.get(name)
                if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a != b:
                    return f"the optimizer state's {name!r} ({b} to {a})"
    return None


def _why_not(err: Exception) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    if "FakeTensor" in text or "non-fake" in text.lower():
        hint = (
            "the step reads a tensor that is neither one of its arguments, nor a parameter or buffer of the model, "
            "nor optimizer state: pass it as an argument"
        )
    elif isinstance(err, ValueDependentShape):
        hint = str(err)
        text = None
    elif any(name in text for name in ("data-dependent", "DataDependent", "DynamicOutputShape")):
        hint = (
            "the step, or its optimizer, reads a tensor's value as a number (item(), bool(), tolist(), a branch on "
            "a tensor, an op whose output size the trace cannot carry as a symbol, an optimizer that takes its step "
            "count or a tensor learning rate as a number): keep the value in a tensor, return it from the step, or "
            "run the step eagerly"
        )
    else:
        hint = "run the step eagerly, or under torch.compile, which breaks the graph where it must"
    where = _where(err)
    return f"compile_step could not trace the step as one program: {hint}{where}" + (f". ({text})" if text else "")


# Where frames are machinery, not the code that read a value: torch, sbp_torch and Python's own library
_MACHINERY = (str(pathlib.Path(torch.__file__).parent) + os.sep, str(pathlib.Path(__file__).parents[1]) + os.sep)
_LIBRARY = sysconfig.get_paths()["stdlib"] + os.sep


def _machinery(path: str) -> bool:
    library = path.startswith(_LIBRARY) and "-packages" + os.sep not in path
    return library or path.startswith(_MACHINERY) or path.startswith("<")


def _where(err: BaseException) -> str:
    """``", at file:line in function: source"``: the innermost frame of the traceback of ``err`` (or of what
    caused it) in the step's or the model's code, not in torch's or sbp_torch's; "" if there is none."""
    found = None
    while err is not None and found is None:
        for frame in traceback.extract_tb(err.__traceback__):
            if not _machinery(frame.filename):
                found = frame
        err = err.__cause__ or err.__context__
    if found is None:
        return ""
    source = f": {found.line.strip()}" if found.line else ""
    return f", at {pathlib.Path(found.filename).name}:{found.lineno} in {found.name}{source}"


def _compiled(backend, gm):
    """``gm`` compiled by ``backend``, shown the trace's own fake inputs and shape environment, as Dynamo shows a
    backend its graphs: sizes the trace left as symbols of the data (rows routed to experts) stay symbols."""
    fakes = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
    with tracing(TracingContext(detect_fake_mode(fakes))):
        return _backend(backend)(gm, fakes)


def _decompositions(backend) -> dict:
    """The decompositions the backend applies to a program, applied while it is traced: a view the trace records
    must be legal on the strides the backend's own decompositions give (Inductor's ``cat`` of an empty and a
    non-contiguous tensor keeps the latter's strides where torch's kernel makes it contiguous), as Dynamo traces a
    program for Inductor with Inductor's decompositions."""
    if backend != "inductor":
        return {}
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _backend(backend):
    if callable(backend):
        return backend
    if backend is None:
        return lambda gm, examples: gm
    import torch._dynamo  # (its registry of backends)

    return torch._dynamo.lookup_backend(backend)


def _compiler_settings(backend):
    """The traced program already holds the gradient buckets the reducer formed: Inductor's bucketing passes, which
    group collectives by their sizes (which differ between ranks holding uneven parts), stay off for it. Before
    torch 2.13, Inductor's loop reordering after fusion fails an assertion on some fused nodes of a whole step's
    program on CUDA (``FusedSchedulerNode.reorder_loops_by_dep_pair``; 2.13 declines to reorder them instead): off
    there."""
    if backend != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor

    settings = dict(bucket_all_reduces_fx="none", bucket_reduce_scatters_fx="none")
    if _TORCH_RELEASE < (2, 13):
        settings["loop_ordering_after_fusion"] = False
    return inductor.patch(**settings)


def compile_step(fn=None, *, model, optimizer=None, backend="inductor", cuda_graphs=False):
    """Compile the training step ``fn`` as one program on this rank's parts (docs/compile.md, "Whole steps").

    ``model`` (a module laid out with ``Module.to_global``, or a list of them) and ``optimizer`` (one, a list or
    None) hold the state the step reads and writes: parameters, gradients, buffers and optimizer state. ``fn`` may
    take tensors (plain or global: the batch; its ``to_global`` runs inside the program) and hashable values, and
    returns tensors, nested in lists, tuples or dicts. ``backend`` is a ``torch.compile`` backend name or callable
    (``None``: run the traced graph as it is). ``cuda_graphs=True`` replays each program as one CUDA graph
    (``_step_graph.py``): per call, one launch instead of the program's kernels.

    What a user may rely on:

    * The first call runs ``fn`` eagerly. Each later call runs one compiled program traced for its key: the
      arguments' shapes, strides, dtypes and layouts (non-tensor arguments by value), grad mode, autocast, each
      module's ``training`` flag, which parameters require grad and which gradients are None, and the optimizer's
      hyperparameters. The learning rate of Adam, AdamW, NAdam, RAdam, Adamax, ASGD and Rprop is not in the key
      but read every call, so a scheduler does not trace again; other optimizers' (SGD's) is in it. The
      program's collectives are checked to be the same on every rank when it is traced.
    * Once a program lays out parts by what the ranks agreed of them, every rank's non-global arguments (shapes,
      values) are exchanged per call and keyed: all ranks trace when one rank's change. The rest must change alike:
      a rank that would trace where the others run a program, or that switched to a program other than theirs,
      raises ``RanksDisagree`` at once, as does every rank (its world is closed, docs/faults.md); so where a
      program raises on one rank.
    * Parameters, gradients, buffers and optimizer state are updated in place; gradients stay in the tensors that
      held them on entry, as with ``zero_grad(set_to_none=False)`` (entered with none, after ``zero_grad()``
      outside the step, the step gives them new tensors each call). State held by other tensors of the same
      forms (a loaded state dict) is run on as it is; of other forms, it traces again.
    * Results carry no autograd history: the step has run its own backward.
    * Other Python state the step reads (a module's other attributes, globals) is fixed at trace time: after
      changing it, call ``reset()`` on the returned ``CompiledStep``.
    * Numbers read from tensors and sizes that depend on the values (routing, masks, exchanged counts) are symbols
      of the program, computed from each call's own data. A step that decides by such a value (a branch on it,
      returning it, a global tensor whose shape it sets), or reads a tensor that is not an argument, a parameter, a
      buffer or optimizer state, or changes a number the optimizer keeps in Python, or takes an argument that
      requires grad, raises ``StepNotTraceable`` on every rank, naming the line that read the value; so does
      drawing random global tensors on CUDA.
    * With ``cuda_graphs=True`` a program runs as it is on its first call, and is recorded as a CUDA graph and
      replayed from its second: the step's results are copies, kept across calls. It needs the state and the
      tensor arguments on one CUDA device and a program without collectives (a one-rank placement, or layouts that
      need none); else the trace raises ``StepNotTraceable`` on every rank.
    """
    if fn is None:
        return lambda f: compile_step(f, model=model, optimizer=optimizer, backend=backend, cuda_graphs=cuda_graphs)
    if not dist.is_initialized():
        raise RuntimeError("compile_step needs the default process group (sbp_torch.init_process_group)")
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return CompiledStep(fn, models, optimizers, backend, cuda_graphs)
