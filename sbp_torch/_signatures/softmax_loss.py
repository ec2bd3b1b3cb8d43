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

from .core import B, GlobalMeta, LocalContext, OpCall, P, S, Signature, Split, TensorInfo, floats_only, register, sig

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


def _softmax_outputs(call: OpCall) -> list[TensorInfo] | None:
    x = call["self"]
    if call["half_to_float"] or not -max(x.ndim, 1) <= call["dim"] < max(x.ndim, 1):
        return None
    return [TensorInfo(x.shape, x.dtype)]


SOFTMAX_ARGUMENTS = ("dim", "half_to_float")


@register(
    aten._softmax,
    aten._log_softmax,
    reads=SOFTMAX_ARGUMENTS,
    local_fns={SOFTMAX: _softmax},
    outputs=floats_only(_softmax_outputs),
)
def softmax(call: OpCall) -> list[Signature]:
    dim = call.dim()
    return [sig(S(d), SOFTMAX if d == dim else None, self=S(d)) for d in range(call["self"].ndim)]


@register(aten._safe_softmax, reads=("dim",))
def safe_softmax(call: OpCall) -> list[Signature]:
    """Softmax that gives zeros for rows of -inf (attention masks): rows are independent; the softmax dim stays
    whole."""
    dim = call.dim()
    return [sig(S(d), self=S(d)) for d in range(call["self"].ndim) if d != dim]


@register(
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    reads=("dim",),
    local_fns={SOFTMAX: _softmax_backward},
)
def softmax_backward(call: OpCall) -> list[Signature]:
    dim = call.dim(of="grad_output")
    signatures = [
        sig(S(d), SOFTMAX if d == dim else None, grad_output=S(d), output=S(d)) for d in range(call["grad_output"].ndim)
    ]
    return signatures + [sig(B, grad_output=B, output=B), sig(P, grad_output=P, output=B)]


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


@register(aten.nll_loss_forward, aten.nll_loss2d_forward, reads=("reduction",), local_fns={NLL: _nll_forward})
def nll_loss(call: OpCall) -> list[Signature]:
    ndim, reduction = call["self"].ndim, call["reduction"]
    class_dim = _class_dim(ndim)
    signatures = []
    for d in range(ndim):
        if d == class_dim:
            continue
        target = S(d - (d > class_dim))
        if reduction == NONE:
            signatures.append(sig((target, B), self=S(d), target=target, weight=B))
        elif reduction == SUM:
            signatures.append(sig(P, self=S(d), target=target, weight=B))
        else:
            signatures.append(sig((P, B), NLL, self=S(d), target=target, weight=B))
    return signatures + [sig((P, B), NLL, self=S(class_dim), target=B, weight=B)]


@register(aten.nll_loss_backward, aten.nll_loss2d_backward, reads=("reduction",), local_fns={NLL: _nll_backward})
def nll_loss_backward(call: OpCall) -> list[Signature]:
    ndim, reduction = call["self"].ndim, call["reduction"]
    class_dim = _class_dim(ndim)
    signatures = []
    for d in range(ndim):
        if d == class_dim:
            continue
        target = S(d - (d > class_dim))
        grad = target if reduction == NONE else B
        signatures.append(sig(S(d), grad_output=grad, self=S(d), target=target, weight=B, total_weight=B))
        if reduction == SUM:  # the total weight is not used: leave it partial
            signatures.append(sig(S(d), grad_output=grad, self=S(d), target=target, weight=B, total_weight=P))
    both = sig(S(class_dim), NLL, grad_output=B, self=S(class_dim), target=B, weight=B, total_weight=B)
    return signatures + [both]


# mean squared error


def _mse_mean(func, ctx: LocalContext):
    """Sum-reduced local loss (or its gradient) divided by the logical element count."""
    return ctx.call(func, reduction=SUM) / math.prod(ctx.inputs[-1].shape)


@register(aten.mse_loss, reads=("reduction",), local_fns={MSE_MEAN: _mse_mean})
def mse_loss(call: OpCall) -> list[Signature]:
    x, target = call["self"], call["target"]
    if x.shape != target.shape:
        return []
    reduction = call.get("reduction", MEAN)
    if reduction == NONE:
        return [sig(S(d), self=S(d), target=S(d)) for d in range(x.ndim)]
    local_fn = MSE_MEAN if reduction == MEAN else None
    return [sig(P, local_fn, self=S(d), target=S(d)) for d in range(x.ndim)]


@register(aten.mse_loss_backward, reads=("reduction",), local_fns={MSE_MEAN: _mse_mean})
def mse_loss_backward(call: OpCall) -> list[Signature]:
    x, target = call["self"], call["target"]
    if x.shape != target.shape:
        return []
    reduction = call["reduction"]
    if reduction == NONE:
        return [sig(S(d), grad_output=S(d), self=S(d), target=S(d)) for d in range(x.ndim)]
    local_fn = MSE_MEAN if reduction == MEAN else None
    return [sig(S(d), local_fn, grad_output=B, self=S(d), target=S(d)) for d in range(x.ndim)]
