"""Fused scaled dot-product attention, forward and backward: the CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) and CUDA's three (``_scaled_dot_product_efficient_attention``,
``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_cudnn_attention``).

Query ``[B, H, L, E]``, key and value ``[B, Hk, S, E]`` (``Hk`` divides ``H``: grouped-query attention); the output
``[B, H, L, E]`` and the log-sum-exp ``[B, H, L]`` (padded along ``L`` by the efficient kernel); the optional additive
or boolean mask (``attn_mask``, ``attn_bias``) broadcasts to ``[B, H, L, S]``. Batches and heads are independent, so
for ``d`` the batch dim 0 or the heads dim 1:

    S(d) on query, key, value (and, backward, the gradient, output and log-sum-exp)   → S(d)
        the mask split along ``d`` where it has that dim in full, else B; with grouped-query attention a heads split
        only where every split of the heads is even, so each rank's query heads find their own key heads
    B everywhere → B

What else the CUDA kernels take and give (random-number state, the sequence offsets of nested inputs, maximum lengths,
the debug mask) describes the whole call, not a batch or a head, and is broadcast. Dropout draws random numbers per
call, so a call with ``dropout_p > 0`` has no rule (the fallback runs it).
"""

import math
from typing import NamedTuple

import torch

from .core import B, OpCall, S, Signature, register

aten = torch.ops.aten

SPLIT, MASK, WHOLE = "split", "mask", "whole"


class AttentionOp(NamedTuple):
    """Which tensor arguments and outputs (by position) follow the batch and heads of the query (``SPLIT``), follow
    the mask's layout (``MASK``, the mask and its gradient) or describe the whole call (every other)."""

    split: tuple[str, ...]
    mask: str | None
    outputs: tuple[str, ...]  # per tensor output, in order: SPLIT, MASK or WHOLE


_FORWARD = ("query", "key", "value")
_BACKWARD = ("grad_out", "query", "key", "value", "out", "logsumexp")
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: AttentionOp(_FORWARD, "attn_mask", (SPLIT, SPLIT)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: AttentionOp(
        _BACKWARD, "attn_mask", (SPLIT,) * 3
    ),
    aten._scaled_dot_product_efficient_attention.default: AttentionOp(
        _FORWARD, "attn_bias", (SPLIT, SPLIT, WHOLE, WHOLE)
    ),
    aten._scaled_dot_product_efficient_attention_backward.default: AttentionOp(
        ("grad_out_",) + _BACKWARD[1:], "attn_bias", (SPLIT, SPLIT, SPLIT, MASK)
    ),
    aten._scaled_dot_product_flash_attention.default: AttentionOp(_FORWARD, None, (SPLIT, SPLIT) + (WHOLE,) * 5),
    aten._scaled_dot_product_flash_attention_backward.default: AttentionOp(_BACKWARD, None, (SPLIT,) * 3),
    aten._scaled_dot_product_cudnn_attention.default: AttentionOp(_FORWARD, "attn_bias", (SPLIT, SPLIT) + (WHOLE,) * 5),
    aten._scaled_dot_product_cudnn_attention_backward.default: AttentionOp(_BACKWARD, "attn_bias", (SPLIT,) * 3),
}


def _mask_sbp(call: OpCall, mask: str | None, dim: int):
    """The mask's SBP when dim ``dim`` of ``[B, H, L, S]`` is split: split where the mask has that dim in full (more
    than one), broadcast where it broadcasts over it."""
    info = call.get(mask) if mask else None
    if info is None:
        return B
    full = call["query"].shape[dim]
    at = dim - (4 - info.ndim)  # the mask's dims align with the trailing dims of [B, H, L, S]
    return S(at) if at >= 0 and info.shape[at] == full > 1 else B


def _even_heads(call: OpCall, combo: tuple[Signature, ...]) -> bool:
    """With grouped-query attention, the axes splitting the heads must split both head counts evenly."""
    heads, key_heads = call["query"].shape[1], call["key"].shape[1]
    if heads == key_heads:
        return True
    parts = math.prod(n for n, signature in zip(call.mesh_shape, combo) if signature.sbp_of("query") == S(1))
    return heads % parts == 0 and key_heads % parts == 0


@register(*ATTENTION, reads=("dropout_p",), check_nd=_even_heads)
def attention(call: OpCall) -> list[Signature] | None:
    if call.get("dropout_p", 0.0):
        return None
    op = ATTENTION[call.func]
    signatures = []
    for dim in (0, 1):
        mask = _mask_sbp(call, op.mask, dim)
        layouts = {SPLIT: S(dim), MASK: mask, WHOLE: B}
        inputs = {name: B for name in call.tensor_names()}
        inputs.update({name: S(dim) for name in op.split})
        if op.mask:
            inputs[op.mask] = mask
        outputs = tuple(layouts[kind] for kind in op.outputs[: len(call.outputs)])
        signatures.append(Signature(tuple(inputs.items()), outputs))
    return signatures
