"""Run one piece of a training step on fake local parts and measure it: its collectives, its ops' FLOPs and
bytes, the activations it saves for backward, and its parameters' gradient layouts.

Parameters and inputs are global tensors whose local parts are on the meta device (shapes and dtypes, no
storage), so any model size and any world size run in one process: the process group may be torch's fake
backend. The ops run through the same dispatcher, signature table and boxing planner as a real step; every
collective is issued as the functional op a compiled program would hold, so nothing is sent."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .. import _comm as comm
from .._api._explain import Collective, recorder
from .._layout import Broadcast, GlobalMeta
from .._tensor import GlobalTensor
from ._known_values import PART_READS, KnownValues, refuse_read


@dataclass
class Measured:
    """What one run of a piece of the step did on the rank it was traced for: rank 0 with torch's fake backend, this
    rank inside a real process group."""

    collectives: list[Collective] = field(default_factory=list)
    ops: list[tuple[float, int, torch.dtype]] = field(default_factory=list)  # per global op: local FLOPs, bytes
    saved_bytes: int = 0  # activations autograd keeps for backward (parameters not counted)
    peak_bytes: int = 0  # the most bytes the op outputs made during the run held at once (see ``CountOps``)
    grads: dict[int, GlobalMeta] = field(default_factory=dict)  # id(parameter) -> the layout its gradient got
    forward_ops: int = 0  # how many of ``ops`` the forward ran (the rest are backward's)
    input_bytes: int = 0  # a unit's inputs that require grad: what recomputing it in backward keeps instead


def _local(a):
    return a._local if isinstance(a, GlobalTensor) else a


class CountOps(TorchDispatchMode):
    """Records each op on global tensors with its FLOPs on one rank and the bytes of its local inputs and
    outputs; views move no bytes. FLOPs are torch's formula on the logical shapes, divided by the ranks of
    every axis where the output is not broadcast (split or partial: the work is divided there; the local
    call may slice its inputs first, so its arguments are not the shapes it computes on).

    Also counts the bytes of the local parts ops made that are still alive (a part is freed when its last
    reference goes; a view keeps its base alive), and their peak: the activations, their gradients and every
    temporary of the run, not the parameters."""

    def __init__(self, ops: list, known: KnownValues | None = None):
        super().__init__()
        self.ops = ops
        self.known = known  # the values the trace follows (``_known_values.py``)
        self.live = 0
        self.peak = 0

    def _made(self, local: torch.Tensor) -> None:
        nbytes = local.numel() * local.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(local, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = self.known
        if func in PART_READS and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
            refuse_read(func)
        out = func(*args, **kwargs)
        if known is not None:
            known.after_op(func, args, kwargs, out)
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, GlobalTensor)]
        if outputs:
            if func.is_view:
                self.ops.append((0.0, 0, outputs[0].dtype))
                return out
            count = flop_registry.get(func._overloadpacket)
            flops = float(count(*args, **kwargs, out_val=out)) if count else 0.0
            first = outputs[0]
            shape = first.placement.shape
            flops /= math.prod(n for n, sbp in zip(shape, first.sbp) if not isinstance(sbp, Broadcast))
            local = tree_map(_local, (args, kwargs, out))
            tensors = [t for t in tree_flatten(local)[0] if isinstance(t, torch.Tensor)]
            self.ops.append((flops, sum(t.numel() * t.element_size() for t in tensors), first.dtype))
            for o in outputs:
                self._made(o._local)
        return out


def meta_global(meta: GlobalMeta, requires_grad: bool = False) -> GlobalTensor:
    """A global tensor of ``meta`` whose local part (this rank's) is on the meta device: a shape, no storage."""
    local = torch.empty(meta.local_shape(meta.placement.local_coord()), dtype=meta.dtype, device="meta")
    return GlobalTensor(local, meta, requires_grad=requires_grad)


def _storage(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def measure(fn, params: list[GlobalTensor], known: KnownValues | None = None) -> tuple[Measured, object]:
    """Run ``fn()`` on global tensors with meta parts and the backward of every output that requires grad, each
    with a gradient of ones in its own layout; returns what it did and its output.
    ``params`` are the leaves whose gradients are reported (and left unset afterwards); ``known``: the values the
    run follows, to answer the model's reads of values."""
    found = Measured()
    phase = {"backward": False}
    weights = {_storage(p._local) for p in params}
    seen: set = set()

    def pack(t):
        local = _local(t)
        if isinstance(local, torch.Tensor):
            key = _storage(local)
            if key not in weights and key not in seen:
                seen.add(key)
                found.saved_bytes += local.untyped_storage().nbytes()
        return t

    for p in params:
        p.grad = None
    counting = CountOps(found.ops, known)
    with comm.observing(recorder(found.collectives, phase), estimate=True), counting:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        found.forward_ops = len(found.ops)
        if outputs:
            phase["backward"] = True
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    found.peak_bytes = counting.peak
    for p in params:
        if p.grad is not None:
            found.grads[id(p)] = p.grad._meta
            p.grad = None
    return found, out
