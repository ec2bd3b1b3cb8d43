"""Gradient policy of modules laid out with ``Module.to_global`` (docs/training.md): a gradient accumulated into
``.grad`` is boxed to ``gradient_sbp(param.sbp)`` (the parameter's own layout for split and broadcast
parameters), so optimizers see gradients laid out like their parameters."""

import dataclasses
import weakref

import torch
from torch import nn

from .. import _comm as comm
from .._boxing import axis_view, box_local, plan_boxing, run_plan
from .._tensor import GlobalTensor, gradient_sbp, mark_reduced_at_use


@dataclasses.dataclass
class _Bucket:
    """The parameters whose gradients wait in one bucket, and those gradients' bytes (kept as they come, not summed
    again for every gradient)."""

    params: list = dataclasses.field(default_factory=list)
    nbytes: int = 0


class GradientReducer:
    """Boxes each accumulated gradient to ``gradient_sbp(param.sbp)``. Routes of only all-reduces (data
    parallelism) or one reduce-scatter (a partial gradient of a split parameter: ZeRO / FSDP style) go through
    buckets of up to ``bucket_mb`` MiB per (placement, dtype, route), one collective per bucket. A bucket that
    fills during backward starts its all-reduce at once (asynchronously) and backward goes on; at the end of
    backward the remaining buckets start, then every bucket is waited for in the order it started (the same on
    every rank) and its gradients take their reduced values. A reduce-scatter bucket runs (synchronously) when
    it is started, in the same order.

    A backward that raises never reaches its end, and leaves its buckets behind: the next call of ``module``
    outside a backward drops them (as DDP resets at each forward), so a user who catches the error and goes on
    gets the next backward's gradients reduced as usual."""

    def __init__(self, params: list[nn.Parameter], bucket_mb: float, module: nn.Module):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets: dict = {}  # key -> _Bucket
        self.in_flight: list = []
        self.flush_queued = False
        _REDUCERS.add(self)
        module.register_forward_pre_hook(self._drop_if_left_behind)
        for param in params:
            param.register_hook(self._held_in_arriving_layout(param))
            param.register_post_accumulate_grad_hook(self._on_accumulated)
            mark_reduced_at_use(param)
        _bucket_compiled_reductions()

    @staticmethod
    def _held_in_arriving_layout(param: nn.Parameter):
        """The hook that runs before a gradient is accumulated into ``param.grad``: a gradient already held (zeroed
        in place, or an earlier micro-batch's, reduced) is laid out as the arriving one where that moves nothing
        (a broadcast sum as a partial one: one rank keeps it, the others hold zeros), so that accumulating is a local
        add and the sum is reduced once, in a bucket, rather than the arriving gradient alone before the add.
        (``torch.autograd.grad`` of the parameter runs the hook but accumulates nothing: a held gradient may then
        stay partial, the same global value, until the next backward reduces it.)"""

        def hook(arriving):
            held = param.grad
            if not (isinstance(held, GlobalTensor) and isinstance(arriving, GlobalTensor)):
                return None
            if held._meta.sbp == arriving._meta.sbp or comm.traced() or torch.compiler.is_compiling():
                return None
            plan = plan_boxing(held._meta, arriving._meta.sbp)
            if all(step.collective.startswith("local") for step in plan.steps):
                param.grad = GlobalTensor(run_plan(held._local, plan), held._meta.with_sbp(arriving._meta.sbp))
            return None

        return hook

    @comm.naming_cause(lambda *_: _REDUCTION)
    def _on_accumulated(self, param: nn.Parameter) -> None:
        grad = param.grad
        target = gradient_sbp(param._meta.sbp)
        if not isinstance(grad, GlobalTensor):
            return
        if grad._meta.sbp == target:
            if grad._meta is not param._meta and grad._meta == param._meta:
                grad._meta = param._meta  # (the same metadata, as one object: see ``_reduced_meta``)
            return
        shape = grad._meta.placement.shape
        # (a step along an axis of one rank leaves the part as it is: on one rank, data parallelism moves nothing)
        steps = [s for s in plan_boxing(grad._meta, target).steps if s.axis < 0 or shape[s.axis] > 1]
        scatter = len(steps) == 1 and steps[0].collective == "reduce-scatter"
        if not steps or (not scatter and not all(step.collective == "all-reduce" for step in steps)):
            local = box_local(grad._local, grad._meta, target) if steps else grad._local
            param.grad = GlobalTensor(local, _reduced_meta(param, grad._meta, target))
            return
        route = tuple((s.axis, s.src) for s in steps)
        # all-reduce buckets share a target layout; reduce-scatter buckets mix them (each part is cut alone)
        meta = grad._meta  # (its fields, not the tensor's getters: no torch function per gradient)
        key = (meta.placement, meta.dtype, route, "reduce-scatter" if scatter else target)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket()
        bucket.params.append(param)
        bucket.nbytes += grad._local.numel() * meta.dtype.itemsize
        if bucket.nbytes >= self.bucket_bytes:
            self._start(key)
        if not self.flush_queued:
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_all)

    def _drop_if_left_behind(self, module: nn.Module, args) -> None:
        # outside any backward (no graph task runs), an end of backward still queued is one that never came;
        # a forward recomputed by checkpointing runs inside a backward and keeps its buckets
        if self.flush_queued and torch._C._current_graph_task_id() == -1:
            self.drop_pending()

    def drop_pending(self) -> None:
        """Forget the buckets of a backward that raised before it ended (its end-of-backward callback never ran).
        Its all-reduces already started finish on their own; their results are not used."""
        self.buckets.clear()
        self.in_flight.clear()
        self.flush_queued = False

    @comm.naming_cause(lambda *_: _REDUCTION)
    def _start(self, key) -> None:
        """Start bucket ``key``: its first all-reduce (later axes run when it finishes), or its reduce-scatter."""
        bucket = self.buckets.pop(key, None)
        if bucket is None or not bucket.params:
            return
        params = bucket.params
        placement, _, steps, target = key
        if target == "reduce-scatter":
            _reduce_scatter_bucket(params, placement, *steps[0])
            return
        flat = torch.cat([p.grad._local.reshape(-1) for p in params])
        finish = None
        if placement.local_coord() is not None:
            axis, src = steps[0]
            finish = comm.start_all_reduce(flat, src.op, comm.axis_group(placement, axis))
        self.in_flight.append((key, params, flat, finish))

    @comm.naming_cause(lambda *_: _REDUCTION)
    def _finish_all(self) -> None:
        self.flush_queued = False
        for key in list(self.buckets):  # insertion order: the same on every rank
            self._start(key)
        in_flight, self.in_flight = self.in_flight, []
        for (placement, _, steps, target), params, flat, finish in in_flight:
            if finish is not None:
                flat = finish()
                for axis, src in steps[1:]:
                    flat = comm.all_reduce(flat, src.op, comm.axis_group(placement, axis))
            offset = 0
            for p in params:
                local = p.grad._local
                part = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
                p.grad = GlobalTensor(part, _reduced_meta(p, p.grad._meta, target))


