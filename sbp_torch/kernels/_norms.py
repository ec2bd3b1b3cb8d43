"""``layer_norm`` and ``rms_norm`` over the last dim, with an elementwise weight (and bias).

The ops return the per-row statistics beside ``y`` (``mean`` and ``rstd`` for layer norm, ``rstd`` for rms
norm; float32 for 16-bit inputs, else the input's dtype; shaped like ``x`` without its last dim), which the
backward ops ``layer_norm_backward(grad, x, weight, mean, rstd) -> (grad_x, grad_weight, grad_bias)`` and
``rms_norm_backward(grad, x, weight, rstd) -> (grad_x, grad_weight)`` take instead of recomputing them.
"""

import torch

from ._library import check_last_dim_param, float_work, stats_dtype, sum_rows


def _forward(x, weight, bias, eps):
    work = float_work(x)
    mean = work.mean(-1) if bias is not None else None
    centred = work - mean[..., None] if mean is not None else work
    rstd = torch.rsqrt(centred.pow(2).mean(-1) + eps)
    y = centred * rstd[..., None] * weight
    return (y if bias is None else y + bias).to(x.dtype), mean, rstd


def _backward_reference(grad, x, weight, mean, rstd):
    """dx = rstd * (g*w - x_hat * mean(g*w*x_hat) - mean(g*w)) (the last term with a mean: layer norm)."""
    g, work = float_work(grad), float_work(x)
    x_hat = (work if mean is None else work - mean[..., None]) * rstd[..., None]
    gw = g * weight
    inner = gw - x_hat * (gw * x_hat).mean(-1, keepdim=True)
    if mean is not None:
        inner = inner - gw.mean(-1, keepdim=True)
    grad_x = (rstd[..., None] * inner).to(x.dtype)
    return grad_x, sum_rows(g * x_hat).to(weight.dtype), sum_rows(g).to(weight.dtype)


@torch.library.custom_op("sbp_torch::layer_norm", mutates_args=())
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, weight, bias, eps)


@torch.library.custom_op("sbp_torch::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _forward(x, weight, None, eps)
    return y, rstd


@torch.library.custom_op("sbp_torch::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_reference(grad, x, weight, mean, rstd)


@torch.library.custom_op("sbp_torch::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_reference(grad, x, weight, None, rstd)[:2]


def _stats(x):
    return x.new_empty(x.shape[:-1], dtype=stats_dtype(x.dtype))


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x), _stats(x), _stats(x)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), _stats(x)


@layer_norm_backward_op.register_fake
def _(grad, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


@rms_norm_backward_op.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], *output[1:])  # x, weight, the statistics
    ctx.mark_non_differentiable(*output[1:])


def _layer_norm_backward(ctx, grad, _grad_mean, _grad_rstd):
    grad_x, grad_weight, grad_bias = layer_norm_backward_op(grad, *ctx.saved_tensors)
    return grad_x, grad_weight, grad_bias, None


def _rms_norm_backward(ctx, grad, _grad_rstd):
    grad_x, grad_weight = rms_norm_backward_op(grad, *ctx.saved_tensors)
    return grad_x, grad_weight, None


layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_setup)
rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_setup)


def layer_norm(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (H,), weight, bias, eps)`` over the last dim ``H``; ``weight``, ``bias``: ``[H]``."""
    check_last_dim_param("layer_norm", x, weight)
    check_last_dim_param("layer_norm", x, bias)
    return layer_norm_op(x, weight, bias, float(eps))[0]


def rms_norm(x, weight, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim ``H``; ``weight``: ``[H]``."""
    check_last_dim_param("rms_norm", x, weight)
    return rms_norm_op(x, weight, float(eps))[0]
