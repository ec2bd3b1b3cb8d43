"""``sbp_torch::gradient_boundary``: an op of sbp_torch's own, the identity on a global tensor, on whose backward a
parameter's gradient is boxed to its reduced layout (the frontend inserts it while torch.compile traces; its
backward is registered there). Each layout maps to itself, and the local part is an alias of the input's."""

import torch

from .core import LocalContext, OpCall, S, Signature, pass_through, register, sig

torch.library.define("sbp_torch::gradient_boundary", "(Tensor x) -> Tensor")
GRADIENT_BOUNDARY = torch.ops.sbp_torch.gradient_boundary.default


@torch.library.register_fake("sbp_torch::gradient_boundary")
def _shape(x):
    return torch.empty_like(x)


def _alias(func, ctx: LocalContext):
    return torch.ops.aten.alias.default(ctx.arguments["x"])


@register(GRADIENT_BOUNDARY, local_fns={"alias": _alias})
def gradient_boundary(call: OpCall) -> list[Signature]:
    splits = [sig(S(d), "alias", x=S(d)) for d in range(call["x"].ndim)]
    return splits + pass_through(["x"], "alias")
