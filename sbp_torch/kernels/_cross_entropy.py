"""``cross_entropy(logits[N, C], target[N])`` without the softmax of the vocabulary in memory.

The forward keeps a running max and sum of exponentials over column chunks, so besides the logits it holds
one chunk and a few numbers per row; it returns the loss and each row's log-sum-exp ``lse``, from which the
backward (its own op) recomputes ``softmax = exp(logits - lse)``. The same pieces make the vocabulary-parallel
kernel (``_rules.py``): per-rank max and sum-exp combined across ranks as a max and a sum.
"""

import torch

from ._library import REDUCTIONS

CHUNK = 8192  # columns per step: bounds the temporary to N x CHUNK


def max_and_sum_exp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the max ``m`` and ``sum(exp(logits - m))``, chunk by chunk (m = -inf, sum 0 for no columns)."""
    rows = logits.shape[0]
    m = logits.new_full((rows,), float("-inf"))
    s = logits.new_zeros(rows)
    for chunk in logits.split(CHUNK, dim=1):
        m_new = torch.maximum(m, chunk.amax(1))
        safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows of -inf: no NaN from -inf - -inf
        s = s * torch.exp(m - safe) + torch.exp(chunk - safe[:, None]).sum(1)
        m = m_new
    return m, s


def picked(logits: torch.Tensor, target: torch.Tensor, first: int = 0) -> torch.Tensor:
    """``logits[i, target[i] - first]`` where that column is held here, else 0."""
    local = target - first
    held = (local >= 0) & (local < logits.shape[1])
    values = (
        logits.gather(1, local.clamp(0, max(logits.shape[1] - 1, 0))[:, None])[:, 0]
        if logits.shape[1]
        else logits.new_zeros(target.shape)
    )
    return torch.where(held, values, 0.0)


def reduce_loss(per_row: torch.Tensor, kept: torch.Tensor, reduction: int, count=None) -> torch.Tensor:
    per_row = torch.where(kept, per_row, 0.0)
    if reduction == REDUCTIONS["none"]:
        return per_row
    total = per_row.sum()
    if reduction == REDUCTIONS["sum"]:
        return total
    return total / (kept.sum() if count is None else count).to(per_row.dtype)


def row_weights(grad, kept, reduction: int, count) -> torch.Tensor:
    """d loss / d (row loss), zero on ignored rows."""
    if reduction == REDUCTIONS["mean"]:
        grad = grad / count.to(grad.dtype)
    return torch.where(kept, grad, 0.0) if grad.dim() else torch.where(kept, grad.expand(kept.shape), 0.0)


def softmax_minus_onehot(logits, target, lse, weights, first: int = 0) -> torch.Tensor:
    grad = torch.exp(logits - lse[:, None])
    local = target - first
    held = (local >= 0) & (local < logits.shape[1])
    if logits.shape[1]:
        grad.scatter_add_(1, local.clamp(0, logits.shape[1] - 1)[:, None], -held.to(grad.dtype)[:, None])
    return grad * weights[:, None]


@torch.library.custom_op("sbp_torch::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int
) -> tuple[torch.Tensor, torch.Tensor]:
    m, s = max_and_sum_exp(logits)
    lse = m + s.log()
    kept = target != ignore_index
    return reduce_loss(lse - picked(logits, target), kept, reduction), lse


@torch.library.custom_op("sbp_torch::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int, reduction: int
) -> torch.Tensor:
    kept = target != ignore_index
    return softmax_minus_onehot(logits, target, lse, row_weights(grad, kept, reduction, kept.sum()))


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, reduction):
    rows = logits.shape[0]
    loss = logits.new_empty((rows,) if reduction == REDUCTIONS["none"] else ())
    return loss, logits.new_empty((rows,))


@cross_entropy_backward_op.register_fake
def _(grad, logits, target, lse, ignore_index, reduction):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, target, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    return cross_entropy_backward_op(grad, logits, target, lse, ctx.ignore_index, ctx.reduction), None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for ``logits[N, C]``,
    ``target[N]`` (int64), never holding an ``N x C`` softmax in the forward."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy: expected logits [N, C] and target [N], got {tuple(logits.shape)}, {tuple(target.shape)}"
        )
    return cross_entropy_op(logits, target, int(ignore_index), REDUCTIONS[reduction])[0]
