"""Assignment through an index that cuts a dim a global tensor splits: ``x[index] = value``, and writes into
``x[index]``.

Torch assigns through a view of ``x`` (``slice``, ``select``) and a copy into that view. Where the index cuts a dim
that ``x`` splits over some placement axis, the view's rows lie on several ranks, so sbp_torch makes it from a boxed
copy of ``x``, and a write into it would not reach ``x``. So:

* ``x[index] = value`` is written as ``x.index_put_`` with one tensor of positions per dim of ``x`` (an open grid
  of the rows, columns, ... that the index picks), which writes into ``x`` in its own layout (the op's rule boxes
  what it must);
* ``x[index]`` is a ``CopiedView``: a global tensor that remembers where it was taken from and, after an in-place
  op on it (``y.add_(1)``, ``y[0] = 5``, the ``+=`` of ``x[index] += 1``), writes itself back (``x[index] = y``),
  as torch's view would have written through; where ``x`` was written since (its version counter moved), it reads
  ``x[index]`` again before an op uses it, as a view would see the write. Views of it taken by other ops than
  indexing (``y.view``, ``y.t()``) are plain global tensors: writes through those do not reach ``x``.

Only indices of ints, slices, ``...`` and ``None`` are concerned: an index holding tensors or booleans gives a copy
in torch too, and its assignment is ``index_put_`` in torch already."""

import torch

from .._layout import GlobalMeta, Split, broadcast
from .._tensor import GlobalTensor

SETITEM = torch._C.TensorBase.__setitem__
GETITEM = torch._C.TensorBase.__getitem__
# In-place methods that are not named with a trailing underscore, and methods so named that change no value
_IN_PLACE_DUNDERS = frozenset(
    f"__i{name}__" for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
) | {"__ilshift__", "__irshift__", "__setitem__"}
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "rename_"})


def _cuts(index, ndim: int) -> list | None:
    """The ``(dim, int or slice)`` pairs of a basic ``index`` into a tensor of ``ndim`` dims (full slices left out);
    None for an index with anything else in it."""
    entries = index if isinstance(index, tuple) else (index,)
    if not all(e is None or e is Ellipsis or isinstance(e, slice) or type(e) is int for e in entries):
        return None
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    cuts, dim = [], 0
    for e in entries:
        if e is Ellipsis:
            dim += ndim - consumed
        elif e is not None:
            if e != slice(None):
                cuts.append((dim, e))
            dim += 1
    return cuts


def through_a_copy(x, index) -> bool:
    """Whether ``x[index]`` of the global tensor ``x`` is made from a boxed copy of ``x`` (see the module docstring)."""
    if not isinstance(x, GlobalTensor):
        return False
    meta = x._meta  # (the metadata, not x.dim(): a torch function would come back here)
    cuts = _cuts(index, len(meta.shape))
    split = {s.dim for s in meta.sbp if isinstance(s, Split)}
    return bool(cuts) and any(dim in split for dim, _ in cuts)


def assign(x: GlobalTensor, index, value) -> None:
    """``x[index] = value`` as ``x.index_put_`` over the open grid of positions the index picks."""
    shape, device = x._meta.shape, x._local.device
    cuts, grid = dict(_cuts(index, len(shape))), []
    for dim, size in enumerate(shape):
        cut = cuts.get(dim, slice(None))
        if isinstance(cut, slice):
            positions = list(range(*cut.indices(size)))
        elif -size <= cut < size:
            positions = [cut % size]
        else:
            raise IndexError(f"index {cut} is out of bounds for dimension {dim} with size {size}")
        at = torch.tensor(positions, dtype=torch.long, device=device)
        grid.append(_broadcast_on(at.reshape([1] * dim + [-1] + [1] * (len(shape) - dim - 1)), x))
    picked = tuple(g.shape[dim] for dim, g in enumerate(grid))
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=x._meta.dtype, device=device)
    if value.dim():
        if not isinstance(value, GlobalTensor):  # (implicit broadcast let it through, as the same on every rank)
            value = _broadcast_on(value, x)
        value = value.broadcast_to(torch.empty(shape, device="meta")[index].shape).reshape(picked)
    x.index_put_(tuple(grid), value.to(x._meta.dtype))


def _broadcast_on(t: torch.Tensor, x: GlobalTensor) -> GlobalTensor:
    """The plain ``t``, the same on every rank, as a broadcast global tensor on ``x``'s placement (nothing moves;
    a rank outside the placement keeps an empty part)."""
    placement = x.placement
    meta = GlobalMeta(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim)
    return GlobalTensor(t if placement.local_coord() is not None else t.new_empty(0), meta)


class CopiedView(GlobalTensor):
    """``x[index]`` made from a boxed copy of ``x``: it reads ``x`` again where ``x`` was written since, and an
    in-place op on it writes it back into ``x``, as a view would read and write through."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for arg in (*args, *(kwargs or {}).values()):
            if type(arg) is CopiedView:
                _refreshed(arg)
        result = GlobalTensor.__torch_function__.__func__(GlobalTensor, func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES) or name in _IN_PLACE_DUNDERS:
            written = args[0] if args else None
            if type(written) is CopiedView:
                base, index = written._copied_from
                written._base_version = _version(base)  # (autograd counts a view's writes on its base's counter)
                base[index] = written
                written._base_version = _version(base)
        return result


def _version(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():  # (a getter through __torch_function__ costs a Python entry)
        return t._version


def _refreshed(view: CopiedView) -> None:
    """Read ``view`` again from its base where the base was written since it was taken (or last read)."""
    base, index = view._copied_from
    if type(base) is CopiedView:
        _refreshed(base)
    now = _version(base)
    if now != view._base_version:
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            fresh = GETITEM(base, index)  # (with torch functions off: the dispatcher's copy, not a CopiedView)
            view._local.copy_(fresh._local)
        view._base_version = now


def copied_view(view: GlobalTensor, base: GlobalTensor, index) -> GlobalTensor:
    """``view`` (``base[index]``, made from a copy) as a ``CopiedView`` of ``base``."""
    view.__class__ = CopiedView
    view._copied_from, view._base_version = (base, index), _version(base)
    return view
