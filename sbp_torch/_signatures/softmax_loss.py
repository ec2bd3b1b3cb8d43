"""Softmax, log-softmax and ``_safe_softmax``, the negative log-likelihood loss (cross entropy = log-softmax + nll)
and mse_loss.

``_softmax`` / ``_log_softmax`` over ``dim`` and their ``_backward_data`` ops:

    S(d), d != dim  → S(d)      rows are independent
    S(dim)          → S(dim)    local function "softmax": the row max (P(max)) and the sum of exponentials (P(sum)),
                                and in the backward the row sum of the gradient terms, are all-reduced over
                                the axes that split ``dim``; nothing of the size of the logits moves
    B               → B
    backward: P(sum) gradient with a broadcast output → P(sum) (linear in the gradient)

``nll_loss_forward`` / ``nll_loss2d_forward`` (input [N, C, ...] or [C], target [N, ...] or []) → (loss,
total_weight), and their backward (→ gradient of the input):

    sample split: input S(d), target S(d') → loss S(d') (reduction none) or P(sum) (sum; mean through local
        function "nll", which divides the local sum by the total weight all-reduced over the sample-splitting axes);
        total weight P(sum) (sum) or B (mean);
    class split: input S(1), target B, class weights B → loss P(sum), total weight B; local function "nll": a rank
        keeps the targets in its class range (shifted to local classes; the others become ignored) and its
        slice of the class weights, so each sample's term comes from exactly one rank; the total weight is
        computed from the full target. This is vocabulary-parallel cross entropy: logits split over the
        vocabulary are never gathered, forward or backward.

``mse_loss`` (equal shapes) and its backward: S(d) everywhere → S(d) (none), P(sum) (sum), or P(sum) for mean
through local function "mse_mean", which divides the local sum by the logical element count.
"""

import math

import torch

from .core import B, GlobalMeta, LocalContext, OpCall, P, S, Signature, Split, register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2  # torch's reduction enum
SOFTMAX, NLL, MSE_MEAN = "softmax", "nll", "mse_mean"
LOG_SOFTMAX_OPS = {aten._log_softmax.default, aten._log_softmax_backward_data.default}


# softmax and log-softmax


def _softmax(func, ctx: LocalContext) -> torch.Tensor:
    """(Log-)softmax over a dim split across ``ctx.axes``: global row max and sum of exponentials."""
    a = ctx.arguments
    x, dim = a["self"], a["dim"]
    x = x.float() if a["half_to_float"] else x
    dim %= x.dim()
    if x.shape[dim]:
        row_max = x.amax(dim, keepdim=True)
    else:  # this rank holds no column of the row: -inf is the identity of max
        row_max = x.new_full(x.shape[:dim] + (1,) + x.shape[dim + 1 :], -math.inf)
    shifted = x - ctx.all_reduce(row_max, "max")
    sum_exp = ctx.all_reduce(shifted.exp().sum(dim, keepdim=True))
    if func is aten._log_softmax.default:
        return shifted - sum_exp.log()
    return shifted.exp() / sum_exp


def _softmax_backward(func, ctx: LocalContext) -> torch.Tensor:
    """Gradient of (log-)softmax over a split dim: the row sums it needs are all-reduced."""
    a = ctx.arguments
    grad, out, dim, input_dtype = a["grad_output"], a["output"], a["dim"], a["input_dtype"]
    if func is aten._log_softmax_backward_data.default:
        row_sum = ctx.all_reduce(grad.sum(dim, keepdim=True))
        return (grad - out.exp() * row_sum).to(input_dtype)
    row_sum = ctx.all_reduce((grad * out).sum(dim, keepdim=True))
    return (out * (grad - row_sum)).to(input_dtype)


@register(aten._softmax, aten._log_softmax, local_fns={SOFTMAX: _softmax})
def softmax(call: OpCall) -> list[Signature]:
    ndim = call.inputs[0].ndim
    dim = call.bound["dim"] % max(ndim, 1)
    signatures = [Signature((S(d),), (S(d),), local_fn=SOFTMAX if d == dim else None) for d in range(ndim)]
    return signatures + [Signature((B,), (B,))]


@register(aten._safe_softmax)
def safe_softmax(call: OpCall) -> list[Signature]:
    """Softmax that gives zeros for rows of -inf (attention masks): rows are independent; the softmax dim stays
    whole."""
    ndim = call.inputs[0].ndim
    dim = call.bound["dim"] % max(ndim, 1)
    return [Signature((S(d),), (S(d),)) for d in range(ndim) if d != dim] + [Signature((B,), (B,))]


@register(aten._softmax_backward_data, aten._log_softmax_backward_data, local_fns={SOFTMAX: _softmax_backward})
def softmax_backward(call: OpCall) -> list[Signature]:
    ndim = call.inputs[0].ndim
    dim = call.bound["dim"] % max(ndim, 1)
    signatures = [Signature((S(d), S(d)), (S(d),), local_fn=SOFTMAX if d == dim else None) for d in range(ndim)]
    return signatures + [Signature((B, B), (B,)), Signature((P, B), (P,))]


# negative log-likelihood


def _class_dim(ndim: int) -> int:
    """Where the classes are: [C] or [N, C, ...]."""
    return 0 if ndim == 1 else 1


