"""``local_map``: code that runs on the local parts of global tensors, for code that is per part by construction
(routing computed per token, a kernel that works on one shard).

A region converts each global input to the layout it declares, runs the function on the local parts as plain
tensors (torch's factories build plain tensors there, in global mode or not), and wraps its outputs as global
tensors laid out as declared. It is differentiable.

The gradients follow from what a region computes. On a placement axis where every input and output is broadcast,
every rank computes the same thing: gradients stay broadcast. On an axis where some input or output is split or
partial, the region is *divided*: each rank computes its own share of the result, so

* a split input's gradient is split alike (its part's gradient is whole on the rank that holds it);
* a broadcast input's gradient is partial(sum) (each rank's share contributes to it);
* a split output's gradient comes in split, a partial(sum) output's broadcast;
* a partial input that needs a gradient, and a floating output declared broadcast while some input needs one, are
  refused: a function of one part has no gradient with respect to the sum of the parts, and a broadcast output of
  per-rank work cannot say which rank's share its gradient belongs to (declare it split or partial).

Every floating output depends on every input that needs a gradient, so each such input gets one on every rank,
zeros where the function did not read it on that rank (an expert that received no token), and the ranks reduce
the same gradients. A rank outside the placement runs the function on zeros shaped as the first rank's parts and
keeps none of it. Under torch.compile a region runs eagerly, between the graphs before and after it.
"""

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._layout import (
    Broadcast,
    GlobalMeta,
    Partial,
    Placement,
    Split,
    normalize_sbp,
    partial_sum,
    refuse_value_dependent,
)
from .._tensor import GlobalTensor, from_whole, gradient, gradient_sbp, has_extreme, to_local, to_sbp
from ._global_mode import outside_global_mode
from ._module_tensors import Slot, Swap, module_tensors
from ._to_global import to_global


class _Wrap(torch.autograd.Function):
    """A region's local output as the global tensor of ``meta``; backward hands the region its gradient part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, meta: GlobalMeta):
        ctx.meta = meta
        ctx.saved_local = local if has_extreme(meta) else None
        return GlobalTensor(local, meta)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, GlobalTensor):  # zeros autograd made up for an output the loss does not reach
            return from_whole(grad.to(ctx.meta.dtype), ctx.meta.with_sbp(gradient_sbp(ctx.meta.sbp)))._local, None
        return gradient(grad, ctx.meta, ctx.saved_local)._local, None


def wrap_part(local: torch.Tensor, meta: GlobalMeta) -> GlobalTensor:
    """``local`` as the part of the global tensor of ``meta``, differentiable as a region's output."""
    return _Wrap.apply(local, meta)


def divided_axes(placement: Placement, sbps) -> tuple[bool, ...]:
    """Per placement axis, whether some layout of ``sbps`` is not broadcast on it."""
    return tuple(any(not isinstance(s[a], Broadcast) for s in sbps) for a in range(placement.ndim))


def input_gradient_sbp(sbp: tuple, divided: tuple[bool, ...], what: str) -> tuple:
    out = []
    for axis, s in enumerate(sbp):
        if not divided[axis] or isinstance(s, Split):
            out.append(s)
        elif isinstance(s, Broadcast):
            out.append(partial_sum)
        else:
            raise ValueError(
                f"{what} is {s!r} on placement axis {axis}, where the region computes per rank: a function of one "
                "part has no gradient with respect to the sum of the parts; declare it broadcast (or detach it)"
            )
    return tuple(out)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _check_output(out: torch.Tensor, sbp: tuple, divided: tuple[bool, ...], what: str) -> None:
    """Refuse a floating output declared broadcast where the region computes per rank (called when some input
    needs a gradient, which every rank knows alike)."""
    if not _differentiable(out):
        return
    for axis, s in enumerate(sbp):
        if divided[axis] and isinstance(s, Broadcast):
            raise ValueError(
                f"{what} is declared broadcast on placement axis {axis}, where the region computes per rank, and "
                "needs a gradient: declare it split (each rank computed its rows) or partial (each rank computed a "
                "share of the sum)"
            )


def _local_part(x: GlobalTensor, divided: tuple[bool, ...], what: str) -> torch.Tensor:
    if not x.requires_grad:
        return x._local
    return to_local(x, grad_sbp=input_gradient_sbp(x.sbp, divided, what))


