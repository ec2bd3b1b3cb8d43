"""Scaled dot-product attention on global tensors split by heads, against one process, forward and backward, in strict
mode (a fallback would raise): grouped-query attention (4 query heads, 2 key heads) through the CPU kernel, which takes
it itself, and through the key and value heads repeated first, as CUDA calls are (``_frontend/_grouped_attention.py``).
The CUDA kernels' rules are checked on meta tensors by ``tests/test_rule_checker.py`` and on a GPU by
``tests/test_models_gpu.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch._frontend._grouped_attention import with_repeated_heads
from sbp_torch.sbp import broadcast, split

from world import run_on_world

pytestmark = pytest.mark.gloo


def _inputs():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4, 5, 8), (3, 2, 6, 8), (3, 2, 6, 8)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def grouped_attention(repeat: bool) -> tuple:
    p = st.placement("cpu", [0, 1])
    q, k, v = (t.to_global(p, broadcast).to_global(sbp=split(1)).requires_grad_() for t in _inputs())
    args, kwargs = (q, k, v), {"enable_gqa": True, "is_causal": True}
    if repeat:
        args, kwargs = with_repeated_heads(args, kwargs)
    with st.strict():
        out = F.scaled_dot_product_attention(*args, **kwargs)
        out.sum().backward()
    return out.sbp, out.full_tensor().detach(), [t.grad.full_tensor() for t in (q, k, v)]


@pytest.mark.parametrize("repeat", [False, True], ids=["cpu_kernel", "heads_repeated"])
def test_grouped_query_attention_stays_split_by_heads(repeat):
    leaves = [t.requires_grad_() for t in _inputs()]
    want = F.scaled_dot_product_attention(*leaves, enable_gqa=True, is_causal=True)
    want.sum().backward()
    for sbp, out, grads in run_on_world(2, grouped_attention, repeat):
        assert sbp == (split(1),)
        torch.testing.assert_close(out, want.detach())
        for got, leaf in zip(grads, leaves):
            torch.testing.assert_close(got, leaf.grad)
