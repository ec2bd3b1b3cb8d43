"""CUDA implementations of the ``sbp_torch::*`` ops, from the extension built out of ``csrc/`` + ``cuda/``.

``enable_cuda_kernels()`` loads the prebuilt ``sbp_torch._kernels_cuda`` (``setup.py`` builds it where a CUDA
torch and nvcc exist) or compiles it just in time with ``torch.utils.cpp_extension.load`` (ninja), then
registers the forward kernels for the ``cuda`` device. Without it, CUDA tensors run the pure-PyTorch
reference. Float64 stays on the reference (the kernels take fp32/fp16/bf16).

Status: compiled with nvcc in CI (tests/test_cuda_build.py); checked against float64 on an H100
(tests/test_kernels_gpu.py, run by benchmarks/kernels/run_gpu.sh).
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

    # the pure-PyTorch implementation each op was defined with: float64 and unsupported cases stay on it
    ref = {
        op: op._init_fn
        for op in (
            bias_gelu_op,
            bias_dropout_add_op,
            scale_mask_softmax_op,
            layer_norm_op,
            rms_norm_op,
            cross_entropy_op,
            cross_entropy_backward_op,
        )
    }

    @bias_gelu_op.register_kernel("cuda")
    def _(x, bias, approximate):
        if x.dtype not in FAST:
            return ref[bias_gelu_op](x, bias, approximate)
        return ext.bias_gelu(x, bias, None, approximate == "tanh")

    @layer_norm_op.register_kernel("cuda")
    def _(x, weight, bias, eps):
        if x.dtype not in FAST:
            return ref[layer_norm_op](x, weight, bias, eps)
        return ext.norm_forward(x, weight, bias, eps)[0]

    @rms_norm_op.register_kernel("cuda")
    def _(x, weight, eps):
        if x.dtype not in FAST:
            return ref[rms_norm_op](x, weight, eps)
        return ext.norm_forward(x, weight, None, eps)[0]

    @scale_mask_softmax_op.register_kernel("cuda")
    def _(x, mask, scale, causal):
        if x.dtype not in FAST or (mask is not None and mask.dim() > 2 and mask.shape[:-2].numel() > 1):
            return ref[scale_mask_softmax_op](x, mask, scale, causal)  # the kernel repeats one [q, k] mask
        if mask is not None:  # one [queries, keys] mask that the kernel repeats over the leading rows
            trailing = x.shape[-2:] if x.dim() > 1 else x.shape
            mask = mask.reshape(mask.shape[-len(trailing) :] if mask.dim() > len(trailing) else mask.shape).expand(
                trailing
            )
        return ext.scale_mask_softmax(x, mask, scale, x.shape[-2] if causal else 0)

    @cross_entropy_op.register_kernel("cuda")
    def _(logits, target, ignore_index, reduction):
        if logits.dtype not in FAST:
            return ref[cross_entropy_op](logits, target, ignore_index, reduction)
        m, s, picked = ext.cross_entropy_stats(logits, target, 0)
        lse = m + s.log()
        loss = reduce_loss(lse - picked, target != ignore_index, reduction)
        return loss.to(logits.dtype), lse.to(logits.dtype)

    @cross_entropy_backward_op.register_kernel("cuda")
    def _(grad, logits, target, lse, ignore_index, reduction):
        if logits.dtype not in FAST:
            return ref[cross_entropy_backward_op](grad, logits, target, lse, ignore_index, reduction)
        kept = target != ignore_index
        return ext.cross_entropy_backward(
            logits, target, lse, row_weights(grad.float(), kept, reduction, kept.sum()), 0
        )

    @bias_dropout_add_op.register_kernel("cuda")
    def _(x, bias, residual, p, training):
        if x.dtype not in FAST or not draws(p, training):
            return ref[bias_dropout_add_op](x, bias, residual, p, training)
        gen = torch.cuda.default_generators[x.device.index or 0]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + ((x.numel() + 3) // 4 + 3) // 4 * 4)  # as sbp_torch._random advances it
        return tuple(ext.bias_dropout_add(x, bias, residual, p, None, 0, seed, offset))


__all__ = ["enable_cuda_kernels", "load_extension"]
