"""Layout arithmetic: balanced uneven parts and nested splits. No process group needed."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._layout import GlobalMeta, balanced_part, balanced_sizes, normalize_sbp
from sbp_torch.sbp import broadcast, partial_sum, split


def test_first_parts_get_the_extra_rows():
    assert balanced_sizes(7, 3) == [3, 2, 2]
    assert [balanced_part(7, 3, i) for i in range(3)] == [(0, 3), (3, 2), (5, 2)]
    assert balanced_sizes(2, 4) == [1, 1, 0, 0]


@given(st_.integers(0, 50), st_.integers(1, 9))
def test_parts_tile_the_dim_like_tensor_split(n, parts):
    sizes = [len(p) for p in torch.arange(n).tensor_split(parts)]
    assert balanced_sizes(n, parts) == sizes
    assert [balanced_part(n, parts, i) for i in range(parts)] == [(sum(sizes[:i]), sizes[i]) for i in range(parts)]


def test_nested_split_cuts_the_part_of_the_earlier_axis():
    grid = st.placement("cpu", [[0, 1], [2, 3]])
    meta = GlobalMeta((7, 5), torch.float32, grid, (split(0), split(0)))
    regions = {c: meta.region(c) for c in itertools.product(range(2), range(2))}
    # axis 0 gives rows [0, 4) and [4, 7); axis 1 splits each of them again
    assert regions == {
        (0, 0): ([0, 0], [2, 5]),
        (0, 1): ([2, 0], [2, 5]),
        (1, 0): ([4, 0], [2, 5]),
        (1, 1): ([6, 0], [1, 5]),
    }
    cross = GlobalMeta((7, 5), torch.float32, grid, (split(1), split(0)))
    assert cross.region((1, 1)) == ([4, 3], [3, 2])


def test_partial_and_broadcast_keep_the_whole_region():
    line = st.placement("cpu", [0, 1, 2])
    assert GlobalMeta((4, 2), torch.float32, line, (partial_sum,)).local_shape((2,)) == (4, 2)
    assert GlobalMeta((4, 2), torch.float32, line, (broadcast,)).local_shape((1,)) == (4, 2)
    assert GlobalMeta((4, 2), torch.float32, line, (broadcast,)).local_shape(None) == (0,)


def test_sbp_validation_names_the_problem():
    grid = st.placement("cpu", [[0, 1], [2, 3]])
    assert normalize_sbp((split(-1), broadcast), grid, 3, torch.float32) == (split(2), broadcast)
    with pytest.raises(ValueError, match="out of range"):
        normalize_sbp((split(3), broadcast), grid, 3, torch.float32)
    with pytest.raises(ValueError, match="2 axes"):
        normalize_sbp(split(0), grid, 3, torch.float32)
    with pytest.raises(TypeError, match="undefined for bool"):
        normalize_sbp((partial_sum, broadcast), grid, 1, torch.bool)
    with pytest.raises(TypeError, match="tuple of SBPs"):
        normalize_sbp(("S0", broadcast), grid, 1, torch.float32)
