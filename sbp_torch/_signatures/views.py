"""View and shape ops: permutations, slices, squeezes, expands, splits, concatenation, reshapes.

These ops move values without combining them, so ``B`` and every partial (sum, max, min) pass through
unchanged. A split passes through when the op leaves the split dim alone; it then names the dim that the
split dim becomes (``S(1)`` of ``x.t()`` is ``S(0)``). A dim that the op changes (sliced, selected, flipped,
rolled, expanded from 1, squeezed, concatenated along) cannot stay split; such inputs are boxed first.

``view``/``_unsafe_view`` pair the input dims and the output dims (size-1 dims aside) into consecutive blocks
with equal products: ``(6, 4, 5) -> (24, 5)`` has the blocks ``(6, 4) -> (24,)`` and ``(5,) -> (5,)``. A split
of input dim ``d`` maps to the first dim of its block's output, if ``d`` is the first dim of its block and either

* the block is one unchanged dim (any split, balanced uneven ones included), or
* the split is exact: the input dim and the output dim are both divisible by the number of parts along
  ``d`` on the N-D placement (the product of the sizes of the axes splitting it; checked in ``check_nd``).

Why exact: a rank's rows of a merged dim are a contiguous run of the block's elements, which is a run of
rows of the output dim only if the run's length and start are multiples of the output's inner size. With
balanced uneven parts (5 rows of 4 on 2 ranks: 12 and 8 elements) the runs do not match the balanced parts
of the output (20 elements on 2 ranks: 10 and 10), so uneven splits survive only unchanged dims.

Ops that take a size (``view``, ``expand``, ``slice_backward``, ...) or that squeeze by size run through
local functions that hand the local op the local sizes; ``view`` reshapes, because the local part of a view of a
transposed tensor need not be viewable even where the logical tensor (always contiguous to torch) is.
"""

import torch

from .core import (
    B,
    LocalContext,
    OpCall,
    P,
    S,
    Signature,
    Split,
    TensorInfo,
    floats_only,
    normalize_dim,
    pass_through,
    register,
    sig,
)

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    return normalize_dim(dim, ndim) if ndim else 0


# Which input dims keep their split, and the output dim each becomes: one function per op.


def _t(call: OpCall) -> dict[int, int]:
    n = call["self"].ndim
    return {0: 1, 1: 0} if n == 2 else {d: d for d in range(n)}


def _transpose(call: OpCall) -> dict[int, int]:
    n = call["self"].ndim
    d0, d1 = _norm(call["dim0"], n), _norm(call["dim1"], n)
    swap = {d0: d1, d1: d0}
    return {d: swap.get(d, d) for d in range(n)}


def _permute(call: OpCall) -> dict[int, int]:
    n = call["self"].ndim
    dims = [_norm(d, n) for d in call["dims"]]
    return {d: dims.index(d) for d in range(n)}


def _unsqueeze(call: OpCall) -> dict[int, int]:
    n = call["self"].ndim
    dim = normalize_dim(call["dim"], n + 1)
    return {d: d + (d >= dim) for d in range(n)}


def squeezed_dims(call_func, shape: tuple[int, ...], arguments) -> list[int]:
    """The dims that the squeeze actually removes: the requested ones of logical size 1."""
    n = len(shape)
    if call_func == aten.squeeze.dim:
        requested = [arguments["dim"]]
    elif call_func == aten.squeeze.dims:
        requested = list(arguments["dim"])
    else:
        requested = range(n)
    return sorted({_norm(d, n) for d in requested if n and shape[_norm(d, n)] == 1})


def _squeeze(call: OpCall) -> dict[int, int]:
    shape = call["self"].shape
    removed = squeezed_dims(call.func, shape, call)
    return {d: d - sum(r < d for r in removed) for d in range(len(shape)) if d not in removed}


def _expand(call: OpCall) -> dict[int, int]:
    shape, out = call["self"].shape, call.outputs[0].shape
    lead = len(out) - len(shape)
    return {d: d + lead for d in range(len(shape)) if shape[d] == out[d + lead]}


def _slice(call: OpCall) -> dict[int, int]:
    shape, out = call["self"].shape, call.outputs[0].shape
    dim = _norm(call.get("dim", 0), len(shape))
    whole = shape[dim] == out[dim] and call.get("step", 1) == 1
    return {d: d for d in range(len(shape)) if d != dim or whole}


def _drop_dim(call: OpCall) -> dict[int, int]:
    """select/unbind: the dim disappears."""
    n = call["self"].ndim
    dim = _norm(call.get("dim", 0), n)
    return {d: d - (d > dim) for d in range(n) if d != dim}