def _reduced_meta(param: nn.Parameter, meta, target):
    """``meta.with_sbp(target)``: the parameter's own metadata object where they are equal (a gradient laid out like
    its parameter), so that the keys of the optimizer's cached calls compare it by identity, not field by field."""
    own = param._meta
    if target == own.sbp and (meta.shape, meta.dtype, meta.placement) == (own.shape, own.dtype, own.placement):
        return own
    return meta.with_sbp(target)


_REDUCERS: weakref.WeakSet = weakref.WeakSet()


def drop_pending_reductions() -> None:
    """Forget every reducer's buckets of a backward that raised before it ended, so that the next backward starts
    with none: ``compile_step`` calls it when a trace fails, as its next call may run no forward of the module."""
    for reducer in list(_REDUCERS):
        reducer.drop_pending()


def _bucket_compiled_reductions() -> None:
    """Under torch.compile the gradients are reduced inside the compiled backward, one collective per use of a
    parameter (``mark_reduced_at_use``): turn on Inductor's passes that merge those collectives into buckets,
    where they are off."""
    import torch._inductor.config as inductor  # a second or two to import: only once a model is laid out

    for option in ("bucket_all_reduces_fx", "bucket_reduce_scatters_fx"):
        if getattr(inductor, option) == "none":
            setattr(inductor, option, "all")


_REDUCTION = "gradient reduction (Module.to_global)"


@comm.naming_cause(lambda *_: _REDUCTION)
def _reduce_scatter_bucket(params: list, placement, axis: int, src) -> None:
    """One reduce-scatter on ``axis`` for the partial gradients of ``params``, each cut along its target's split
    dim into the axis' parts (uneven ones included); this rank keeps its reduced part of each."""
    coord = placement.local_coord()
    if coord is None:  # not a rank of the placement: nothing held, nothing to reduce
        for p in params:
            meta = _reduced_meta(p, p.grad._meta, gradient_sbp(p._meta.sbp))
            p.grad = GlobalTensor(p.grad._local.new_empty(meta.local_shape(coord)), meta)
        return
    parts = []
    for p in params:
        dim = gradient_sbp(p._meta.sbp)[axis].dim
        parts.append(p.grad._local.split(axis_view(p.grad._meta, axis, coord).sizes(dim), dim=dim))
    finish = comm.start_reduce_scatter_parts(parts, src.op, comm.axis_group(placement, axis))
    for p, mine in zip(params, finish()):
        p.grad = GlobalTensor(mine, _reduced_meta(p, p.grad._meta, gradient_sbp(p._meta.sbp)))
