"""GlobalTensor: a ``torch.Tensor`` subclass that reports the logical tensor and holds this rank's part."""

from __future__ import annotations

import functools

import torch

from ._layout import GlobalMeta


_without_torch_function = torch._C._disabled_torch_function_impl
# (size, strides, storage_offset, memory_format, dtype, layout, device, pin_memory, requires_grad, ...)
_new_wrapper = torch.Tensor._make_wrapper_subclass


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class GlobalTensor(torch.Tensor):
    """A logical tensor laid out over the ranks of a placement by one SBP per placement axis.

    PyTorch sees the logical shape, stride and dtype; the data of this rank is ``to_local()``. Every aten op
    on it goes through ``__torch_dispatch__`` (see ``_dispatch.py``), which picks a layout and inserts the
    collectives, except the calls that autograd does not record and that are known to run on the local
    parts as they are (``_local_calls.py``). Build one with ``Tensor.to_global`` or the creation functions, not directly.
    """

    _local: torch.Tensor
    _meta: GlobalMeta
    __slots__ = ("_local", "_meta")

    @staticmethod
    def __new__(cls, local: torch.Tensor, meta: GlobalMeta, requires_grad: bool = False):
        # The wrapper never carries a conjugate / negative bit, and inside __torch_dispatch__ torch no longer
        # honours them on the parts: a lazily conjugated part would be read unconjugated by the next op.
        if local.is_conj():
            local = local.resolve_conj()
        if local.is_neg():
            local = local.resolve_neg()
        # (positional: torch parses keywords of _make_wrapper_subclass more slowly, on every op's output)
        out = _new_wrapper(
            cls, meta.shape, contiguous_strides(meta.shape), None, None, meta.dtype, torch.strided, local.device,
            False, requires_grad,
        )
        out._local = local
        out._meta = meta
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Getters (shape, grad, ...) and functions known to return views go straight on. Batched matmuls
        # next: torch would flatten them in a way that loses a split of the heads dim (see _batched_matmul.py).
        # Then a call autograd does not record may run on the local parts directly (_local_calls.py).
        # Everything else goes to __torch_dispatch__ below autograd. Both run with torch functions off,
        # through torch's own C++ helper (cheaper than a context manager per call), so that reading a getter
        # such as requires_grad does not come back here.
        if func in _local_calls.DISPATCH_ONLY:
            return below_autograd(func, types, args, kwargs)
        if func in _batched_matmul.MATMUL_FUNCS and _batched_matmul.applies(func, args, kwargs or {}):
            return _batched_matmul.BatchedMatmul.apply(*args)
        result = _without_torch_function(_local_calls.call, types, (func, types, args, kwargs))
        if result is not _local_calls.NOT_HANDLED:
            return result
        return below_autograd(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    @property
    def placement(self):
        """The placement whose ranks hold this tensor."""
        return self._meta.placement

    @property
    def sbp(self) -> tuple:
        """One SBP per placement axis, as a tuple."""
        return self._meta.sbp

    def to_local(self, *, grad_sbp=None) -> torch.Tensor:
        """This rank's part (empty on a rank outside the placement). Differentiable; see ``sbp_torch.to_local``."""
        from ._conversions import to_local

        return to_local(self, grad_sbp=grad_sbp)

    def full_tensor(self) -> torch.Tensor:
        """The logical tensor as a plain tensor on every rank of the placement. Differentiable."""
        from ._conversions import full_tensor

        return full_tensor(self)

    def __repr__(self) -> str:
        # No collective here: repr must be safe to call on one rank only (printing, debuggers).
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"GlobalTensor({self._meta}{grad},\n  local={self._local!r})"

    def __tensor_flatten__(self):
        return ["_local"], self._meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return GlobalTensor(inner["_local"], meta)


def wrap_fresh(local: torch.Tensor, meta: GlobalMeta, strides: tuple) -> GlobalTensor:
    """``GlobalTensor(local, meta)`` for a part that is an op's new result (it carries no lazy conjugate
    or negative bit), given the logical strides: the shorter constructor of the local calls' hot path."""
    out = _new_wrapper(GlobalTensor, meta.shape, strides, None, None, meta.dtype, torch.strided, local.device)
    out._local = local
    out._meta = meta
    return out


def below_autograd(func, types, args, kwargs):
    """Run a torch function on global tensors the ordinary way: through autograd to ``__torch_dispatch__``."""
    try:
        # (kwargs=None reaches getters such as Tensor.dtype as keyword arguments: leave it out instead)
        if kwargs:
            return _without_torch_function(func, types, args, kwargs)
        return _without_torch_function(func, types, args)
    except RuntimeError as err:
        if "data is not allocated" not in str(err):
            raise
        # A C++ composite read the wrapper's own storage, which is empty (tensor_split's index tensor)
        raise TypeError(
            f"{getattr(func, '__name__', func)} reads the values of a global tensor argument directly, "
            "which sbp_torch cannot intercept; pass that argument as a Python list or a plain tensor "
            "(full_tensor())"
        ) from err


# The dispatcher, set by ``_dispatch`` when it is imported: it needs this module, so this one cannot import
# it at the top, and an import inside ``__torch_dispatch__`` would cost on every op.
dispatch = None

from . import _batched_matmul, _local_calls  # noqa: E402  (they need GlobalTensor, defined above)
