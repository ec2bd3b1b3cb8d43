"""Fused scaled dot-product attention on CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward.

Query ``[B, H, L, E]``, key and value ``[B, Hk, S, E]`` (``Hk`` divides ``H``: grouped-query attention); output
``[B, H, L, E]`` and log-sum-exp ``[B, H, L]``; the optional additive or boolean mask broadcasts to ``[B, H, L, S]``.
Batches and heads are independent, so:

    S(0) on every operand            → S(0)    (a mask with a batch dim of size 1, or none, stays B)
    S(1) on query, key, value        → S(1)    (a mask with a heads dim of size H is S(1), otherwise B); with
                                               grouped-query attention only where every split of the heads is
                                               even, so each rank's query heads find their own key heads
    B everywhere                     → B

Dropout draws random numbers per call, so a call with ``dropout_p > 0`` has no rule (the fallback runs it).
The backward takes ``(grad_out, query, key, value, out, logsumexp[, mask])`` with the same layouts and gives
the gradients of query, key and value.
"""

import math

import torch

from .core import B, OpCall, S, Signature, register

aten = torch.ops.aten


def _mask_sbp(call: OpCall, mask_index: int, dim: int, full: int):
    """The mask's SBP when the batch (``dim`` 0) or heads (``dim`` 1) are split: split where it has that dim in
    full, broadcast where it broadcasts over it."""
    if len(call.inputs) <= mask_index:
        return ()
    mask = call.inputs[mask_index]
    at = dim - (4 - mask.ndim)  # the mask's dims align with the trailing dims of [B, H, L, S]
    return (S(at),) if at >= 0 and mask.shape[at] == full > 1 else (B,)


def _signatures(call: OpCall, query_index: int, mask_index: int, n_tensors: int, n_out: int) -> list[Signature]:
    if call.bound.get("dropout_p", 0.0):
        return []
    query = call.inputs[query_index]
    batch, heads = query.shape[0], query.shape[1]
    out = []
    for dim, full in ((0, batch), (1, heads)):
        out.append(Signature((S(dim),) * n_tensors + _mask_sbp(call, mask_index, dim, full), (S(dim),) * n_out))
    return out + [Signature((B,) * len(call.inputs), (B,) * n_out)]


def _even_heads(query_index: int):
    """check_nd: with grouped-query attention, the axes splitting the heads must split both head counts evenly."""

    def check(call: OpCall, combo: tuple) -> bool:
        heads, key_heads = call.inputs[query_index].shape[1], call.inputs[query_index + 1].shape[1]
        if heads == key_heads:
            return True
        parts = math.prod(n for n, sig in zip(call.mesh_shape, combo) if sig.inputs[query_index] == S(1))
        return heads % parts == 0 and key_heads % parts == 0

    return check


@register(aten._scaled_dot_product_flash_attention_for_cpu, check_nd=_even_heads(0))
def flash_attention_cpu(call: OpCall) -> list[Signature]:
    return _signatures(call, query_index=0, mask_index=3, n_tensors=3, n_out=2)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward, check_nd=_even_heads(1))
def flash_attention_cpu_backward(call: OpCall) -> list[Signature]:
    return _signatures(call, query_index=1, mask_index=6, n_tensors=6, n_out=3)
