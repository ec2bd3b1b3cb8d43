"""``bias_gelu(x, bias)``: ``F.gelu(x + bias, approximate=...)`` as one op over the last dim's bias, and its
backward ``bias_gelu_backward(grad, x, bias) -> (grad_x, grad_bias)`` as another."""

import torch
import torch.nn.functional as F

from ._library import check_last_dim_param, sum_rows


@torch.library.custom_op("sbp_torch::bias_gelu", mutates_args=())
def bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x + bias, approximate=approximate)


@torch.library.custom_op("sbp_torch::bias_gelu_backward", mutates_args=())
def bias_gelu_backward_op(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch.ops.aten.gelu_backward(grad, x + bias, approximate=approximate)
    return grad_x, sum_rows(grad_x)


@bias_gelu_op.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x)


@bias_gelu_backward_op.register_fake
def _(grad, x, bias, approximate):
    return torch.empty_like(x), torch.empty_like(bias)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)  # x + bias is recomputed: one activation fewer kept alive
    ctx.approximate = approximate


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x, grad_bias = bias_gelu_backward_op(grad, x, bias, ctx.approximate)
    return grad_x, grad_bias, None


bias_gelu_op.register_autograd(_backward, setup_context=_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` for ``x`` ``[..., H]`` and ``bias`` ``[H]``; ``approximate``
    is ``"tanh"`` or ``"none"`` (erf), as ``F.gelu`` names them."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"bias_gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    check_last_dim_param("bias_gelu", x, bias)
    return bias_gelu_op(x, bias, approximate)
