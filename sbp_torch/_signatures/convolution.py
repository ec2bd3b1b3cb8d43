"""Convolution (``aten.convolution``, every dimensionality, plain or transposed) and its backward.

For ``convolution(input [N, Cin, ...], weight, bias [Cout]?)`` (weight [Cout, Cin/groups, ...], or
[Cin, Cout/groups, ...] when transposed) the valid 1-D signatures are:

    batch:        input S(0), weight B, bias B            → S(0)     any groups
    out-channel:  input B, weight S(Cout dim), bias S(0)  → S(1)     groups == 1
    in-channel:   input S(1), weight S(Cin dim), bias B   → P(sum)   groups == 1, local function "bias_once"
    linear:       input P, weight B, bias B (or B, P, B)  → P(sum)   local function "bias_once"
    B → B

The convolution is linear in input and weight, so partial sums stay partial; the bias, which must be added
once, is added only by the rank at coordinate 0 of the axes that make the output partial (local function
"bias_once"). A split of a spatial dim needs halos from the neighbours and is left to boxing. Every split
must leave each rank at least one channel (or sample), checked per N-D signature: torch's convolution
mishandles empty channel parts, and one rank failing would leave the others waiting in the next collective.

``convolution_backward(grad_output, input, weight)`` → (grad_input, grad_weight, grad_bias), each only where
``output_mask`` asks for it:

    batch:        S(0), S(0), B              → S(0), P, P
    out-channel:  S(1), B, S(Cout dim)       → P, S(Cout dim), S(0)
    in-channel:   B, S(1), S(Cin dim)        → S(1), S(Cin dim), B
    linear:       P, B, B                    → P, P, P
    B → B
"""

import torch

from .core import B, LocalContext, OpCall, P, S, Signature, every_split_part_nonempty, register, sig

aten = torch.ops.aten

BIAS_ONCE = "bias_once"


def _channel_dims(transposed: bool) -> tuple[int, int]:
    """(dim of the output channels, dim of the input channels) of the weight."""
    return (1, 0) if transposed else (0, 1)


def _convolve_bias_once(func, ctx: LocalContext) -> torch.Tensor:
    """The convolution without bias, plus the bias on the rank at coordinate 0 of every axis of this local function."""
    bias = ctx.arguments["bias"]
    out = ctx.call(func, bias=None)
    if bias is not None and all(ctx.coord[a] == 0 for a in ctx.axes):
        out = out + bias.view(1, -1, *[1] * (out.dim() - 2))
    return out


@register(
    aten.convolution,
    reads=("transposed", "groups"),
    check_nd=every_split_part_nonempty,
    local_fns={BIAS_ONCE: _convolve_bias_once},
)
def convolution(call: OpCall) -> list[Signature]:
    bias_once = BIAS_ONCE if call.get("bias") is not None else None
    out_dim, in_dim = _channel_dims(call.get("transposed", False))
    signatures = [sig(S(0), input=S(0), weight=B, bias=B)]
    if call.get("groups", 1) == 1:
        signatures += [
            sig(S(1), input=B, weight=S(out_dim), bias=S(0)),
            sig(P, bias_once, input=S(1), weight=S(in_dim), bias=B),
        ]
    return signatures + [
        sig(P, bias_once, input=P, weight=B, bias=B),
        sig(P, bias_once, input=B, weight=P, bias=B),
    ]


LOCAL_BIAS = "local_bias"


def _local_bias(func, ctx: LocalContext):
    """The backward with ``bias_sizes`` this rank's output channels: torch's kernel sums the bias gradient from
    the gradient's channels, but its shape function (what torch.compile traces) takes ``bias_sizes`` as given."""
    sizes = ctx.arguments["bias_sizes"] and [ctx.arguments["grad_output"].shape[1]]
    return ctx.call(func, bias_sizes=sizes)


@register(
    aten.convolution_backward,
    reads=("transposed", "groups", "output_mask"),
    check_nd=every_split_part_nonempty,
    local_fns={LOCAL_BIAS: _local_bias},
)
def convolution_backward(call: OpCall) -> list[Signature]:
    out_dim, in_dim = _channel_dims(call.get("transposed", False))
    mask = call["output_mask"]

    def signature(inputs, grads, local_fn=None):
        grad_output, x, weight = inputs
        wanted = tuple(g for g, w in zip(grads, mask) if w)
        return sig(wanted, local_fn, grad_output=grad_output, input=x, weight=weight)

    signatures = [signature((S(0), S(0), B), (S(0), P, P))]
    if call.get("groups", 1) == 1:
        signatures += [
            signature((S(1), B, S(out_dim)), (P, S(out_dim), S(0)), LOCAL_BIAS),
            signature((B, S(1), S(in_dim)), (S(1), S(in_dim), B)),
        ]
    return signatures + [signature((P, B, B), (P, P, P))]
