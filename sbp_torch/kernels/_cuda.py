"""CUDA implementations of the ``sbp_torch::*`` ops, from the extension built out of ``csrc/`` + ``cuda/``.

``enable_cuda_kernels()`` loads it (prebuilt or compiled just in time, ``_extension.load``) and registers the
forward kernels for the ``cuda`` device. Without it, CUDA tensors run the pure-PyTorch reference; float64 always
does (the kernels take fp32/fp16/bf16). docs/kernels.md says where they were compiled and checked.
"""

import torch

from . import _extension
from ._bias_dropout_add import bias_dropout_add_op, draws
from ._bias_gelu import bias_gelu_op
from ._cross_entropy import cross_entropy_backward_op, cross_entropy_op, reduce_loss, row_weights
from ._norms import layer_norm_op, rms_norm_op
from ._softmax import scale_mask_softmax_op

FAST = (torch.float32, torch.float16, torch.bfloat16)


def load_extension(verbose: bool = False):
    """The compiled kernels: prebuilt if installed, else built now from the source tree (needs nvcc)."""
    return _extension.load("_kernels_cuda", verbose)


def enable_cuda_kernels(verbose: bool = False) -> None:
    """Load the extension and register its kernels as the ``cuda`` implementations of the custom ops."""
    ext = load_extension(verbose)
    # ``op._init_fn`` is the op's pure-PyTorch definition: float64 and unsupported cases stay on it

    @bias_gelu_op.register_kernel("cuda")
    def _(x, bias, approximate):
        if x.dtype not in FAST:
            return bias_gelu_op._init_fn(x, bias, approximate)
        return ext.bias_gelu(x, bias, None, approximate == "tanh")

    @layer_norm_op.register_kernel("cuda")
    def _(x, weight, bias, eps):
        if x.dtype not in FAST:
            return layer_norm_op._init_fn(x, weight, bias, eps)
        return ext.norm_forward(x, weight, bias, eps)[0]

    @rms_norm_op.register_kernel("cuda")
    def _(x, weight, eps):
        if x.dtype not in FAST:
            return rms_norm_op._init_fn(x, weight, eps)
        return ext.norm_forward(x, weight, None, eps)[0]

    @scale_mask_softmax_op.register_kernel("cuda")
    def _(x, mask, scale, causal):
        if x.dtype not in FAST or (mask is not None and mask.dim() > 2 and mask.shape[:-2].numel() > 1):
            return scale_mask_softmax_op._init_fn(x, mask, scale, causal)  # the kernel repeats one [q, k] mask
        if mask is not None:  # one [queries, keys] mask that the kernel repeats over the leading rows
            trailing = x.shape[-2:] if x.dim() > 1 else x.shape
            if mask.dim() > len(trailing):
                mask = mask.reshape(mask.shape[-len(trailing) :])
            mask = mask.expand(trailing)
        return ext.scale_mask_softmax(x, mask, scale, x.shape[-2] if causal else 0)

    @cross_entropy_op.register_kernel("cuda")
    def _(logits, target, ignore_index, reduction):
        if logits.dtype not in FAST:
            return cross_entropy_op._init_fn(logits, target, ignore_index, reduction)
        m, s, picked = ext.cross_entropy_stats(logits, target, 0)
        lse = m + s.log()
        loss = reduce_loss(lse - picked, target != ignore_index, reduction)
        return loss.to(logits.dtype), lse.to(logits.dtype)

    @cross_entropy_backward_op.register_kernel("cuda")
    def _(grad, logits, target, lse, ignore_index, reduction):
        if logits.dtype not in FAST:
            return cross_entropy_backward_op._init_fn(grad, logits, target, lse, ignore_index, reduction)
        kept = target != ignore_index
        return ext.cross_entropy_backward(
            logits, target, lse, row_weights(grad.float(), kept, reduction, kept.sum()), 0
        )

    @bias_dropout_add_op.register_kernel("cuda")
    def _(x, bias, residual, p, training):
        if x.dtype not in FAST or not draws(p, training):
            return bias_dropout_add_op._init_fn(x, bias, residual, p, training)
        gen = torch.cuda.default_generators[x.device.index or 0]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + ((x.numel() + 3) // 4 + 3) // 4 * 4)  # as sbp_torch._random advances it
        return tuple(ext.bias_dropout_add(x, bias, residual, p, None, 0, seed, offset))


__all__ = ["enable_cuda_kernels", "load_extension"]
