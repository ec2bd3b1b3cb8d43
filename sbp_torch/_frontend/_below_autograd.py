"""The ordinary way for a torch function on global tensors: through autograd down to ``__torch_dispatch__``."""

import torch

# torch's C++ helper that calls a function with torch functions off: cheaper than a context manager per call,
# and reading a getter such as ``requires_grad`` inside does not come back to ``__torch_function__``.
without_torch_function = torch._C._disabled_torch_function_impl


def below_autograd(func, types, args, kwargs):
    """Run ``func`` with torch functions off, so that autograd records it and its aten ops reach dispatch."""
    try:
        # (kwargs=None reaches getters such as Tensor.dtype as keyword arguments: leave it out instead)
        if kwargs:
            return without_torch_function(func, types, args, kwargs)
        return without_torch_function(func, types, args)
    except RuntimeError as err:
        if "data is not allocated" not in str(err):
            raise
        values_read(func, err)


def run_below_autograd(func, args, kwargs):
    """``below_autograd`` where torch functions are off already."""
    try:
        return func(*args, **kwargs) if kwargs else func(*args)
    except RuntimeError as err:
        if "data is not allocated" not in str(err):
            raise
        values_read(func, err)


def values_read(func, err: RuntimeError):
    """Raise the clear error for ``err``: a C++ composite read the wrapper's own storage, which is empty
    (tensor_split's index tensor)."""
    raise TypeError(
        f"{getattr(func, '__name__', func)} reads the values of a global tensor argument directly, "
        "which sbp_torch cannot intercept; pass that argument as a Python list or a plain tensor "
        "(full_tensor())"
    ) from err