def _diagonal(call: OpCall) -> dict[int, int]:
    """diagonal: the two dims become one, the last; the others keep their order in front of it."""
    n = call["self"].ndim
    taken = {_norm(call.get("dim1", 0), n), _norm(call.get("dim2", 1), n)}
    kept = [d for d in range(n) if d not in taken]
    return {d: kept.index(d) for d in kept}


def _other_dims(dims_argument: str, default):
    """Ops that change only the dims named by an argument (split, flip, roll, rot90, narrow_copy, unfold)."""

    def kept(call: OpCall) -> dict[int, int]:
        n = call["self"].ndim
        changed = call.get(dims_argument, default)
        changed = {_norm(d, n) for d in (changed if isinstance(changed, (list, tuple)) else [changed])}
        return {d: d for d in range(n) if d not in changed}

    return kept


def _roll(call: OpCall) -> dict[int, int]:
    return _other_dims("dims", [])(call) if call.get("dims", []) else {}  # no dims: rolls the flattened tensor


def _repeat(call: OpCall) -> dict[int, int]:
    n = call["self"].ndim
    repeats = call["repeats"]
    lead = len(repeats) - n
    return {d: d + lead for d in range(n) if repeats[d + lead] == 1}


def _slice_or_unfold_backward(call: OpCall) -> dict[int, int]:
    n = len(call["input_sizes"])
    dim = _norm(call["dim"], n)
    return {d: d for d in range(n) if d != dim}


def _select_backward(call: OpCall) -> dict[int, int]:
    n = len(call["input_sizes"])
    dim = _norm(call["dim"], n)
    return {d: d + (d >= dim) for d in range(n - 1)}