def _local_targets(ctx, layout: GlobalMeta, a: dict) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(target, class weights, ignore index) for this rank's slice of the classes of the input (laid out as
    ``layout``): targets outside the slice (and ignored ones) become -1, which the local call ignores."""
    class_dim = _class_dim(len(layout.shape))
    target, weight, ignore = a["target"], a["weight"], a["ignore_index"]
    if not any(isinstance(s, Split) and s.dim == class_dim for s in layout.sbp):
        return target, weight, ignore
    starts, lengths = ctx.region(layout)
    first, count = starts[class_dim], lengths[class_dim]
    mine = (target >= first) & (target < first + count) & (target != ignore)
    local_weight = None if weight is None else weight[first : first + count]
    return torch.where(mine, target - first, -1), local_weight, -1


def _sample_axes(ctx) -> list[int]:
    """The local function's axes that split a sample dim (not the class dim): their ranks hold different samples."""
    class_dim = _class_dim(len(ctx.inputs[0].shape))
    return [a for a in ctx.axes if isinstance(s := ctx.inputs[0].sbp[a], Split) and s.dim != class_dim]


def _nll_forward(func, ctx: LocalContext):
    """The local picks (of this rank's classes and samples); for mean, divided by the total weight of the
    samples over the sample-splitting axes (computed from the targets, which hold every class)."""
    a = ctx.arguments
    x, reduction = a["self"], a["reduction"]
    target, weight, ignore = _local_targets(ctx, ctx.inputs[0], a)
    if reduction == NONE:
        return func(x, target, weight, NONE, ignore)
    loss, _ = func(x, target, weight, SUM, ignore)
    kept = a["target"] != a["ignore_index"]
    if a["weight"] is None:
        total = kept.sum().to(x.dtype)
    else:
        total = (a["weight"][a["target"].clamp(0, a["weight"].numel() - 1)] * kept).sum().to(x.dtype)
    total = ctx.all_reduce(total, "sum", _sample_axes(ctx))
    return (loss / total if reduction == MEAN else loss), total


def _nll_backward(func, ctx: LocalContext):
    target, weight, ignore = _local_targets(ctx, ctx.inputs[1], ctx.arguments)
    return ctx.call(func, target=target, weight=weight, ignore_index=ignore)


@register(aten.nll_loss_forward, aten.nll_loss2d_forward, local_fns={NLL: _nll_forward})
def nll_loss(call: OpCall) -> list[Signature]:
    ndim, reduction = call.inputs[0].ndim, call.bound["reduction"]
    class_dim = _class_dim(ndim)
    weight = (B,) * (len(call.inputs) - 2)
    signatures = []
    for d in range(ndim):
        if d == class_dim:
            continue
        target_sbp = S(d - (d > class_dim))
        inputs = (S(d), target_sbp) + weight
        if reduction == NONE:
            signatures.append(Signature(inputs, (target_sbp, B)))
        elif reduction == SUM:
            signatures.append(Signature(inputs, (P, P)))
        else:
            signatures.append(Signature(inputs, (P, B), local_fn=NLL))
    signatures.append(Signature((S(class_dim), B) + weight, (P, B), local_fn=NLL))
    return signatures + [Signature((B, B) + weight, (B, B))]


@register(aten.nll_loss_backward, aten.nll_loss2d_backward, local_fns={NLL: _nll_backward})
def nll_loss_backward(call: OpCall) -> list[Signature]:
    ndim, reduction = call.inputs[1].ndim, call.bound["reduction"]
    class_dim = _class_dim(ndim)
    weight = (B,) * (len(call.inputs) - 4)
    signatures = []
    for d in range(ndim):
        if d == class_dim:
            continue
        target_sbp = S(d - (d > class_dim))
        grad_sbp = target_sbp if reduction == NONE else B
        signatures.append(Signature((grad_sbp, S(d), target_sbp) + weight + (B,), (S(d),)))
        if reduction == SUM:  # the total weight is not used: leave it partial
            signatures.append(Signature((grad_sbp, S(d), target_sbp) + weight + (P,), (S(d),)))
    signatures.append(Signature((B, S(class_dim), B) + weight + (B,), (S(class_dim),), local_fn=NLL))
    return signatures + [Signature((B, B, B) + weight + (B,), (B,))]


# mean squared error


def _mse_mean(func, ctx: LocalContext):
    """Sum-reduced local loss (or its gradient) divided by the logical element count."""
    return ctx.call(func, reduction=SUM) / math.prod(ctx.inputs[-1].shape)


@register(aten.mse_loss, local_fns={MSE_MEAN: _mse_mean})
def mse_loss(call: OpCall) -> list[Signature]:
    x, target = call.inputs
    signatures = [Signature((B, B), (B,))]
    if x.shape != target.shape:
        return signatures
    reduction = call.arg("reduction", MEAN)
    for d in range(x.ndim):
        if reduction == NONE:
            signatures.append(Signature((S(d), S(d)), (S(d),)))
        else:
            signatures.append(Signature((S(d), S(d)), (P,), local_fn=MSE_MEAN if reduction == MEAN else None))
    return signatures


@register(aten.mse_loss_backward, local_fns={MSE_MEAN: _mse_mean})
def mse_loss_backward(call: OpCall) -> list[Signature]:
    grad, x, target = call.inputs
    signatures = [Signature((B, B, B), (B,))]
    if x.shape != target.shape:
        return signatures
    reduction = call.bound["reduction"]
    for d in range(x.ndim):
        if reduction == NONE:
            signatures.append(Signature((S(d), S(d), S(d)), (S(d),)))
        else:
            signatures.append(Signature((B, S(d), S(d)), (S(d),), local_fn=MSE_MEAN if reduction == MEAN else None))
    return signatures
