"""The always-valid route for ops with no rule, no fitting signature or no meta kernel: every input boxed to broadcast,
the op run on full values, broadcast outputs; tensors the op writes into get the result boxed back into their own
layout. It warns once per op, or raises in strict mode (``_modes.py``), except for ``VALUE_OPS``."""

import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .. import _comm as comm
from .._boxing import box_local
from .._layout import GlobalMeta, broadcast, refuse_value_dependent
from .._tensor import OWN_DIR, TORCH_DIR, GlobalTensor, first_outside
from ._bound import BoundCall
from ._modes import STRICT

aten = torch.ops.aten

# Ops whose result is a Python value (or a property of the full value): they gather quietly.
VALUE_OPS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.is_same_size.default,
}

warned_ops: set = set()  # the ops that took the fallback and were warned about (once each)


@dataclass(frozen=True)
class Fallback:
    """A call key that takes the fallback, and why (kept, so that an op with no meta kernel is not traced again)."""

    func: object
    reason: str
    as_is = False

    def run(self, func, args, kwargs):
        return run_fallback(BoundCall(func, args, kwargs), self.reason)


def _user_level() -> int:
    """The ``stacklevel`` of a warning that names the user's line: the first caller outside sbp_torch and torch
    (the frames between differ by path: the C hit path, torch function, autograd)."""
    _, passed = first_outside(sys._getframe(1), (OWN_DIR, TORCH_DIR))
    return 1 + passed


@comm.naming_cause(lambda bound, why: f"{bound.func} on gathered inputs ({why})")
def run_fallback(bound: BoundCall, why: str):
    """Run the call on broadcast (gathered) inputs (see the module docstring)."""
    func = bound.func
    if func not in VALUE_OPS:
        if STRICT.get():
            raise NotImplementedError(f"sbp_torch strict mode: {func} would run on gathered inputs ({why})")
        if func not in warned_ops:
            warned_ops.add(func)
            warnings.warn(f"sbp_torch: {func} runs on broadcast (gathered) inputs: {why}", stacklevel=_user_level())
    placement = bound.placement
    replicated = (broadcast,) * placement.ndim
    member = placement.local_coord() is not None
    if func in VALUE_OPS and not member:  # (nothing waits for this rank here: raise alone, its world left open)
        raise ValueError(
            f"{func} reads the value of a global tensor on {placement}, which does not hold this rank "
            f"({dist.get_rank()}): read it on the ranks of its placement, or move it to a placement that holds this "
            "rank first (to_global)"
        )
    full_values: dict[int, torch.Tensor] = {}

    def full(a):
        if not isinstance(a, GlobalTensor):
            return a
        if id(a) not in full_values:
            if member:  # in the global tensor's strides: as_strided and friends read them, outputs follow them
                full_values[id(a)] = laid_out(box_local(a._local, a._meta, replicated), a._meta.strides)
            else:
                full_values[id(a)] = torch.empty_strided(a.shape, a._meta.strides, dtype=a.dtype, device="meta")
        return full_values[id(a)]

    full_args, full_kwargs = tree_map(full, bound.args), tree_map(full, bound.kwargs)
    try:
        out = func(*full_args, **full_kwargs)
    except Exception as err:  # every member runs it on the same values: only out of memory is a rank's own
        comm.local_failure(func, err, placement, ())
        raise
    if torch.Tag.nondeterministic_seeded in func.tags and len(placement.flat_ranks) < dist.get_world_size():
        # (ranks outside the placement ran it on meta tensors, drawing nothing: they take a drawing rank's state;
        # a pipeline's ranks run their own stages' ops alone, so there is no call of theirs to meet)
        if not comm.compiling() and not comm.ops_on_some_ranks():
            comm.generator_state_from(placement.flat_ranks[0], bound.tensors[0]._local.device)
    written = [bound.tensors[i] for i in bound.written]
    for g in written:
        if member and full_values[id(g)] is not g._local:
            g._local.copy_(box_local(full_values[id(g)], g._meta.with_sbp(replicated), g.sbp))
    if written and bound.schema.returns_written:
        return written[0] if len(written) == 1 else tuple(written)
    device = bound.tensors[0]._local.device
    # a view of gathered values is a copy (GlobalMeta.copied); of broadcast ones taken as they are, a view of the part
    viewing = getattr(func, "is_view", False)
    copied = viewing and any(full_values[id(g)] is not g._local or g._meta.copied for g in bound.tensors)

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        if o.layout != torch.strided:  # a global tensor is dense: wrapping this would report a layout it lacks
            raise NotImplementedError(f"{bound.func} returns a {o.layout} tensor; global tensors are dense (strided)")
        refuse_value_dependent(o.shape, f"the output of {bound.func} on global tensors")
        meta = GlobalMeta(tuple(o.shape), o.dtype, placement, replicated, tuple(o.stride()), copied)
        return GlobalTensor(o if member else o.new_empty(0, device=device), meta)

    return tree_map(wrap, out)


def laid_out(value: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``value`` with the strides ``strides``: itself where it has them, else a copy in them. A dim of stride 0
    (an ``expand``) repeats one slice, as the logical tensor does; where the strides overlap otherwise (a view
    that reads elements twice, ``unfold``), no copy can have them, and ``value`` stays contiguous."""
    if tuple(value.stride()) == tuple(strides) or value.numel() == 0:
        return value
    repeated = [d for d, (n, s) in enumerate(zip(value.shape, strides)) if s == 0 and n > 1]
    one = value
    for d in repeated:
        one = one.narrow(d, 0, 1)
    kept = [1 if d in repeated else s for d, s in enumerate(strides)]
    out = torch.empty_strided(one.shape, kept, dtype=value.dtype, device=value.device)
    if torch._debug_has_internal_overlap(out) == 1:  # (1: the elements overlap)
        return value.contiguous()
    return out.copy_(one).expand(value.shape) if repeated else out.copy_(one)