def view_blocks(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Consecutive groups of dims (size-1 dims left out) of ``src`` and ``dst`` with equal products. ``src`` and
    ``dst`` must have the same, non-zero number of elements."""
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    blocks, i, j = [], 0, 0
    while i < len(a):
        ins, outs = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                outs.append(b[j])
                pb *= dst[b[j]]
                j += 1
        blocks.append((ins, outs))
    return blocks


def _exact_view_splits(call: OpCall, combo: tuple[Signature, ...]) -> bool:
    """A split of a merged or split block must cut it into equal parts on both sides (module docstring)."""
    src, dst = call["self"].shape, call.outputs[0].shape
    parts: dict[int, int] = {}
    for size, signature in zip(call.mesh_shape, combo):
        layout = signature.sbp_of("self")
        if isinstance(layout, Split):
            parts[layout.dim] = parts.get(layout.dim, 1) * size
    if not parts:
        return True
    for ins, outs in view_blocks(src, dst):
        n = parts.get(ins[0], 1)
        if (len(ins), len(outs)) != (1, 1) and (src[ins[0]] % n or dst[outs[0]] % n):
            return False
    return True


# op -> (kept dims, local function or None). Ops with one take sizes that must be the local ones.
SINGLE_INPUT_VIEWS = {
    aten.t.default: (_t, None),
    aten.transpose.int: (_transpose, None),
    aten.permute.default: (_permute, None),
    aten.unsqueeze.default: (_unsqueeze, None),
    aten.squeeze.default: (_squeeze, "squeeze"),
    aten.squeeze.dim: (_squeeze, "squeeze"),
    aten.squeeze.dims: (_squeeze, "squeeze"),
    aten.expand.default: (_expand, "local_size"),
    aten.slice.Tensor: (_slice, None),
    aten.select.int: (_drop_dim, None),
    aten.diagonal.default: (_diagonal, None),
    aten.unbind.int: (_drop_dim, None),
    aten.split.Tensor: (_other_dims("dim", 0), None),
    aten.split_with_sizes.default: (_other_dims("dim", 0), None),
    aten.flip.default: (_other_dims("dims", []), None),
    aten.roll.default: (_roll, None),
    aten.rot90.default: (_other_dims("dims", [0, 1]), None),
    aten.narrow_copy.default: (_other_dims("dim", 0), None),
    aten.unfold.default: (_other_dims("dimension", 0), None),
    aten.repeat.default: (_repeat, None),
    aten.slice_backward.default: (_slice_or_unfold_backward, "local_size"),
    aten.select_backward.default: (_select_backward, "local_size"),
    aten.unfold_backward.default: (_slice_or_unfold_backward, "local_size"),
}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default}

# The size argument that the local function "local_size" replaces with the local output shape.
SIZE_ARGUMENT = {
    aten.expand.default: "size",
    aten.slice_backward.default: "input_sizes",
    aten.select_backward.default: "input_sizes",
    aten.unfold_backward.default: "input_sizes",
}


def _local_size(func, ctx: LocalContext):
    return ctx.call(func, **{SIZE_ARGUMENT[func]: ctx.local_output_shape()})


# (the local function changes only the sizes the op is told, to the output's local shape)
_local_size.sizes_only = True


def _local_squeeze(func, ctx: LocalContext):
    # A split dim of logical size > 1 may have a local size of 1: squeeze only the logical size-1 dims.
    return aten.squeeze.dims(ctx.arguments["self"], squeezed_dims(func, ctx.inputs[0].shape, ctx.arguments))


def _reshape(func, ctx: LocalContext):
    return ctx.arguments["self"].reshape(ctx.local_output_shape())


# (what the dispatcher may rely on: the local output is the one input's part reshaped to the output's local shape,
# which its C hit path then runs itself)
_reshape.reshapes_part = True
_reshape.sizes_only = True


LOCAL_FNS = {"local_size": _local_size, "squeeze": _local_squeeze, "reshape": _reshape}


def _one_input(call: OpCall, kept: dict[int, int], local_fn: str | None) -> list[Signature]:
    name = call.func._schema.arguments[0].name  # self, or the gradient of a view's backward
    splits = [Signature(((name, S(d)),), S(e), local_fn) for d, e in kept.items()]
    return splits + pass_through([name], local_fn)


# Every argument the kept-dims functions above read.
VIEW_ARGUMENTS = ("dim", "dim0", "dim1", "dim2", "dims", "step", "repeats", "input_sizes", "dimension")


@register(*SINGLE_INPUT_VIEWS, reads=VIEW_ARGUMENTS, local_fns=LOCAL_FNS)
def single_input_view(call: OpCall) -> list[Signature]:
    kept, local_fn = SINGLE_INPUT_VIEWS[call.func]
    return _one_input(call, kept(call), local_fn)


@register(*VIEWS, reads=("size",), check_nd=_exact_view_splits, local_fns=LOCAL_FNS)
def view(call: OpCall) -> list[Signature]:
    src, dst = call["self"].shape, call.outputs[0].shape
    kept = {} if 0 in src else {ins[0]: outs[0] for ins, outs in view_blocks(src, dst)}
    return _one_input(call, kept, "reshape")


def _cat_outputs(call: OpCall) -> list[TensorInfo] | None:
    tensors = [t for t in call["tensors"] if isinstance(t, TensorInfo)]
    if len(tensors) != len(call["tensors"]) or not tensors or len({t.ndim for t in tensors}) != 1:
        return None
    if not tensors[0].ndim or len({t.dtype for t in tensors}) != 1:
        return None
    try:
        dim = normalize_dim(call["dim"], tensors[0].ndim)
    except IndexError:
        return None  # the op raises
    first = tensors[0].shape
    if any(t.shape[:dim] + t.shape[dim + 1 :] != first[:dim] + first[dim + 1 :] for t in tensors):
        return None
    return [TensorInfo(first[:dim] + (sum(t.shape[dim] for t in tensors),) + first[dim + 1 :], tensors[0].dtype)]


@register(aten.cat.default, reads=("dim",), outputs=floats_only(_cat_outputs))
def cat(call: OpCall) -> list[Signature]:
    n, tensors = call.outputs[0].ndim, call["tensors"]
    # legacy: cat skips 1-D empty inputs of any other rank (a KV cache's first keys); they hold nothing, so they
    # stay broadcast while the others keep their split
    skipped = [x.ndim != n and x.shape == (0,) for x in tensors]
    if any(x.ndim != n and not skip for x, skip in zip(tensors, skipped)):
        return pass_through(["tensors"])
    dim = _norm(call.get("dim", 0), n)
    splits = [sig(S(d), tensors=tuple(B if skip else S(d) for skip in skipped)) for d in range(n) if d != dim]
    return splits + pass_through(["tensors"])


@register(aten.stack.default, reads=("dim",))
def stack(call: OpCall) -> list[Signature]:
    n = call["tensors"][0].ndim
    dim = normalize_dim(call.get("dim", 0), n + 1)
    return [sig(S(d + (d >= dim)), tensors=S(d)) for d in range(n)] + pass_through(["tensors"])


@register(aten.constant_pad_nd.default, reads=("pad", "value"))
def constant_pad(call: OpCall) -> list[Signature]:
    """Padding changes the last ``len(pad) // 2`` dims: the others may stay split. Partial sums pass only when the
    padding value is 0 (the sum of zeros); max and min pass for any value only if every rank pads alike, which
    they do not (a partial max's idle parts hold -inf), so they are boxed."""
    n = call["self"].ndim
    padded = len(call["pad"]) // 2
    splits = [sig(S(d), self=S(d)) for d in range(n - padded)]
    return splits + ([sig(P, self=P)] if call.get("value", 0) == 0 else [])