def zero_reaching(tensors) -> torch.Tensor:
    """A zero that depends on each of ``tensors`` (the sum of none of their elements): added to a result, it makes
    backward reach every one of them, with a zero gradient where nothing else reads it."""
    return sum(t.reshape(-1)[:0].sum() for t in tensors)


def _reaching_every_input(outputs: list, needing: list[torch.Tensor]) -> list:
    """``outputs`` with each floating one made to depend on every input in ``needing``: whether an output needs a
    gradient, and which inputs backward reaches from it, are then the same on every rank, whatever the function
    read on each."""
    zero = zero_reaching(needing)
    return [out + zero.to(out.dtype) if _differentiable(out) else out for out in outputs]


def global_slots(module: nn.Module) -> list:
    """(table, name, tensor) of each global parameter and buffer of ``module`` and its submodules."""
    return [(table, name, t) for _, _, table, name, t in module_tensors(module) if isinstance(t, GlobalTensor)]


# torch.compile runs a region as it runs eagerly, between the graphs before and after it: its parts are plain
# tensors that AOTAutograd cannot trace beside global ones, and routing reads counts to the host anyway.
@torch.compiler.disable
def run_locally(fn, placement: Placement, args: tuple, in_sbps: tuple, out_sbps, *, out_shapes=None, slots=(),
                kwargs=None, what: str = "local_map"):  # fmt: skip
    """Run ``fn(*args, **kwargs)`` as a region on ``placement`` (the module docstring): each positional global
    argument converted to its ``in_sbps`` entry (normalized SBP tuples; None for arguments passed as they are),
    the module slots ``slots`` (from ``global_slots``) swapped for their local parts as they are laid out.
    ``out_sbps``: one SBP tuple per tensor output, in the order ``tree_flatten`` lists them. ``out_shapes``: the
    outputs' logical shapes, in that order, or None to agree on them in one exchange (uneven parts allowed)."""
    kwargs = kwargs or {}
    boxed = [a if sbp is None else to_sbp(a, sbp) for a, sbp in zip(args, in_sbps)]
    layouts = [a.sbp for a in boxed if isinstance(a, GlobalTensor)] + [t.sbp for _, _, t in slots] + list(out_sbps)
    divided = divided_axes(placement, layouts)
    local_args = [
        _local_part(a, divided, f"{what}: argument {i}") if isinstance(a, GlobalTensor) else a
        for i, a in enumerate(boxed)
    ]
    local_slots = [_local_part(t, divided, f"{what}: {name}") for _, name, t in slots]
    outside = placement.local_coord() is None
    run_args = [_stand_in(a) if outside and isinstance(a, GlobalTensor) else p for a, p in zip(boxed, local_args)]
    swap = Swap(
        [Slot(table, name) for table, name, _ in slots], [_stand_in(t) for _, _, t in slots] if outside else local_slots
    )
    with outside_global_mode(), swap:
        result = fn(*run_args, **kwargs)
    flat, spec = tree_flatten(result)
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if len(positions) != len(out_sbps):
        raise ValueError(f"{what}: the function returned {len(positions)} tensors, out_sbps lists {len(out_sbps)}")
    outs = [flat[i].new_empty((0,)) if outside else flat[i] for i in positions]  # (outside: no part, nothing kept)
    needing = [t for t in local_args + local_slots if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing and torch.is_grad_enabled():
        for k, (out, sbp) in enumerate(zip(outs, out_sbps)):
            _check_output(out, sbp, divided, f"{what}: output {k}")
        outs = _reaching_every_input(outs, needing)
    for k, (out, sbp) in enumerate(zip(outs, out_sbps)):
        refuse_value_dependent(out.shape, f"{what}: output {k}'s part on this rank")
        if out_shapes is None:
            flat[positions[k]] = to_global(out, placement, sbp)
        else:
            meta = GlobalMeta(tuple(out_shapes[k]), out.dtype, placement, sbp)
            flat[positions[k]] = _Wrap.apply(_checked_part(out, meta, f"{what}: output {k}"), meta)
    return tree_unflatten(flat, spec)


def _stand_in(x: GlobalTensor) -> torch.Tensor:
    """Zeros shaped as the part of ``x`` at the placement's first coordinate: what a rank outside the placement runs
    a region on (its own parts are empty), so that the function meets parts of the dims it is written for. (A
    function that reads its values may still raise on zeros alone: a Cholesky factorization; the ranks inside then
    raise at their next collective with that rank.)"""
    meta = x._meta
    return torch.zeros(meta.local_shape((0,) * meta.placement.ndim), dtype=meta.dtype, device=x._local.device)


def _checked_part(local: torch.Tensor, meta: GlobalMeta, what: str) -> torch.Tensor:
    expected = meta.local_shape(meta.placement.local_coord())
    if tuple(local.shape) != tuple(expected):
        raise ValueError(
            f"{what}: this rank's part has shape {tuple(local.shape)}, but a {meta.shape} tensor laid out as "
            f"{meta.sbp} has a part of shape {tuple(expected)} here"
        )
    return local


def _normalized(sbps, args, placement: Placement, what: str) -> tuple:
    if sbps is None:
        sbps = (None,) * len(args)
    if len(sbps) != len(args):
        raise ValueError(f"{what}: in_sbps has {len(sbps)} entries for {len(args)} positional arguments")
    out = []
    for i, (a, sbp) in enumerate(zip(args, sbps)):
        if isinstance(a, GlobalTensor):
            if sbp is None:
                raise ValueError(f"{what}: argument {i} is a global tensor; in_sbps must give its layout")
            out.append(normalize_sbp(sbp, placement, a.dim(), a.dtype))
        elif sbp is not None:
            raise TypeError(f"{what}: in_sbps gives argument {i} a layout, but it is a {type(a).__name__}")
        else:
            out.append(None)
    return tuple(out)


def _placement_of(args, slots, what: str) -> Placement:
    found = {a.placement for a in args if isinstance(a, GlobalTensor)} | {t.placement for _, _, t in slots}
    if len(found) != 1:
        raise ValueError(
            f"{what}: the global tensors a region reads must share one placement, found "
            f"{sorted(map(str, found)) or 'none'}"
        )
    return found.pop()


def _out_sbps(out_sbps, placement: Placement) -> list:
    """One output's SBP (or its tuple, one per placement axis), or a list of them, as a list of tuples."""
    kinds = (Split, Broadcast, Partial)
    single = isinstance(out_sbps, kinds) or (
        isinstance(out_sbps, tuple) and len(out_sbps) == placement.ndim and all(isinstance(s, kinds) for s in out_sbps)
    )
    listed = [out_sbps] if single else list(out_sbps)
    return [(s,) * placement.ndim if isinstance(s, kinds) else tuple(s) for s in listed]


def local_map(fn, in_sbps, out_sbps, *, out_shapes=None):
    """Make ``fn`` a region that runs on local parts (the module docstring says what the gradients are).

    Args:
        fn: a function of plain tensors; or an ``nn.Module``, whose forward becomes the region, in place, with its
            global parameters and buffers seen as their local parts (the module is returned).
        in_sbps: per positional argument, the SBP (or tuple, one per placement axis) its global tensor is
            converted to before ``fn`` sees its part; None for arguments that are not global tensors.
        out_sbps: the SBP of the tensor ``fn`` returns (one SBP, or a tuple with one per placement axis), or a list
            of them, one per tensor it returns in ``tree_flatten`` order.
        out_shapes: a callable taking the region's arguments (global tensors) and returning the logical shape of
            each output, in that order. Without it, the ranks agree on the shapes in one small exchange per call,
            and split parts may then be uneven in any way.

    Every rank calls the region, as every rank runs every op on global tensors. Keyword arguments are passed
    through as they are and must not be global tensors."""

    def region(*args, **kwargs):
        name = getattr(fn, "__qualname__", type(fn).__name__)
        what = f"local_map({name})"
        if any(isinstance(v, GlobalTensor) for v in tree_flatten(kwargs)[0]):
            raise TypeError(f"{what}: pass global tensors positionally, with their layouts in in_sbps")
        slots = global_slots(fn) if isinstance(fn, nn.Module) else []
        placement = _placement_of(args, slots, what)
        sbps = _normalized(in_sbps, args, placement, what)
        shapes = None if out_shapes is None else _as_shape_list(out_shapes(*args, **kwargs))
        body = original if isinstance(fn, nn.Module) else fn
        return run_locally(body, placement, args, sbps, _out_sbps(out_sbps, placement), out_shapes=shapes,
                           slots=slots, kwargs=kwargs, what=what)  # fmt: skip

    if isinstance(fn, nn.Module):
        original = fn.forward
        fn.forward = region
        return fn
    return region


def _as_shape_list(shapes) -> list:
    one = isinstance(shapes, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in shapes)
    return [tuple(shapes)] if one else [tuple(s) for s in shapes]
