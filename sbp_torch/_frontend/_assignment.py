"""Writes that torch makes through views which sbp_torch makes from copies: ``x[index] = value`` where the index
cuts a dim that ``x`` splits, ``x.fill_diagonal_``; and ``x.data = value``, which torch sets on the wrapper alone.

Torch assigns ``x[index] = value`` through a view of ``x`` (``slice``, ``select``) and a copy into that view. Where
the index cuts a dim that ``x`` splits over some placement axis, the view's rows lie on several ranks, so sbp_torch
makes it from a boxed copy of ``x``, and a copy into it would not reach ``x``. Such an assignment is written instead
as a masked write over the positions the index picks (a boolean mask of ``x``'s shape, the same on every rank):
``masked_fill_`` for one value, else ``copy_`` of a ``where`` between ``x`` and the value placed at those positions.
Both run on ``x``'s parts in its own layout (no gather) and carry gradients to ``x`` and to the value. An index
of tensors or lists alone is ``index_put_`` on ``x`` in torch; mixed with a basic entry that cuts a split dim
(``x[1, [0, 2]]``, ``x[0, mask]``, a 0-dim integer tensor), torch writes into the basic entry's view, so it is
concerned too (its global tensors are made whole to pick the mask). ``fill_diagonal_`` (a write through
``as_strided``) becomes a masked fill the same way.

An in-place op on ``x[index]`` itself (``x[1:3].add_(1)``, ``nn.init.normal_(x[1:3])``, and the first half of
``x[index] += v``, which Python runs as ``add_`` on ``x[index]`` and then ``x[index] = ...``) writes into that copy:
the dispatcher refuses a write into a view computed as a copy (``WriteIntoCopy``), and where the copy came from
``x[index]`` (remembered on it), the op runs on the copy and the copy is then written into ``x`` as above. A write
into a copy made otherwise (``x.diagonal()`` of split dims, ``x.unbind()``) stays refused."""

import dataclasses

import torch

from .._layout import GlobalMeta, Split, broadcast
from .._tensor import GlobalTensor

SETITEM = torch._C.TensorBase.__setitem__
FILL_DIAGONAL = torch._C.TensorBase.fill_diagonal_

GETITEM = torch._C.TensorBase.__getitem__
DATA = torch._C.TensorBase.__dict__["data"]  # (``t.data = v`` reaches __torch_function__ as its ``__set__``)


# The copy ``x[index]`` -> (x, index), for the writes into it (held by the copy; the copy holds x as its base anyway)
_INDEX_ATTRIBUTE = "_sbp_torch_indexed_from"


def remember_index(args, result):
    """``result`` of ``x[index]`` (``args``), remembering ``(x, index)`` on it where it is a copy."""
    if isinstance(result, GlobalTensor) and result._meta.copied:
        setattr(result, _INDEX_ATTRIBUTE, (args[0], args[1]))
    return result


def index_of(copy: GlobalTensor):
    """``(x, index)`` where ``copy`` is ``x[index]`` computed as a copy, else None."""
    return getattr(copy, _INDEX_ATTRIBUTE, None)


def written_back(copy: GlobalTensor, write):
    """``write()`` (an op that writes into ``copy``, which is ``x[index]`` computed as a copy) run on the copy as on
    any tensor, then the copy written into ``x`` at ``index``; what ``write()`` returns."""
    x, index = index_of(copy)
    meta = copy._meta
    copy._meta = dataclasses.replace(meta, copied=False)
    try:
        result = write()
    finally:
        copy._meta = meta
    assign(x, index, copy)
    return result


def _cut_dims(index, ndim: int) -> list[int]:
    """The dims of a tensor of ``ndim`` dims that the basic entries of ``index`` cut: an int, a slice other than
    ``:``, or a 0-dim integer tensor (which torch indexes as an int). Advanced entries (tensors, lists) take dims
    too; torch makes the basic cuts first, as views, and writes the advanced ones into that view."""
    entries = index if isinstance(index, tuple) else (index,)
    taken = [_dims_taken(e) for e in entries]
    cut, dim = [], 0
    for entry, count in zip(entries, taken):
        if entry is Ellipsis:
            dim += ndim - sum(taken)
            continue
        if type(entry) is int or isinstance(entry, slice) and entry != slice(None) or _integer_scalar(entry):
            cut.append(dim)
        dim += count
    return cut


def _dims_taken(entry) -> int:
    if entry is None or entry is Ellipsis or isinstance(entry, bool):
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype in (torch.bool, torch.uint8):
        return entry.dim()  # (a mask takes as many dims as it has)
    return 1


def _integer_scalar(entry) -> bool:
    return isinstance(entry, torch.Tensor) and entry.dim() == 0 and entry.dtype not in (torch.bool, torch.uint8)


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
    index = _plain(index)
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


def _plain(index):
    """``index`` with its global tensors whole (``full_tensor``, on every rank alike): it picks from plain masks."""
    entries = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(e, GlobalTensor) for e in entries):
        return index
    whole = tuple(e.full_tensor() if isinstance(e, GlobalTensor) else e for e in entries)
    return whole if isinstance(index, tuple) else whole[0]


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
