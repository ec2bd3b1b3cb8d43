"""The signature rules of the fused custom ops (``torch.ops.sbp_torch.*``), registered in the signature table
when ``sbp_torch.kernels`` is imported.

    bias_gelu(x[..., H], bias[H])         S(d)·B → S(d) for d < last;  S(last)·S(0) → S(last);  B·B → B
    bias_dropout_add(x, bias, residual)   the same with the residual laid out as x → (out, mask); local
                                          function "random" draws this rank's region of the logical mask
    scale_mask_softmax(x, mask)           S(d) on every dim but the last (and, causal, but the query dim),
                                          the mask split along where it has that dim, else B
    layer_norm / rms_norm(x, w[, b])      S(d)·B(·B) → S(d) for d < last (y and the statistics)
    cross_entropy(logits[N, C], target)   rows: S(0)·S(0) → loss S(0) (none) or P (sum, mean), lse S(0);
                                          vocabulary: S(1)·B → loss B, lse B, local function "ce": the local
                                          max and sum-exp are all-reduced as a max and a sum (the pick
                                          of the target logit as a sum), never the logits
    cross_entropy_backward                rows: S(0) everywhere (grad B unless none) → S(0); vocabulary:
                                          B·S(1)·B·B → S(1), local function "ce" (the one-hot part is local)

The other backward ops are in ``BACKWARD``: a row split of x splits what is laid out as x, takes the
parameters broadcast and makes their gradients partial sums (each rank sums its rows); where the op allows
a split of the features, the parameters and their gradients split with them. Every op has B everywhere → B.
"""

import torch

from .._signatures.core import B, GlobalMeta, LocalContext, OpCall, P, S, Signature, Split, operand_sbp, register, sig
from . import _bias_dropout_add as bda
from . import _bias_gelu, _norms, _softmax  # noqa: F401  (they define the ops ruled here)
from . import _cross_entropy as ce
from ._library import REDUCTIONS

ops = torch.ops.sbp_torch
RANDOM, CE = "random", "ce"


def _feature_signatures(call: OpCall, params: tuple[str, ...], like_x=(), local_fn=None, last=True) -> list[Signature]:
    """x split on a dim: per-feature parameters ``params`` B (split with x on the last dim if ``last``); the
    arguments ``like_x`` laid out as x; every output as x."""
    x = call["x"]
    signatures = []
    for d in range(x.ndim):
        if d == x.ndim - 1 and not last:
            continue
        param = S(0) if d == x.ndim - 1 else B
        layouts = {"x": S(d), **dict.fromkeys(params, param), **dict.fromkeys(like_x, S(d))}
        signatures.append(Signature(tuple(layouts.items()), S(d), local_fn))
    return signatures + [Signature(tuple((n, B) for n in ("x", *params, *like_x)), B, local_fn)]


@register(ops.bias_gelu)
def bias_gelu(call: OpCall) -> list[Signature]:
    return _feature_signatures(call, ("bias",))


def _keep(ctx: LocalContext, device) -> torch.Tensor | None:
    """This rank's region of the keep mask (None outside the placement); every rank draws."""
    a, mask = ctx.arguments, ctx.outputs[1]
    uniform = ctx.draw("uniform", GlobalMeta(mask.shape, a["x"].dtype, mask.placement, mask.sbp), device)
    return None if uniform is None else uniform < 1.0 - a["p"]


def _bias_dropout_add(func, ctx: LocalContext):
    a = ctx.arguments
    x, bias, residual, p = a["x"], a["bias"], a["residual"], a["p"]
    if not bda.draws(p, a["training"]):
        return x + bias + residual, torch.ones_like(x, dtype=torch.bool)
    keep = _keep(ctx, x.device)
    return bda.apply_mask(x, bias, residual, keep, p), keep


def _advance_outside(func, ctx: LocalContext) -> None:
    """Ranks outside the placement advance their generator as the ranks inside do."""
    if bda.draws(ctx.arguments["p"], ctx.arguments["training"]):
        _keep(ctx, ctx.placement.device())


@register(ops.bias_dropout_add, local_fns={RANDOM: _bias_dropout_add}, outside=_advance_outside)
def bias_dropout_add(call: OpCall) -> list[Signature]:
    return _feature_signatures(call, ("bias",), like_x=("residual",), local_fn=RANDOM)


@register(ops.scale_mask_softmax, reads=("causal",))
def scale_mask_softmax(call: OpCall) -> list[Signature]:
    x, mask = call["x"], call.get("mask")
    return [
        sig(S(d), x=S(d), mask=operand_sbp(x.shape, mask, d))
        for d in range(x.ndim - 1)
        if not (call["causal"] and d == x.ndim - 2)  # the causal mask needs the global query index
    ]


