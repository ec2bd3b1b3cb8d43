"""``bias_gelu(x, bias)``: ``F.gelu(x + bias, approximate=...)`` as one op over the last dim's bias."""

import torch
import torch.nn.functional as F

from ._library import check_last_dim_param, leading_dims


@torch.library.custom_op("sbp_torch::bias_gelu", mutates_args=())
def bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x + bias, approximate=approximate)


@bias_gelu_op.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, grad):
    # Recomputes x + bias rather than saving it: one more add, one activation fewer kept alive.
    x, bias = ctx.saved_tensors
    grad_x = torch.ops.aten.gelu_backward(grad, x + bias, approximate=ctx.approximate)
    return grad_x, grad_x.sum(leading_dims(x)), None


bias_gelu_op.register_autograd(_backward, setup_context=_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` for ``x`` ``[..., H]`` and ``bias`` ``[H]``; ``approximate``
    is ``"tanh"`` or ``"none"`` (erf), as ``F.gelu`` names them."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"bias_gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    check_last_dim_param("bias_gelu", x, bias)
    return bias_gelu_op(x, bias, approximate)
