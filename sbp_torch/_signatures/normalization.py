"""Layer, group and batch normalization, forward and backward.

Statistics are computed over some dims; a split on a dim that the statistics do not cover keeps every
statistic local, a split on a covered dim needs the statistics all-reduced.

``native_layer_norm(input, normalized_shape, weight, bias)`` → (out, mean, rstd), statistics over the last
``len(normalized_shape)`` dims:

    input S(d), d a leading dim, weight/bias B → out, mean, rstd S(d)
    backward: grad, input, mean, rstd S(d), weight/bias B → grad_input S(d), grad_weight/grad_bias P(sum)

``native_group_norm(input [N, C, ...], ..., N, C, HxW, group)``, statistics per sample and group:

    input S(0), weight/bias B → out, mean, rstd S(0)        local function "local_batch": N is this rank's rows
    backward: grad, input, mean, rstd S(0) → grad_input S(0), grad_weight/grad_bias P(sum)  (same local function)

``native_batch_norm(input [N, C, ...], weight, bias, running_mean, running_var, training)``, statistics per
channel over every other dim:

    channel split: input S(1), per-channel tensors S(0) → out S(1), save_mean/save_invstd S(0). In training
        only without running statistics: the op updates them in place, and a rank may only write the layout
        it was given (a boxed copy would lose the update).
    other splits:  input S(d), per-channel tensors B → out S(d); in evaluation the running statistics make it
        local; in training local function "sync_stats" all-reduces the per-channel sums (synchronized batch norm,
        save_mean/save_invstd B) and updates the broadcast running statistics alike on every rank.
    backward: the same layouts; in training a split of a covered dim all-reduces the two per-channel sums the
        input gradient needs (local function "sync_stats"), which makes grad_weight/grad_bias B; otherwise P(sum).

All: B → B. ``rms_norm`` decomposes into element-wise ops and ``mean.dim`` before it reaches dispatch.
"""

import math

import torch

from .core import (
    B,
    LocalContext,
    OpCall,
    P,
    S,
    Signature,
    TensorInfo,
    every_split_part_nonempty,
    floats_only,
    register,
    sig,
)

aten = torch.ops.aten

LOCAL_BATCH, SYNC_STATS, EVALUATION = "local_batch", "sync_stats", "evaluation"
EVERY_GRADIENT = "every_gradient"


def _masked(call: OpCall, grads: tuple) -> tuple:
    return tuple(g for g, wanted in zip(grads, call["output_mask"]) if wanted)


# layer norm


def _layer_norm_outputs(call: OpCall) -> list[TensorInfo] | None:
    x, normalized = call["input"], tuple(call["normalized_shape"])
    axis = x.ndim - len(normalized)
    if axis < 0 or x.shape[axis:] != normalized:
        return None
    stats = x.shape[:axis] + (1,) * len(normalized)
    return [TensorInfo(x.shape, x.dtype), TensorInfo(stats, x.dtype), TensorInfo(stats, x.dtype)]


@register(aten.native_layer_norm, reads=("normalized_shape",), outputs=floats_only(_layer_norm_outputs))
def layer_norm(call: OpCall) -> list[Signature]:
    leading = call["input"].ndim - len(call["normalized_shape"])
    return [sig(S(d), input=S(d), weight=B, bias=B) for d in range(leading)]


@register(aten.native_layer_norm_backward, reads=("normalized_shape", "output_mask"))
def layer_norm_backward(call: OpCall) -> list[Signature]:
    leading = call["input"].ndim - len(call["normalized_shape"])
    return [
        sig(_masked(call, (S(d), P, P)), grad_out=S(d), input=S(d), mean=S(d), rstd=S(d), weight=B, bias=B)
        for d in range(leading)
    ]


# group norm


def _with_local_batch(func, ctx: LocalContext):
    """The op with its batch-size argument ``N`` set to this rank's number of samples."""
    return ctx.call(func, N=ctx.arguments["input"].shape[0])


@register(aten.native_group_norm, local_fns={LOCAL_BATCH: _with_local_batch})
def group_norm(call: OpCall) -> list[Signature]:
    return [sig(S(0), LOCAL_BATCH, input=S(0), weight=B, bias=B)]


@register(aten.native_group_norm_backward, reads=("output_mask",), local_fns={LOCAL_BATCH: _with_local_batch})
def group_norm_backward(call: OpCall) -> list[Signature]:
    grads = _masked(call, (S(0), P, P))
    return [sig(grads, LOCAL_BATCH, grad_out=S(0), input=S(0), mean=S(0), rstd=S(0), weight=B)]


# batch norm

PER_CHANNEL = ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd")


def _channel_split(info: TensorInfo):
    """A per-channel tensor's SBP when the channels are split: S(0), or B for the empty statistics that torch's
    CPU kernel returns in evaluation."""
    return B if info.shape == (0,) else S(0)


def _covered_dims(ndim: int) -> list[int]:
    """The dims batch-norm statistics are taken over: all but the channels."""
    return [d for d in range(ndim) if d != 1]


