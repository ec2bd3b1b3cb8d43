"""``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` of global CUDA tensors, with fewer key heads than query
heads: the key and value heads are repeated first, and the call goes on without ``enable_gqa``.

CUDA's fused attention kernels do not all take grouped-query attention (the efficient kernel, which serves float32, does
not), and torch then falls back to its math path, which flattens the batch and heads into one dim below
``__torch_dispatch__``: a split of the heads cannot survive that (it is not the merged dim's outer one), so tensor
parallelism would move q, k and v by all-to-all around every attention. Repeating each key and value head for its group
of query heads (what the math path does too) keeps a heads split where the split is even, and the call reaches a fused
kernel, whose rule keeps batch and heads split (``_signatures/attention.py``). The CPU kernel takes grouped-query
attention itself, and its rule handles it: CPU calls go on as they are."""

import torch.nn.functional as F

from .._tensor import GlobalTensor

SDPA_FUNCS = {F.scaled_dot_product_attention}


def applies(func, args, kwargs) -> bool:
    """Whether the call is grouped-query attention of global CUDA tensors that this module rewrites."""
    if func not in SDPA_FUNCS or not kwargs.get("enable_gqa") or len(args) < 3:
        return False
    query, key, value = args[:3]
    if not all(isinstance(t, GlobalTensor) for t in (query, key, value)) or query.placement.type != "cuda":
        return False
    query_shape, key_shape = query._meta.shape, key._meta.shape  # .shape would re-enter __torch_function__
    return len(query_shape) >= 3 and len(key_shape) >= 3 and query_shape[-3] != key_shape[-3]


def with_repeated_heads(args, kwargs):
    """The call's (args, kwargs) with each key and value head repeated for its group of query heads, and no
    ``enable_gqa``."""
    query, key, value = args[:3]
    group = query._meta.shape[-3] // key._meta.shape[-3]
    key, value = (t.repeat_interleave(group, dim=-3) for t in (key, value))
    return (query, key, value, *args[3:]), {k: v for k, v in kwargs.items() if k != "enable_gqa"}
