"""The op path's caches (``sbp_torch.cache_info``, ``cache_clear``, ``set_cache_size``): least recently used,
bounded, and the results of a run with ever new shapes are those of one process whatever the bound."""

from __future__ import annotations

import pytest
import torch

import sbp_torch as st
from sbp_torch._dispatch import LruCache
from sbp_torch.sbp import broadcast, split

from world import run_on_world


def test_lru_cache_keeps_the_most_recent_entries_within_its_bound():
    cache = LruCache(maxsize=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)  # drops "b", the least recent
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert cache.info() == (3, 1, 2, 2)  # hits, misses, maxsize, currsize
    cache.resize(1)
    assert list(cache.entries()) == [3]
    with pytest.raises(ValueError, match="at least one entry"):
        cache.resize(0)
    cache.clear()
    assert cache.info() == (0, 0, 1, 0)


def _varying_sequence_lengths(lengths: int, bound: int) -> tuple:
    """A step of a small model on batches of ever new sequence lengths, with the caches bounded at ``bound``:
    the largest sizes the caches reached, whether every loss equals one process's, and the statistics."""
    st.cache_clear()
    st.set_cache_size(bound)
    try:
        p = st.placement("cpu", [0, 1])
        torch.manual_seed(0)
        weight = torch.randn(8, 8, dtype=torch.float64)
        w = weight.to_global(p, broadcast).to_global(sbp=split(1)).requires_grad_()
        largest, exact = 0, True
        for length in range(1, lengths + 1):
            x = torch.randn(length, 8, dtype=torch.float64)
            loss = torch.relu(x.to_global(p, broadcast) @ w).pow(2).mean()
            loss.backward()
            with torch.no_grad():  # the local-call path: no autograd record
                (w * 0.5).sum()
            exact &= torch.allclose(loss.full_tensor(), torch.relu(x @ weight).pow(2).mean())
            info = st.cache_info()
            largest = max(largest, info.calls.currsize, info.local_calls.currsize)
        return largest, exact, st.cache_info()
    finally:
        st.set_cache_size(4096)


@pytest.mark.gloo
def test_a_long_run_with_new_shapes_keeps_the_caches_at_their_bound():
    for largest, exact, info in run_on_world(2, _varying_sequence_lengths, 200, 16):
        assert exact
        assert largest <= 16, largest
        assert info.calls.maxsize == info.local_calls.maxsize == 16
        assert info.calls.misses > 200  # every new length is a new key: decided again, not kept forever


def _repeated_calls() -> tuple:
    """The statistics of both caches around five repeats of a call that autograd records (the dispatch path)
    and of one that it does not (a local call, learnt on its second sight)."""
    st.cache_clear()
    p = st.placement("cpu", [0, 1])
    x = torch.ones(4, 3).to_global(p, split(0)).requires_grad_()
    x * x
    before = st.cache_info()
    for _ in range(5):
        x * x
    with torch.no_grad():
        for _ in range(5):
            x - x
    return before, st.cache_info()


@pytest.mark.gloo
def test_repeated_calls_hit_their_entries():
    for before, after in run_on_world(2, _repeated_calls):
        assert before.calls.misses >= 1
        assert after.calls.hits - before.calls.hits >= 5
        assert after.local_calls.hits >= 3  # the first sight and the learning call take the dispatch path
