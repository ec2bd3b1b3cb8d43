"""Writes that torch makes through views which sbp_torch makes from copies: ``x[index] = value`` where the index
cuts a dim that ``x`` splits, ``x.fill_diagonal_``; and ``x.data = value``, which torch sets on the wrapper alone.

Torch assigns ``x[index] = value`` through a view of ``x`` (``slice``, ``select``) and a copy into that view. Where
the index cuts a dim that ``x`` splits over some placement axis, the view's rows lie on several ranks, so sbp_torch
makes it from a boxed copy of ``x``, and a copy into it would not reach ``x``. Such an assignment is written instead
as a masked write over the positions the index picks (a boolean mask of ``x``'s shape, the same on every rank):
``masked_fill_`` for one value, else ``copy_`` of a ``where`` between ``x`` and the value placed at those positions.
Both run on ``x``'s parts in its own layout (no gather) and carry gradients to ``x`` and to the value. Only indices
of ints, slices, ``...`` and ``None`` are concerned: an index holding tensors or booleans is ``index_put_`` in
torch already. ``fill_diagonal_`` (a write through ``as_strided``) becomes a masked fill the same way."""

import torch

from .._layout import GlobalMeta, Split, broadcast
from .._tensor import GlobalTensor

SETITEM = torch._C.TensorBase.__setitem__
FILL_DIAGONAL = torch._C.TensorBase.fill_diagonal_
DATA = torch._C.TensorBase.__dict__["data"]  # (``t.data = v`` reaches __torch_function__ as its ``__set__``)


def _cut_dims(index, ndim: int) -> list[int]:
    """The dims of a tensor of ``ndim`` dims that a basic ``index`` cuts (by an int, or a slice other than ``:``);
    none for an index with anything else in it."""
    entries = index if isinstance(index, tuple) else (index,)
    if not all(e is None or e is Ellipsis or isinstance(e, slice) or type(e) is int for e in entries):
        return []
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    cut, dim = [], 0
    for e in entries:
        if e is Ellipsis:
            dim += ndim - consumed
        elif e is not None:
            if e != slice(None):
                cut.append(dim)
            dim += 1
    return cut


def through_a_copy(x, index) -> bool:
    """Whether ``x[index]`` of the global tensor ``x`` is made from a boxed copy of ``x`` (see the module docstring)."""
    if not isinstance(x, GlobalTensor):
        return False
    meta = x._meta  # (the metadata, not x.dim(): a torch function would come back here)
    split = {s.dim for s in meta.sbp if isinstance(s, Split)}
    if not split:  # (the common case, answered first)
        return False
    return any(dim in split for dim in _cut_dims(index, len(meta.shape)))


def assign(x: GlobalTensor, index, value) -> None:
    """``x[index] = value`` as a masked write over the positions the index picks (see the module docstring)."""
    meta, device = x._meta, x._local.device
    picked = torch.zeros(meta.shape, dtype=torch.bool, device=device)
    picked[index] = True  # (plain tensors: the same mask on every rank, raising torch's own index errors)
    mask = _broadcast_on(picked, x)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 and not isinstance(value, GlobalTensor):
        x.masked_fill_(mask, value)
        return
    if not isinstance(value, GlobalTensor):  # (implicit broadcast let it through, as the same on every rank)
        value = _broadcast_on(value, x)
    placed = _broadcast_on(torch.zeros(meta.shape, dtype=meta.dtype, device=device), x)
    placed[index] = value  # (a broadcast tensor: a view of it shares its part)
    x.copy_(torch.where(mask, placed, x))


def set_data(x: GlobalTensor, value) -> None:
    """``x.data = value``: the wrapper takes ``value``'s metadata (torch's own setter) and its part and layout."""
    if not isinstance(value, GlobalTensor):  # (implicit broadcast let it through, as the same on every rank)
        value = _broadcast_on(value, x)
    with torch._C.DisableTorchFunctionSubclass():
        DATA.__set__(x, value)
    x._local, x._meta = value._local, value._meta


def fill_diagonal(x: GlobalTensor, fill_value, wrap: bool = False) -> GlobalTensor:
    """``x.fill_diagonal_(fill_value, wrap)`` as a masked fill (see the module docstring)."""
    picked = torch.zeros(x._meta.shape, dtype=torch.bool, device=x._local.device).fill_diagonal_(True, wrap=wrap)
    return x.masked_fill_(_broadcast_on(picked, x), fill_value)


def _broadcast_on(t: torch.Tensor, x: GlobalTensor) -> GlobalTensor:
    """The plain ``t``, the same on every rank, as a broadcast global tensor on ``x``'s placement (nothing moves;
    a rank outside the placement keeps an empty part)."""
    placement = x.placement
    meta = GlobalMeta(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim)
    return GlobalTensor(t if placement.local_coord() is not None else t.new_empty(0), meta)
