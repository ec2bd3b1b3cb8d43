"""Random ops: ``rand_like``, ``randn_like``, ``bernoulli`` (and ``bernoulli_``), ``normal_``, ``uniform_``,
``native_dropout``.

The logical random values do not depend on the world size, the placement or the SBPs: with the same seed on
every rank, a dropout mask on a split tensor is the mask the same program draws on one rank. Every signature
runs the local function ``random``, which draws the logical tensor's values in this rank's region with
``LocalContext.draw`` (CPU: the whole logical tensor from torch's generator, then the region; CUDA: a
counter-based stream evaluated on the region only) and computes the op from them:

* ``rand_like``/``uniform_`` use uniform draws, ``randn_like``/``normal_`` normal ones (on CPU the values
  of ``torch.rand``/``torch.randn`` of the logical shape, as torch itself gives);
* ``bernoulli`` is ``u < p`` for uniform draws ``u``; dropout keeps ``u < 1 - p`` and scales the kept values
  by ``1 / (1 - p)``, the same mask whether it comes from ``native_dropout`` or from ``bernoulli_``.

So bernoulli and dropout masks differ from torch's own CPU streams for them (they equal our one-rank result),
in exchange for the layout independence. Partial outputs of in-place ops hold the value on one rank per
partial-sum axis (zeros elsewhere); calls with an explicit ``generator`` take the broadcast fallback.
"""

import torch

from .core import (
    PARTIALS,
    B,
    GlobalMeta,
    LocalContext,
    OpCall,
    S,
    Signature,
    like_input,
    operand_sbp,
    partials_as_broadcast,
    register,
    sig,
)

aten = torch.ops.aten

# op -> (distribution drawn, the result from the drawn values ``u`` and the op's local arguments by name)
DRAWS = {
    aten.rand_like.default: ("uniform", lambda u, a: u),
    aten.randn_like.default: ("normal", lambda u, a: u),
    aten.bernoulli.default: ("uniform", lambda u, a: u < a["self"]),
    aten.bernoulli.p: ("uniform", lambda u, a: u < a["p"]),
    aten.bernoulli_.float: ("uniform", lambda u, a: u < a["p"]),
    aten.bernoulli_.Tensor: ("uniform", lambda u, a: u < a["p"]),
    aten.normal_.default: ("normal", lambda u, a: u * a["std"] + a["mean"]),
    aten.uniform_.default: ("uniform", lambda u, a: u * (a["to"] - a["from"]) + a["from"]),
}
IN_PLACE = {aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.normal_.default, aten.uniform_.default}


def _draw(func, ctx: LocalContext, device) -> torch.Tensor | None:
    """This rank's region of the values the op draws (of the output's layout; a floating dtype, the
    default one for other outputs), or None where it draws none (dropout in evaluation) or outside the
    placement. Every rank calls it: drawing advances the generator."""
    if func == aten.native_dropout.default:
        if ctx.arguments["train"] is False:
            return None
        kind, meta, dtype = "uniform", ctx.outputs[1], ctx.arguments["input"].dtype
    else:
        kind, meta = DRAWS[func][0], ctx.outputs[0]
        dtype = meta.dtype if meta.dtype.is_floating_point else torch.get_default_dtype()
    return ctx.draw(kind, GlobalMeta(meta.shape, dtype, meta.placement, meta.sbp), device)


def _random(func, ctx: LocalContext):
    a = ctx.arguments
    x = a["input"] if func == aten.native_dropout.default else a["self"]
    drawn = _draw(func, ctx, x.device)
    if func == aten.native_dropout.default:
        mask_dtype = ctx.outputs[1].dtype
        if drawn is None:
            return x.clone(), torch.ones_like(x, dtype=mask_dtype)
        keep = 1.0 - a["p"]
        mask = drawn < keep
        return x * mask * (0.0 if keep == 0 else 1.0 / keep), mask.to(mask_dtype)
    out = ctx.outputs[0]
    values = DRAWS[func][1](drawn, a).to(out.dtype)
    values = ctx.box(values, out.with_sbp(partials_as_broadcast(out.sbp)), out.sbp)  # partial axes: made locally
    return x.copy_(values) if func in IN_PLACE else values


LOCAL_FNS = {"random": _random}


def _advance_outside(func, ctx: LocalContext) -> None:
    """On a rank outside the placement: advance the generator by the draws the ranks inside make."""
    _draw(func, ctx, ctx.placement.device())


def _uses_own_generator(call: OpCall) -> bool:
    return call.get("generator") is not None


@register(
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.p,
    reads=("generator",),
    local_fns=LOCAL_FNS,
    outside=_advance_outside,
)
def fresh(call: OpCall) -> list[Signature] | None:
    """The input gives only the shape: its splits are kept, broadcast and partial inputs give B."""
    return None if _uses_own_generator(call) else like_input(call, "random")


@register(aten.bernoulli.default, reads=("generator",), local_fns=LOCAL_FNS, outside=_advance_outside)
def bernoulli(call: OpCall) -> list[Signature] | None:
    """The input holds the probabilities: split or broadcast (a partial probability is no probability)."""
    if _uses_own_generator(call):
        return None
    return [sig(S(d), "random", self=S(d)) for d in range(call["self"].ndim)] + [sig(B, "random", self=B)]


@register(*IN_PLACE, reads=("generator", "p"), local_fns=LOCAL_FNS, outside=_advance_outside)
def fill_random(call: OpCall) -> list[Signature] | None:
    """In place: the tensor keeps its layout (partial too); a tensor ``p`` of ``bernoulli_`` broadcasts."""
    if _uses_own_generator(call):
        return None
    x, p = call["self"], call.get("p")
    signatures = [sig(S(d), "random", self=S(d), p=operand_sbp(x.shape, p, d)) for d in range(x.ndim)]
    return signatures + [sig(s, "random", self=s, p=B) for s in (B, *PARTIALS)]


@register(aten.native_dropout.default, local_fns=LOCAL_FNS, outside=_advance_outside)
def native_dropout(call: OpCall) -> list[Signature]:
    """(output, mask): the output is linear in the input, so a partial input gives a partial output and a
    broadcast mask."""
    splits = [sig(S(d), "random", input=S(d)) for d in range(call["input"].ndim)]
    return splits + [sig((s, B), "random", input=s) for s in (B, *PARTIALS)]
