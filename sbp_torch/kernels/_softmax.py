"""``scale_mask_softmax(x, mask, scale, causal)``: a masked, optionally causal softmax of ``x * scale`` as one op;
its backward ``scale_mask_softmax_backward(grad, y, scale)`` needs only the output ``y``."""

import torch


def causal_mask(x: torch.Tensor) -> torch.Tensor:
    """True above the diagonal of the last two dims (key ``j`` after query ``i``)."""
    rows, cols = x.shape[-2], x.shape[-1]
    return torch.ones(rows, cols, dtype=torch.bool, device=x.device).triu(1)


@torch.library.custom_op("sbp_torch::scale_mask_softmax", mutates_args=())
def scale_mask_softmax_op(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    scores = x * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    if causal:
        scores = scores.masked_fill(causal_mask(x), float("-inf"))
    return torch.softmax(scores, -1)


@torch.library.custom_op("sbp_torch::scale_mask_softmax_backward", mutates_args=())
def scale_mask_softmax_backward_op(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * y * (grad - (grad * y).sum(-1, keepdim=True))


@scale_mask_softmax_op.register_fake
def _(x, mask, scale, causal):
    return torch.empty_like(x)


@scale_mask_softmax_backward_op.register_fake
def _(grad, y, scale):
    return torch.empty_like(y)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return scale_mask_softmax_backward_op(grad, y, ctx.scale), None, None, None


scale_mask_softmax_op.register_autograd(_backward, setup_context=_setup)


def scale_mask_softmax(x, mask=None, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """``softmax(x * scale)`` over the last dim, excluding positions where ``mask`` is True (a bool tensor
    broadcastable to ``x``) and, with ``causal``, those above the diagonal of the last two dims. A row with every
    position excluded gives NaN, as the unfused ``masked_fill(-inf)`` + softmax does."""
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"scale_mask_softmax: mask must be bool (True = excluded), got {mask.dtype}")
    if causal and x.dim() < 2:
        raise ValueError("scale_mask_softmax: causal needs at least 2 dims (queries, keys)")
    return scale_mask_softmax_op(x, mask, float(scale), bool(causal))
