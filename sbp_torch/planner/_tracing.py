"""Tracing the pieces of one model's step on one mesh: the step with its units cut to a few, and one unit alone
from the inputs the step gave it, with parameters laid out as a run asks."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import _comm as comm
from .._api._global_mode import GlobalMode
from .._api._module_tensors import Slot, Swap, module_tensors
from .._layout import GlobalMeta, broadcast
from .._tensor import GlobalTensor
from ._counting import measure, meta_global
from ._decisions import options_of, unit_containers
from ._known_values import AnswerReads, KnownValues
from ._meshes import Mesh
from ._pins import BoundaryPin


def step_loss(model, batch, loss):
    """The loss of one training step: ``model`` called on ``batch`` (keyword arguments from a dict, positional from
    a tuple or list, else the one argument), then ``loss(output)``, else ``output.loss``, else the output (summed)."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    if loss is not None:
        return loss(output)
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    raise TypeError(f"the model returned {type(output).__name__}: pass loss=<output -> scalar tensor> to plan")


def _detached(a, known: KnownValues):
    """An input recorded for a unit traced alone: global tensors cut from the graph that made them (their values
    known where they were), and a ``transformers`` key/value cache left out (None), since the cache the recording
    run filled would feed its tensors to every rerun, and a training step never reads it."""
    if isinstance(a, GlobalTensor):
        cut = a.detach().requires_grad_(a.requires_grad)
        value = known.value_of(a)
        if value is not None:
            known.add(cut, value.clone())  # (each run its own: a run may write into its inputs)
        return cut
    if hasattr(a, "get_seq_length"):
        return None
    return a


def _grad_input(a) -> bool:
    """Whether a unit's argument is one that recomputing the unit keeps: a global tensor that requires grad (the
    hidden state; masks and position tables are kept by the step anyway, once for every unit)."""
    return isinstance(a, GlobalTensor) and a.requires_grad


class Tracer:
    """Traces pieces of one model's step on one mesh; parameters get their layouts per run."""

    def __init__(self, model, batch, mesh: Mesh, loss):
        self.model, self.batch, self.mesh, self.loss = model, batch, mesh, loss
        self.placement = mesh.placement("cpu")
        comm.ensure_groups(self.placement)
        self.boundary = mesh.rows_split(1)
        self.containers = unit_containers(model)
        self.modules = dict(model.named_modules())  # (taken before any truncation)
        self.unit_args: dict[str, tuple] = {}
        self.module_inputs: dict[str, int] = {}
        self.metas: dict[str, GlobalMeta] = {}  # parameter name -> compute meta of the last run
        self.known = KnownValues()  # the batch's values, and those the runs computed from it and from factories

    def sbp(self, tensor_sbp) -> tuple:
        """The whole SBP of a parameter whose SBP on the tensor axis is ``tensor_sbp`` (a tuple is whole already)."""
        if isinstance(tensor_sbp, tuple):
            return tensor_sbp
        return tuple(tensor_sbp if a == self.mesh.tensor_axis else broadcast for a in range(len(self.mesh.shape)))

    def batch_globals(self):
        def one(x):
            if not isinstance(x, torch.Tensor):
                return x
            laid_out = meta_global(GlobalMeta(tuple(x.shape), x.dtype, self.placement, self.mesh.rows_split(x.dim())))
            # a copy per run, contiguous as the laid-out tensor's strides say: the run may write into its batch
            self.known.add(laid_out, x.detach().to("cpu", copy=True).contiguous())
            return laid_out

        return tree_map(one, self.batch)

    @contextlib.contextmanager
    def swapped(self, scope: nn.Module, layouts: dict[str, object], prefix: str):
        """``scope``'s parameters and buffers replaced by fake global ones (parameters by ``layouts``, full
        names; everything else broadcast) for the block; yields the fake parameters by name."""
        fakes: dict[int, GlobalTensor] = {}
        named: dict[str, GlobalTensor] = {}
        slots = []
        for full, is_parameter, table, name, t in module_tensors(scope, prefix):
            if id(t) not in fakes:
                sbp = self.sbp(layouts.get(full, broadcast) if is_parameter else broadcast)
                meta = GlobalMeta(tuple(t.shape), t.dtype, self.placement, sbp)
                fakes[id(t)] = meta_global(meta, requires_grad=t.requires_grad)
                if is_parameter:
                    self.metas[full] = meta
                    named[full] = fakes[id(t)]
            slots.append((Slot(table, name), fakes[id(t)]))
        with Swap([slot for slot, _ in slots], [fake for _, fake in slots]):
            yield named

    @contextlib.contextmanager
    def truncated(self, keep: int = 2):
        """Each unit container holds only its first ``keep`` units for the block."""
        modules = self.modules
        kept = []
        for container in self.containers:
            holder = modules[container]
            kept.append((holder, holder._modules))
            if keep is not None:
                holder._modules = type(holder._modules)(list(holder._modules.items())[:keep])
        try:
            yield
        finally:
            for holder, original in kept:
                holder._modules = original

    @contextlib.contextmanager
    def hooks(self, record: bool, pinned: bool = True):
        modules = self.modules
        handles = []
        for units in self.containers.values():
            for unit in units[:2]:
                if pinned:
                    handles.append(BoundaryPin.install(modules[unit], self.boundary))
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
            self.unit_args[unit] = tree_map(lambda a: _detached(a, self.known), (args, kwargs))

        return record

    def _input_recorder(self, name, keep_alive):
        def record(module, args):
            if args and isinstance(args[0], torch.Tensor):
                keep_alive.append(args[0])  # ids stay unique while the pass runs
                self.module_inputs[name] = id(args[0])

        return record

    def run_model(self, layouts: dict, record: bool = False, keep: int | None = 2, pinned: bool = True):
        """The step with the units cut to ``keep`` per container (None: all), the hidden state pinned at unit
        edges when ``pinned``: (measured, fake parameters by name)."""
        with self.truncated(keep), self.hooks(record, pinned), self.swapped(self.model, layouts, "") as params:

            def step():
                with self.global_mode():
                    return step_loss(self.model, self.batch_globals(), self.loss)

            measured, _ = measure(step, list(params.values()), self.known)
        return measured, params

    @contextlib.contextmanager
    def global_mode(self):
        """Factories inside the model build global tensors with meta parts, their values followed where known."""
        # (the reads' mode below global mode: global mode takes factories called from sbp_torch's code as its own)
        with AnswerReads(self.known):
            with GlobalMode(self.placement, broadcast, parts_on_meta=True, on_factory=self.known.factory_built):
                yield

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
        args, kwargs = tree_map(lambda a: _detached(a, self.known), (args, kwargs))
        pin = BoundaryPin.install(module, self.boundary)
        try:
            with self.swapped(module, layouts, unit) as params:

                def forward():
                    with self.global_mode():
                        return module(*args, **kwargs)

                measured, _ = measure(forward, list(params.values()), self.known)
        finally:
            pin.remove()
        inputs = {id(a._local): a._local for a in tree_flatten((args, kwargs))[0] if _grad_input(a)}
        measured.input_bytes = sum(t.numel() * t.element_size() for t in inputs.values())
        return measured, params
