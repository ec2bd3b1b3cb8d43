"""``layer_norm`` and ``rms_norm`` over the last dim, with an elementwise weight (and bias)."""

import torch
import torch.nn.functional as F

from ._library import check_last_dim_param, leading_dims


def _normalized(x, eps, centred: bool):
    """(x_hat, rstd): the statistics are recomputed in the backward instead of saved (one read of x)."""
    if centred:
        x = x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd, rstd


def _grad_input(grad_x_hat, x_hat, rstd, centred: bool):
    inner = grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True)
    if centred:
        inner = inner - grad_x_hat.mean(-1, keepdim=True)
    return rstd * inner


@torch.library.custom_op("sbp_torch::layer_norm", mutates_args=())
def layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@torch.library.custom_op("sbp_torch::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps = inputs[-1]


def _layer_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    x_hat, rstd = _normalized(x, ctx.eps, centred=True)
    dims = leading_dims(x)
    return _grad_input(grad * weight, x_hat, rstd, True), (grad * x_hat).sum(dims), grad.sum(dims), None


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    x_hat, rstd = _normalized(x, ctx.eps, centred=False)
    return _grad_input(grad * weight, x_hat, rstd, False), (grad * x_hat).sum(leading_dims(x)), None


layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_setup)
rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_setup)


def layer_norm(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (H,), weight, bias, eps)`` over the last dim ``H``; ``weight``, ``bias``: ``[H]``."""
    check_last_dim_param("layer_norm", x, weight)
    check_last_dim_param("layer_norm", x, bias)
    return layer_norm_op(x, weight, bias, float(eps))


def rms_norm(x, weight, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim ``H``; ``weight``: ``[H]``."""
    check_last_dim_param("rms_norm", x, weight)
    return rms_norm_op(x, weight, float(eps))
