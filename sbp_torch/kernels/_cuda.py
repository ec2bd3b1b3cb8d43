"""CUDA implementations of the ``sbp_torch::*`` ops, from the extension built out of ``csrc/`` + ``cuda/``.

``enable_cuda_kernels()`` loads it (prebuilt or compiled just in time, ``_extension.load``) and registers a
kernel for the ``CUDA`` dispatch key of every op, forward and backward. Without it, CUDA tensors run the
pure-PyTorch reference. What the kernels do not take runs the reference too: float64, tensors of mixed
dtypes, softmax inputs of more than 4 dims, backward rows too long for a block's shared memory, and dropout
that draws nothing. docs/kernels.md says where they were compiled and checked.
"""

import torch

from . import _extension
from ._bias_dropout_add import bias_dropout_add_backward_op, bias_dropout_add_op, draws
from ._bias_gelu import bias_gelu_backward_op, bias_gelu_op
from ._cross_entropy import cross_entropy_backward_op, cross_entropy_op, reduce_loss, row_weights
from ._library import NAMESPACE
from ._norms import layer_norm_backward_op, layer_norm_op, rms_norm_backward_op, rms_norm_op
from ._softmax import scale_mask_softmax_backward_op, scale_mask_softmax_op

FAST = (torch.float32, torch.float16, torch.bfloat16)
_registered: list = []  # the Library holding the registrations (registered once; kept alive here)
_smem: dict = {}  # device index -> opt-in shared memory per block, bytes


def load_extension(verbose: bool = False):
    """The compiled kernels: prebuilt if installed, else built now from the source tree (needs nvcc)."""
    return _extension.load("_kernels_cuda", verbose)


def _fast(*tensors) -> bool:
    """Whether the kernels take these tensors: one dtype, float32, float16 or bfloat16."""
    return tensors[0].dtype in FAST and all(t.dtype == tensors[0].dtype for t in tensors)


def _fits(x: torch.Tensor, sums: int) -> bool:
    """Whether a column-reducing backward's ``sums`` float column sums of ``x``'s rows fit in shared memory."""
    index = x.device.index or 0
    if index not in _smem:
        _smem[index] = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    return x.shape[-1] * sums * 4 + 1024 <= _smem[index]  # + the kernels' own reduction scratch


def _kernels(ext) -> dict:
    """op name -> its CUDA kernel (named as the op), which falls back to the reference (``op._init_fn``) if it must."""

    def bias_gelu(x, bias, approximate):
        if not _fast(x, bias):
            return bias_gelu_op._init_fn(x, bias, approximate)
        return ext.bias_gelu(x, bias, approximate == "tanh")

    def bias_gelu_backward(grad, x, bias, approximate):
        if not (_fast(grad, x, bias) and _fits(x, 1)):
            return bias_gelu_backward_op._init_fn(grad, x, bias, approximate)
        return ext.bias_gelu_backward(grad, x, bias, approximate == "tanh")

    def bias_dropout_add(x, bias, residual, p, training):
        if not (_fast(x, bias, residual) and draws(p, training)):
            return bias_dropout_add_op._init_fn(x, bias, residual, p, training)
        gen = torch.cuda.default_generators[x.device.index or 0]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + ((x.numel() + 3) // 4 + 3) // 4 * 4)  # as sbp_torch._layout._random advances it
        return ext.bias_dropout_add(x, bias, residual, p, seed, offset)

    def bias_dropout_add_backward(grad, mask, scale):
        if not (_fast(grad) and mask.dtype == torch.bool and _fits(grad, 1)):
            return bias_dropout_add_backward_op._init_fn(grad, mask, scale)
        return ext.bias_dropout_add_backward(grad, mask, scale)

    def scale_mask_softmax(x, mask, scale, causal):
        if not _fast(x) or x.dim() > 4:
            return scale_mask_softmax_op._init_fn(x, mask, scale, causal)
        return ext.scale_mask_softmax(x, None if mask is None else mask.expand(x.shape), scale, causal)

    def scale_mask_softmax_backward(grad, y, scale):
        if not _fast(grad, y):
            return scale_mask_softmax_backward_op._init_fn(grad, y, scale)
        return ext.scale_mask_softmax_backward(grad, y, scale)

    def layer_norm(x, weight, bias, eps):
        if not _fast(x, weight, bias):
            return layer_norm_op._init_fn(x, weight, bias, eps)
        return ext.norm_forward(x, weight, bias, eps)

    def rms_norm(x, weight, eps):
        if not _fast(x, weight):
            return rms_norm_op._init_fn(x, weight, eps)
        y, _, rstd = ext.norm_forward(x, weight, None, eps)
        return y, rstd

    def layer_norm_backward(grad, x, weight, mean, rstd):
        if not (_fast(grad, x, weight) and _fast(mean, rstd) and mean.dtype == torch.float32 and _fits(x, 2)):
            return layer_norm_backward_op._init_fn(grad, x, weight, mean, rstd)
        return ext.norm_backward(grad, x, weight, mean, rstd)

    def rms_norm_backward(grad, x, weight, rstd):
        if not (_fast(grad, x, weight) and rstd.dtype == torch.float32 and _fits(x, 1)):
            return rms_norm_backward_op._init_fn(grad, x, weight, rstd)
        grad_x, grad_weight, _ = ext.norm_backward(grad, x, weight, None, rstd)
        return grad_x, grad_weight

    def cross_entropy(logits, target, ignore_index, reduction):
        if logits.dtype not in FAST:
            return cross_entropy_op._init_fn(logits, target, ignore_index, reduction)
        m, s, picked = ext.cross_entropy_stats(logits, target, 0)
        lse = m + s.log()
        loss = reduce_loss(lse - picked, target != ignore_index, reduction)
        return loss.to(logits.dtype), lse.to(logits.dtype)

    def cross_entropy_backward(grad, logits, target, lse, ignore_index, reduction):
        if logits.dtype not in FAST:
            return cross_entropy_backward_op._init_fn(grad, logits, target, lse, ignore_index, reduction)
        kept = target != ignore_index
        weights = row_weights(grad.float(), kept, reduction, kept.sum())
        return ext.cross_entropy_backward(logits, target, lse, weights, 0)

    kernels = (bias_gelu, bias_gelu_backward, bias_dropout_add, bias_dropout_add_backward, scale_mask_softmax)
    kernels += (scale_mask_softmax_backward, layer_norm, rms_norm, layer_norm_backward, rms_norm_backward)
    return {kernel.__name__: kernel for kernel in kernels + (cross_entropy, cross_entropy_backward)}


def enable_cuda_kernels(verbose: bool = False) -> None:
    """Load the extension and register its kernels as the ``CUDA`` implementations of the custom ops (once).

    They are registered on the dispatcher directly (``torch.library.Library.impl``), not through
    ``CustomOpDef.register_kernel``, whose Python wrapper (aliasing checks, a dynamo guard) would add to
    every call's fixed cost; the kernels return fresh tensors, which is what that wrapper checks."""
    ext = load_extension(verbose)
    if _registered:
        return
    lib = torch.library.Library(NAMESPACE, "IMPL")
    for name, kernel in _kernels(ext).items():
        lib.impl(name, kernel, "CUDA")
    _registered.append(lib)


__all__ = ["enable_cuda_kernels", "load_extension"]
