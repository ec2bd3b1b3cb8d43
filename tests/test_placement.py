"""Placement and SBP objects: construction, validation, equality. No process group needed."""

import pytest

import sbp_torch as st
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split


def test_one_and_n_dimensional_ranks():
    line = st.placement("cpu", [3, 1, 2])
    assert (line.type, line.ranks, line.shape, line.ndim) == ("cpu", [3, 1, 2], (3,), 1)
    grid = st.placement("cuda", ranks=[[0, 1], [2, 3], [4, 5]])
    assert (grid.ranks, grid.shape, grid.ndim, grid.size) == ([[0, 1], [2, 3], [4, 5]], (3, 2), 2, 6)
    assert grid.coord_of(3) == (1, 1) and grid.coord_of(7) is None
    assert grid.axis_ranks(0, (1, 1)) == (1, 3, 5) and grid.axis_ranks(1, (2, 0)) == (4, 5)
    cube = st.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    assert cube.shape == (2, 2, 2) and cube.rank_at((1, 0, 1)) == 5


def test_equality_and_hashing_follow_type_and_ranks():
    a, b = st.placement("cpu", [[0, 1], [2, 3]]), st.placement("cpu", [[0, 1], [2, 3]])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != st.placement("cpu", [0, 1, 2, 3])
    assert a != st.placement("cuda", [[0, 1], [2, 3]])
    assert a != st.placement("cpu", [[0, 2], [1, 3]])


@pytest.mark.parametrize(
    "ranks, message",
    [
        ([0, 1, 1], "more than once"),
        ([[0, 1], [2]], "not rectangular"),
        ([], "non-empty"),
        (3, "must be a list"),
        ([0, [1, 2]], "mixes ints and lists"),
        ([0, -1], "non-negative"),
    ],
)
def test_bad_rank_lists_are_refused(ranks, message):
    with pytest.raises(ValueError, match=message):
        st.placement("cpu", ranks)


def test_bad_device_type_is_refused():
    with pytest.raises(ValueError, match="type must be one of"):
        st.placement("tpu", [0])


def test_sbp_reprs_and_values():
    assert [repr(s) for s in (split(1), broadcast, partial_sum, partial_max, partial_min)] == [
        "S(1)",
        "B",
        "P",
        "P(max)",
        "P(min)",
    ]
    assert split(0) == split(0) and split(0) != split(1) and hash(split(2)) == hash(split(2))
    with pytest.raises(TypeError):
        split(1.5)
    with pytest.raises(ValueError, match="must be one of"):
        st.sbp.partial("prod")
