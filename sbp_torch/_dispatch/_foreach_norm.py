"""``_foreach_norm`` on global tensors with one all-reduce per group of like tensors, not one per tensor (index by
index, ``clip_grad_norm_`` would pay a collective per split gradient, or through the fallback a gather of each).

Each rank takes its parts' norms in one local ``_foreach_norm``, as statistics that add up across parts
(``norm_statistic``); those of the tensors sharing a placement and split axes are stacked, all-reduced once per split
axis and turned back into norms: broadcast 0-dim tensors, as ``linalg_vector_norm`` gives. Tensors with a partial axis
(a norm of a sum is not a sum of norms) are first reduced to their layout without partial axes."""

import torch

from .. import _comm as comm
from .._boxing import box_local
from .._layout import GlobalMeta, Split, broadcast, partials_as_broadcast
from .._signatures import norm_statistic
from .._tensor import GlobalTensor

aten = torch.ops.aten


def foreach_norm(func, args, kwargs):
    """``aten._foreach_norm.Scalar(tensors, ord=2, dtype=None)`` on a list of global tensors."""
    tensors = list(args[0])
    order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    locals_, metas = [], []
    for t in tensors:
        meta, local = t._meta, t._local
        whole = partials_as_broadcast(meta.sbp)
        if whole != meta.sbp:
            local, meta = box_local(local, meta, whole), meta.with_sbp(whole)
        locals_.append(local)
        metas.append(meta)
    statistic = norm_statistic(order)
    members = [i for i, m in enumerate(metas) if m.placement.local_coord() is not None]
    filled = [i for i in members if locals_[i].numel() > 0]  # an uneven split may leave a part empty
    norms = {}
    if filled:
        norms = dict(zip(filled, aten._foreach_norm.Scalar([locals_[i] for i in filled], order, dtype)))
    for i in members:
        if i not in norms:  # (the norm whose statistic is the empty one: inf for a negative order, whose ** is 0)
            empty = torch.full((), statistic.empty, dtype=dtype or metas[i].dtype, device=locals_[i].device)
            norms[i] = statistic.to_norm(empty)
    groups: dict = {}  # (placement, split axes) -> indices, in order
    for i in members:
        axes = tuple(a for a, s in enumerate(metas[i].sbp) if isinstance(s, Split))
        groups.setdefault((metas[i].placement, axes), []).append(i)
    for (placement, axes), indices in groups.items():
        if not axes:
            continue
        stats = torch.stack([statistic.of_norm(norms[i]) for i in indices])
        for axis in axes:
            stats = comm.all_reduce(stats, statistic.op, comm.axis_group(placement, axis))
        for i, value in zip(indices, statistic.to_norm(stats).unbind()):
            norms[i] = value
    out = []
    for i, meta in enumerate(metas):
        out_dtype = dtype or meta.dtype
        result = GlobalMeta((), out_dtype, meta.placement, (broadcast,) * meta.placement.ndim)
        local = norms.get(i)
        if local is None:  # a rank outside the placement holds nothing
            local = torch.empty(0, dtype=out_dtype, device=meta.placement.device())
        out.append(GlobalTensor(local, result))
    return out


# foreach ops with their own path on lists of global tensors: op -> implementation(func, args, kwargs)
COALESCED = {aten._foreach_norm.Scalar: foreach_norm}