def _channel_view(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view(1, -1, *[1] * (ndim - 2))


def _sync_batch_norm(func, ctx: LocalContext):
    """Batch norm in training with the covered dims split across ``ctx.axes``: per-channel sums
    all-reduced, running statistics (broadcast) updated alike on every rank."""
    a = ctx.arguments
    x, weight, bias, momentum, eps = a["input"], a["weight"], a["bias"], a["momentum"], a["eps"]
    running_mean, running_var = a["running_mean"], a["running_var"]
    dims = _covered_dims(x.dim())
    count = math.prod(ctx.inputs[0].shape) // ctx.inputs[0].shape[1]
    mean = ctx.all_reduce(x.sum(dims)) / count
    centered = x - _channel_view(mean, x.dim())
    var = ctx.all_reduce(centered.square().sum(dims)) / count
    invstd = (var + eps).rsqrt()
    out = centered * _channel_view(invstd, x.dim())
    if weight is not None:
        out = out * _channel_view(weight, x.dim())
    if bias is not None:
        out = out + _channel_view(bias, x.dim())
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(var * (count / max(count - 1, 1)), alpha=momentum)
    return out, mean, invstd


def _evaluation_batch_norm(func, ctx: LocalContext):
    """Batch norm in evaluation. On CPU the outputs are declared as torch's CPU kernel gives them (empty
    save_mean/save_invstd); elsewhere as the meta kernel says, [C]: then return the statistics used, the
    running mean and 1/sqrt(var + eps)."""
    a = ctx.arguments
    out, save_mean, save_invstd = ctx.call(func)
    if ctx.outputs[1].shape == (0,):
        return out, save_mean.new_empty(0), save_invstd.new_empty(0)
    return out, a["running_mean"].clone(), (a["running_var"] + a["eps"]).rsqrt()


def _sync_batch_norm_backward(func, ctx: LocalContext):
    """Training-mode gradient with the covered dims split: the per-channel sums of the gradient and of the
    gradient times the normalized input are all-reduced; grad_weight/grad_bias are those sums."""
    a = ctx.arguments
    grad, x, weight = a["grad_out"], a["input"], a["weight"]
    save_mean, save_invstd = a["save_mean"], a["save_invstd"]
    dims = _covered_dims(x.dim())
    count = math.prod(ctx.inputs[1].shape) // ctx.inputs[1].shape[1]
    normalized = (x - _channel_view(save_mean, x.dim())) * _channel_view(save_invstd, x.dim())
    grad_bias = ctx.all_reduce(grad.sum(dims))
    grad_weight = ctx.all_reduce((grad * normalized).sum(dims))
    scale = save_invstd if weight is None else save_invstd * weight
    grad_input = (
        grad - _channel_view(grad_bias / count, x.dim()) - normalized * _channel_view(grad_weight / count, x.dim())
    ) * _channel_view(scale, x.dim())
    return grad_input, grad_weight, grad_bias  # (all three: see _every_gradient)


def _every_gradient(func, ctx: LocalContext):
    """The backward with every gradient computed, whatever ``output_mask`` asks. torch's kernel leaves the ones
    the mask leaves out undefined, which a ``__torch_dispatch__`` cannot return for a ``Tensor`` output (it would
    be None), and autograd drops those it did not ask for."""
    return ctx.call(func, output_mask=[True, True, True])


def _present(call: OpCall, names: tuple[str, ...]) -> list[str]:
    """Which of the arguments ``names`` hold tensors in this call, in order."""
    return [n for n in names if isinstance(call.get(n), TensorInfo)]


@register(
    aten.native_batch_norm,
    reads=("training",),
    check_nd=every_split_part_nonempty,
    local_fns={SYNC_STATS: _sync_batch_norm, EVALUATION: _evaluation_batch_norm},
)
def batch_norm(call: OpCall) -> list[Signature]:
    x = call["input"]
    per_channel = _present(call, PER_CHANNEL)
    training = call["training"]
    stats_written = training and ("running_mean" in per_channel or "running_var" in per_channel)
    kernel = SYNC_STATS if training else EVALUATION
    signatures = []
    if not stats_written:
        statistics = tuple(_channel_split(o) for o in call.outputs[1:])
        channels = {n: S(0) for n in per_channel}
        signatures.append(sig((S(1),) + statistics, None if training else EVALUATION, input=S(1), **channels))
    for d in _covered_dims(x.ndim):
        signatures.append(sig((S(d), B, B), kernel, input=S(d), **{n: B for n in per_channel}))
    evaluation = None if training else EVALUATION
    return signatures + [sig(B, evaluation, input=B, **{n: B for n in per_channel})]


@register(
    aten.native_batch_norm_backward,
    reads=("train", "output_mask"),
    check_nd=every_split_part_nonempty,
    local_fns={SYNC_STATS: _sync_batch_norm_backward, EVERY_GRADIENT: _every_gradient},
)
def batch_norm_backward(call: OpCall) -> list[Signature]:
    """Every gradient is declared (the meta kernel gives all three) and computed: where the mask leaves one out,
    by ``_every_gradient`` (which then combines with no other local function across placement axes)."""
    x = call["input"]
    per_channel = _present(call, PER_CHANNEL)
    training = call["train"]
    plain = None if all(call["output_mask"]) else EVERY_GRADIENT
    channels = {n: _channel_split(call[n]) for n in per_channel}
    signatures = [sig((S(1), S(0), S(0)), plain, grad_out=S(1), input=S(1), **channels)]
    for d in _covered_dims(x.ndim):
        grads = (S(d), B, B) if training else (S(d), P, P)
        kernel = SYNC_STATS if training else plain
        signatures.append(sig(grads, kernel, grad_out=S(d), input=S(d), **{n: B for n in per_channel}))
    return signatures + [sig((B, B, B), plain, grad_out=B, input=B, **{n: B for n in per_channel})]
