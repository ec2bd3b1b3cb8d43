"""``nn.Module.to_global``: lay out a model's parameters and buffers, and reduce their gradients.

A module's tensors are taken as the *full logical values* (every rank built the same model; where ranks
differ, the values of the placement's first rank win). So ``split(0)`` keeps one balanced part per rank of
each parameter, whatever its size. This differs on purpose from ``Tensor.to_global`` on a local tensor, where
a split tensor is *one part* of a bigger logical tensor: a model is written for the logical shapes.

Gradient policy: a broadcast parameter used with split activations gets a partial-sum gradient. When a
gradient is accumulated into ``.grad`` it is boxed to ``gradient_sbp(param.sbp)`` (the parameter's own layout
for split and broadcast parameters), so optimizers see gradients laid out like their parameters. Gradients
whose boxing is only all-reduces (the data-parallel case) or one reduce-scatter (a partial gradient of a split
parameter: sharded data parallelism, ZeRO / FSDP style) are bucketed: they are combined into buffers of up to
``bucket_mb`` megabytes per (placement, dtype, route) and reduced with one collective per buffer, when the
buffer is full or at the end of backward. All-reduce buckets start asynchronously, so they overlap the rest of
backward; reduce-scatter buckets run when they are started.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import torch
from torch import nn

from . import _collectives as coll
from ._boxing.plan import axis_view, plan_boxing
from ._conversions import box_local, gradient_sbp, to_global
from ._global_tensor import GlobalTensor
from ._layout import normalize_sbp
from ._placement import placement as Placement
from ._process_groups import axis_group
from ._sbp import Broadcast

BROADCAST = Broadcast()


def _pattern_specificity(pattern: str) -> tuple[int, int]:
    """Exact names beat patterns; then the pattern with more literal characters."""
    wild = sum(pattern.count(c) for c in "*?[")
    return (wild == 0, len(pattern) - wild)


def sbp_for(name: str, tensor: torch.Tensor, sbp, placement: Placement):
    """The SBP of the module tensor ``name`` under the plan ``sbp`` (one SBP, a pattern dict, a callable)."""
    if callable(sbp) and not isinstance(sbp, Mapping):
        chosen = sbp(name, tensor)
    elif isinstance(sbp, Mapping):
        matches = [p for p in sbp if fnmatch.fnmatchcase(name, p)]
        if matches:
            chosen = sbp[max(matches, key=_pattern_specificity)]  # max keeps the first of equals: dict order
        else:
            chosen = (BROADCAST,) * placement.ndim
    else:
        chosen = sbp
    try:
        return normalize_sbp(chosen, placement, tensor.dim(), tensor.dtype)
    except (ValueError, TypeError) as err:
        raise type(err)(f"module tensor {name!r} of shape {tuple(tensor.shape)}: {err}") from err


def _globalize(name: str, tensor: torch.Tensor, placement: Placement, sbp, memo: dict) -> torch.Tensor:
    if id(tensor) in memo:  # tied parameters stay tied
        return memo[id(tensor)]
    sbp = sbp_for(name, tensor, sbp, placement)
    replicated = to_global(tensor.detach(), placement, (BROADCAST,) * placement.ndim)
    value = replicated.to_global(sbp=sbp).detach()
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    memo[id(tensor)] = value
    return value


def module_to_global(module: nn.Module, placement: Placement, sbp=None, *, bucket_mb: float = 25.0) -> nn.Module:
    """Lay out every parameter and buffer of ``module`` on ``placement``, in place; returns ``module``.

    Args:
        placement: where the tensors live.
        sbp: one SBP (or tuple, one per placement axis) for every tensor; or a dict from glob patterns on
            the dotted tensor names (``"blocks.*.mlp.up.weight"``) to SBPs, where the most specific match wins
            and unmatched tensors are broadcast; or a callable ``(name, tensor) -> sbp``. Default: broadcast.
        bucket_mb: size of the buckets in which all-reduced gradients are combined.
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be an sbp_torch.placement, got {type(placement).__name__}")
    if sbp is None:
        sbp = (BROADCAST,) * placement.ndim
    memo: dict = {}
    params = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for name, tensor in list(table.items()):
                if tensor is None or isinstance(tensor, GlobalTensor):
                    continue
                full_name = f"{prefix}.{name}" if prefix else name
                new = _globalize(full_name, tensor, placement, sbp, memo)
                table[name] = new
                if isinstance(new, nn.Parameter) and new.requires_grad and all(new is not p for p in params):
                    params.append(new)
    if params:
        GradientReducer(params, bucket_mb)
    return module


