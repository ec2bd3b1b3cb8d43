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

from .core import B, LocalContext, OpCall, P, S, Signature, TensorInfo, every_split_part_nonempty, register

aten = torch.ops.aten

LOCAL_BATCH, SYNC_STATS, EVALUATION = "local_batch", "sync_stats", "evaluation"


def _present(call: OpCall, names: tuple[str, ...]) -> list[str]:
    """Which of the schema arguments ``names`` are global tensors in this call, in order."""
    return [n for n in names if isinstance(call.bound.get(n), TensorInfo)]


def _masked(call: OpCall, grads: tuple) -> tuple:
    return tuple(g for g, wanted in zip(grads, call.bound["output_mask"]) if wanted)


# layer norm


@register(aten.native_layer_norm)
def layer_norm(call: OpCall) -> list[Signature]:
    x = call.inputs[0]
    affine = (B,) * (len(call.inputs) - 1)
    leading = x.ndim - len(call.bound["normalized_shape"])
    signatures = [Signature((S(d),) + affine, (S(d),) * 3) for d in range(leading)]
    return signatures + [Signature((B,) + affine, (B,) * 3)]


@register(aten.native_layer_norm_backward)
def layer_norm_backward(call: OpCall) -> list[Signature]:
    x = call.inputs[1]
    affine = (B,) * (len(call.inputs) - 4)
    leading = x.ndim - len(call.bound["normalized_shape"])
    signatures = [Signature((S(d),) * 4 + affine, _masked(call, (S(d), P, P))) for d in range(leading)]
    return signatures + [Signature((B,) * 4 + affine, _masked(call, (B, B, B)))]


# group norm


def _with_local_batch(func, ctx: LocalContext):
    """The op with its batch-size argument ``N`` set to this rank's number of samples."""
    return ctx.call(func, N=ctx.arguments["input"].shape[0])


@register(aten.native_group_norm, local_fns={LOCAL_BATCH: _with_local_batch})
def group_norm(call: OpCall) -> list[Signature]:
    affine = (B,) * (len(call.inputs) - 1)
    return [
        Signature((S(0),) + affine, (S(0),) * 3, local_fn=LOCAL_BATCH),
        Signature((B,) + affine, (B,) * 3),
    ]


@register(aten.native_group_norm_backward, local_fns={LOCAL_BATCH: _with_local_batch})
def group_norm_backward(call: OpCall) -> list[Signature]:
    affine = (B,) * (len(call.inputs) - 4)
    return [
        Signature((S(0),) * 4 + affine, _masked(call, (S(0), P, P)), local_fn=LOCAL_BATCH),
        Signature((B,) * 4 + affine, _masked(call, (B, B, B))),
    ]


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
    grad, x, weight, mask = a["grad_out"], a["input"], a["weight"], a["output_mask"]
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
    return tuple(g for g, wanted in zip((grad_input, grad_weight, grad_bias), mask) if wanted)


@register(
    aten.native_batch_norm,
    check_nd=every_split_part_nonempty,
    local_fns={SYNC_STATS: _sync_batch_norm, EVALUATION: _evaluation_batch_norm},
)
def batch_norm(call: OpCall) -> list[Signature]:
    x = call.inputs[0]
    per_channel = _present(call, PER_CHANNEL)
    training = call.bound["training"]
    stats_written = training and ("running_mean" in per_channel or "running_var" in per_channel)
    kernel = SYNC_STATS if training else EVALUATION
    signatures = []
    if not stats_written:
        channel_kernel = None if training else EVALUATION
        statistics = tuple(_channel_split(o) for o in call.outputs[1:])
        signatures.append(
            Signature((S(1),) + (S(0),) * len(per_channel), (S(1),) + statistics, local_fn=channel_kernel)
        )
    for d in _covered_dims(x.ndim):
        signatures.append(Signature((S(d),) + (B,) * len(per_channel), (S(d), B, B), local_fn=kernel))
    return signatures + [Signature((B,) * (1 + len(per_channel)), (B, B, B), local_fn=None if training else EVALUATION)]


@register(
    aten.native_batch_norm_backward,
    check_nd=every_split_part_nonempty,
    local_fns={SYNC_STATS: _sync_batch_norm_backward},
)
def batch_norm_backward(call: OpCall) -> list[Signature]:
    x = call.inputs[1]
    n = len(_present(call, PER_CHANNEL))
    training = call.bound["train"]
    channels = tuple(_channel_split(call.bound[name]) for name in _present(call, PER_CHANNEL))
    signatures = [Signature((S(1), S(1)) + channels, _masked(call, (S(1), S(0), S(0))))]
    for d in _covered_dims(x.ndim):
        grads = (S(d), B, B) if training else (S(d), P, P)
        kernel = SYNC_STATS if training else None
        signatures.append(Signature((S(d), S(d)) + (B,) * n, _masked(call, grads), local_fn=kernel))
    return signatures + [Signature((B,) * (2 + n), _masked(call, (B, B, B)))]