@register(ops.layer_norm, ops.rms_norm)
def norms(call: OpCall) -> list[Signature]:
    return _feature_signatures(call, tuple(n for n in ("weight", "bias") if n in call.arguments), last=False)


# Backward ops: (the arguments laid out as x: gradients, saved activations, statistics; the per-feature ones;
# per output, "x" if laid out as x or "p" if per feature: a parameter's gradient; whether the features may split).
BACKWARD = {
    ops.bias_gelu_backward: (("grad", "x"), ("bias",), "xp", True),  # -> (grad_x, grad_bias)
    ops.bias_dropout_add_backward: (("grad", "mask"), (), "xp", True),  # -> (grad_x, grad_bias)
    ops.scale_mask_softmax_backward: (("grad", "y"), (), "x", False),  # -> grad_x
    ops.layer_norm_backward: (("grad", "x", "mean", "rstd"), ("weight",), "xpp", False),  # -> grad_x, _w, _b
    ops.rms_norm_backward: (("grad", "x", "rstd"), ("weight",), "xp", False),  # -> (grad_x, grad_w)
}


def _backward_rule(like_x: tuple[str, ...], params: tuple[str, ...], outputs: str, feature_split: bool):
    def rule(call: OpCall) -> list[Signature]:
        def signature(x, param_in, param_out):
            inputs = {**dict.fromkeys(like_x, x), **dict.fromkeys(params, param_in)}
            return Signature(tuple(inputs.items()), tuple(x if c == "x" else param_out for c in outputs))

        last = call["grad"].ndim - 1
        signatures = [signature(S(d), B, P) for d in range(last)]
        if feature_split:
            signatures.append(signature(S(last), S(0), S(0)))
        return signatures

    return rule


for _op, _layout in BACKWARD.items():
    register(_op)(_backward_rule(*_layout))


# ---------------------------------------------------------------------------------------------------------
# cross entropy


def _axes(ctx: LocalContext, logits: GlobalMeta, dim: int) -> list[int]:
    return [a for a in ctx.axes if isinstance(s := logits.sbp[a], Split) and s.dim == dim]


def _ce_forward(func, ctx: LocalContext):
    """Row-split axes: local rows, mean divided by the count over them; class-split axes: local max and
    sum-exp and the picked logit combined by all-reduces of one number per row."""
    a = ctx.arguments
    logits, target, ignore_index, reduction = a["logits"], a["target"], a["ignore_index"], a["reduction"]
    layout = ctx.inputs[0]
    class_axes, row_axes = _axes(ctx, layout, 1), _axes(ctx, layout, 0)
    first = ctx.region(layout)[0][1]
    m, s = ce.max_and_sum_exp(logits)
    m_all = ctx.all_reduce(m, "max", class_axes)
    safe = torch.where(torch.isinf(m_all), 0.0, m_all)
    s_all = ctx.all_reduce(s * torch.exp(m - safe), "sum", class_axes)
    lse = m_all + s_all.log()
    pick = ctx.all_reduce(ce.picked(logits, target, first), "sum", class_axes)
    kept = target != ignore_index
    count = ctx.all_reduce(kept.sum(), "sum", row_axes)
    return ce.reduce_loss(lse - pick, kept, reduction, count), lse


def _ce_backward(func, ctx: LocalContext):
    a = ctx.arguments
    logits, target, lse, reduction = a["logits"], a["target"], a["lse"], a["reduction"]
    layout = ctx.inputs[1]
    first = ctx.region(layout)[0][1]
    kept = target != a["ignore_index"]
    count = ctx.all_reduce(kept.sum(), "sum", _axes(ctx, layout, 0))
    return ce.softmax_minus_onehot(logits, target, lse, ce.row_weights(a["grad"], kept, reduction, count), first)


@register(ops.cross_entropy, reads=("reduction",), local_fns={CE: _ce_forward})
def cross_entropy(call: OpCall) -> list[Signature]:
    loss = S(0) if call["reduction"] == REDUCTIONS["none"] else P
    return [sig((loss, S(0)), CE, logits=S(0), target=S(0)), sig(B, CE, logits=S(1), target=B)]


@register(ops.cross_entropy_backward, reads=("reduction",), local_fns={CE: _ce_backward})
def cross_entropy_backward(call: OpCall) -> list[Signature]:
    grad = S(0) if call["reduction"] == REDUCTIONS["none"] else B
    return [
        sig(S(0), CE, grad=grad, logits=S(0), target=S(0), lse=S(0)),
        sig(S(1), CE, grad=B, logits=S(1), target=B, lse=B),
    ]