class GradientReducer:
    """Boxes each accumulated gradient to ``gradient_sbp(param.sbp)``, bucketing all-reduce-only routes and
    single reduce-scatters.

    A bucket that fills during backward starts its all-reduce at once (asynchronously) and backward goes on;
    at the end of backward the remaining buckets start, then every bucket is waited for in the order it
    started (the same on every rank) and its gradients take their reduced values. A reduce-scatter bucket
    runs (synchronously) when it is started, in the same order.
    """

    def __init__(self, params: list[nn.Parameter], bucket_mb: float):
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets: dict = {}
        self.in_flight: list = []
        self.flush_queued = False
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_accumulated)

    def _on_accumulated(self, param: nn.Parameter) -> None:
        grad = param.grad
        target = gradient_sbp(param.sbp)
        if not isinstance(grad, GlobalTensor) or grad.sbp == target:
            return
        plan = plan_boxing(grad._meta, target)
        scatter = len(plan.steps) == 1 and plan.steps[0].collective == "reduce-scatter"
        if not scatter and not all(step.collective == "all-reduce" for step in plan.steps):
            param.grad = GlobalTensor(box_local(grad._local, grad._meta, target), grad._meta.with_sbp(target))
            return
        route = tuple((s.axis, s.src) for s in plan.steps)
        # all-reduce buckets share a target layout; reduce-scatter buckets mix them (each part is cut alone)
        key = (grad.placement, grad.dtype, route, "reduce-scatter" if scatter else target)
        bucket = self.buckets.setdefault(key, [])
        bucket.append(param)
        if sum(p.grad._local.numel() for p in bucket) * grad.dtype.itemsize >= self.bucket_bytes:
            self._start(key)
        if not self.flush_queued:
            self.flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_all)

    def _start(self, key) -> None:
        """Start the first all-reduce of bucket ``key``; the later axes (N-D placements) run when finished.
        A reduce-scatter bucket runs now."""
        params = self.buckets.pop(key, [])
        if not params:
            return
        placement, _, steps, target = key
        if target == "reduce-scatter":
            _reduce_scatter_bucket(params, placement, *steps[0])
            return
        flat = torch.cat([p.grad._local.reshape(-1) for p in params])
        finish = None
        if placement.coord_of(torch.distributed.get_rank()) is not None:
            axis, src = steps[0]
            finish = coll.start_all_reduce(flat, src.op, axis_group(placement, axis))
        self.in_flight.append((key, params, flat, finish))

    def _finish_all(self) -> None:
        self.flush_queued = False
        for key in list(self.buckets):  # insertion order: the same on every rank
            self._start(key)
        in_flight, self.in_flight = self.in_flight, []
        for (placement, _, steps, target), params, flat, finish in in_flight:
            if finish is not None:
                flat = finish()
                for axis, src in steps[1:]:
                    flat = coll.all_reduce(flat, src.op, axis_group(placement, axis))
            offset = 0
            for p in params:
                local = p.grad._local
                part = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
                p.grad = GlobalTensor(part, p.grad._meta.with_sbp(target))


def _reduce_scatter_bucket(params: list, placement, axis: int, src) -> None:
    """One reduce-scatter on ``axis`` for the partial gradients of ``params``, each to its own split.

    Each gradient is cut along its target's split dim into the axis' parts (uneven ones included); the buffer
    holds, for each coordinate along the axis in turn, the parts that coordinate keeps, of every gradient,
    padded to the longest such segment. After the reduce-scatter, this rank's segment is cut back into its
    parts of each gradient."""
    coord = placement.coord_of(torch.distributed.get_rank())
    if coord is None:  # not a rank of the placement: nothing held, nothing to reduce
        for p in params:
            target = gradient_sbp(p.sbp)
            meta = p.grad._meta.with_sbp(target)
            p.grad = GlobalTensor(p.grad._local.new_empty(meta.local_shape(coord)), meta)
        return
    n = placement.shape[axis]
    segments: list[list[torch.Tensor]] = [[] for _ in range(n)]
    kept = []  # per gradient: the shape of this rank's part, with the split dim first
    for p in params:
        grad, dim = p.grad, gradient_sbp(p.sbp)[axis].dim
        sizes = axis_view(grad._meta, axis, coord).sizes(dim)
        rows = grad._local.movedim(dim, 0)
        for index, part in enumerate(rows.split(sizes)):
            segments[index].append(part.reshape(-1))
        kept.append((dim, (sizes[coord[axis]], *rows.shape[1:])))
    flat = [torch.cat(parts) for parts in segments]
    longest = max(f.numel() for f in flat)
    buffer = flat[0].new_zeros((n, longest))
    for index, f in enumerate(flat):
        buffer[index, : f.numel()] = f
    mine = coll.reduce_scatter(buffer, src.op, 0, [1] * n, axis_group(placement, axis))[0]
    offset = 0
    for p, (dim, shape) in zip(params, kept):
        count = math.prod(shape)
        local = mine[offset : offset + count].view(shape).movedim(0, dim).contiguous()
        offset += count
        p.grad = GlobalTensor(local, p.grad._meta.with_sbp(gradient_sbp(p.sbp)))
