"""``bias_dropout_add(x, bias, residual, p)``: ``dropout(x + bias, p) + residual`` as one op.

The op returns ``(out, mask)``; the mask is kept for the backward, ``bias_dropout_add_backward(grad, mask,
scale) -> (grad_x, grad_bias)`` (the residual's gradient is ``grad`` itself). Element ``i`` is kept when the ``i``-th
uniform draw of a fresh random tensor of the logical shape is ``< 1 - p`` (``sbp_torch/_layout/_random.py``,
docs/randomness.md), so the logical result does not depend on how the tensor is split.
"""

import torch

from .._layout import random_region
from ._library import check_last_dim_param, sum_rows


def draw_keep(shape, dtype, device, p: float) -> torch.Tensor:
    """The keep mask (``u < 1 - p``) of a fresh uniform draw of ``shape``."""
    return random_region("uniform", tuple(shape), dtype, (0,) * len(shape), tuple(shape), device) < 1.0 - p


def keep_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def apply_mask(x, bias, residual, keep, p: float) -> torch.Tensor:
    return (x + bias) * keep * keep_scale(p) + residual


def draws(p: float, training: bool) -> bool:
    return training and p > 0.0


@torch.library.custom_op("sbp_torch::bias_dropout_add", mutates_args=())
def bias_dropout_add_op(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float, training: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not draws(p, training):
        return x + bias + residual, torch.ones_like(x, dtype=torch.bool)
    keep = draw_keep(x.shape, x.dtype, x.device, p)
    return apply_mask(x, bias, residual, keep, p), keep


@torch.library.custom_op("sbp_torch::bias_dropout_add_backward", mutates_args=())
def bias_dropout_add_backward_op(
    grad: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = grad * mask * scale
    return grad_x, sum_rows(grad_x)


@bias_dropout_add_op.register_fake
def _(x, bias, residual, p, training):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


@bias_dropout_add_backward_op.register_fake
def _(grad, mask, scale):
    return torch.empty_like(grad), grad.new_empty(grad.shape[-1:])


def _setup(ctx, inputs, output):
    x, _, _, p, training = inputs
    ctx.save_for_backward(output[1])
    ctx.scale = keep_scale(p) if draws(p, training) else 1.0
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _grad_mask):
    (keep,) = ctx.saved_tensors
    grad_x, grad_bias = bias_dropout_add_backward_op(grad, keep, ctx.scale)
    return grad_x, grad_bias, grad, None, None


bias_dropout_add_op.register_autograd(_backward, setup_context=_setup)


def bias_dropout_add(x, bias, residual, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x + bias, p, training) + residual`` with the project's layout-independent mask, for ``x`` and
    ``residual`` of one shape ``[..., H]``, ``bias`` ``[H]`` and ``p`` in ``[0, 1]``. Without ``training`` (or
    with ``p == 0``) no mask is drawn and the generator does not advance."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p must be in [0, 1], got {p}")
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_last_dim_param("bias_dropout_add", x, bias)
    return bias_dropout_add_op(x, bias, residual, float(p), bool(training))[0]
