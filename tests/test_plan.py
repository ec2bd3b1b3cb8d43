"""Boxing plans as data: the collective each transition uses and the bytes it sends. No process group."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._boxing.plan import POINT_TO_POINT, plan_boxing, search
from sbp_torch._layout import GlobalMeta, balanced_sizes
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split

LINE = st.placement("cpu", [0, 1, 2])
N = 7 * 5 * 4  # bytes of a (7, 5) float32 tensor


def plan(src, dst, shape=(7, 5), placement=LINE):
    src = src if isinstance(src, tuple) else (src,)
    dst = dst if isinstance(dst, tuple) else (dst,)
    return plan_boxing(GlobalMeta(shape, torch.float32, placement, src), dst)


@pytest.mark.parametrize(
    "src, dst, collectives, bytes_sent",
    [
        (split(0), broadcast, ["all-gather"], 2 * N),  # every part reaches the 2 other ranks
        (partial_sum, broadcast, ["all-reduce"], 2 * 2 * N),  # ring: 2 (p-1)/p N per rank
        (partial_sum, split(1), ["reduce-scatter"], 2 * N),  # each rank sends what others keep
        (broadcast, split(0), ["local slice"], 0),
        (broadcast, partial_sum, ["local"], 0),
        (split(1), partial_max, ["local fill"], 0),
        (partial_sum, partial_max, ["reduce-scatter", "local fill"], 2 * N),  # half an all-reduce
        (partial_max, partial_max, [], 0),
    ],
)
def test_one_dimensional_rows(src, dst, collectives, bytes_sent):
    p = plan(src, dst)
    assert [s.collective for s in p.steps] == collectives and p.bytes_sent == bytes_sent


def test_all_to_all_sends_everything_but_the_diagonal():
    rows, cols = balanced_sizes(7, 3), balanced_sizes(5, 3)
    kept = sum(r * c for r, c in zip(rows, cols)) * 4
    assert plan(split(0), split(1)).bytes_sent == N - kept


def test_partial_op_change_of_a_scalar_goes_through_broadcast():
    p = plan(partial_sum, partial_min, shape=())
    assert [(s.src, s.dst) for s in p.steps] == [(partial_sum, broadcast), (broadcast, partial_min)]


GRID = st.placement("cpu", [[0, 1], [2, 3]])
BIG = (1024, 512)  # 2 MiB of float32: bytes outweigh the latency of a collective
BIG_N = 1024 * 512 * 4


def test_nested_split_moves_the_inner_axis_off_the_gathered_dim():
    """Axis 0 cannot gather dim 0 while axis 1 splits it: axis 1 moves off dim 0 first. The search re-cuts it
    by all-to-all, cheaper than the release to broadcast (gather, gather, slice) it competes with. Sending
    each rank the quarters it lacks beats both: 6 of the 16 quarters the ranks hold move, in 6 messages."""
    meta = GlobalMeta(BIG, torch.float32, GRID, (split(0), split(0)))
    steps = search(meta, (broadcast, split(0)), point_to_point=False)
    first_gather = next(i for i, s in enumerate(steps) if s.axis == 0)
    assert all(s.dst != split(0) for s in steps[:first_gather] if s.axis == 1)
    release = [
        ((split(0), split(0)), (split(0), broadcast)),
        ((split(0), broadcast), (broadcast, broadcast)),
        ((broadcast, broadcast), (broadcast, split(0))),
    ]
    assert sum(s.cost for s in steps) < sum(plan(a, b, shape=BIG, placement=GRID).cost for a, b in release)
    p = plan((split(0), split(0)), (broadcast, split(0)), shape=BIG, placement=GRID)
    assert [s.collective for s in p.steps] == [POINT_TO_POINT] and p.bytes_sent == 6 * BIG_N // 4
    independent = plan((split(0), split(1)), (broadcast, split(1)), placement=GRID)
    assert [(s.axis, s.collective) for s in independent.steps] == [(0, "all-gather")]


def test_mixed_partial_ops_are_reduced_innermost_first():
    """The max (inner axis) must be reduced before the sum. For a large tensor the cheapest route
    reduce-scatters it, so that the sum's all-reduce moves half the data (3 steps of 2 N, against 4 N for each
    of two all-reduces); for a small one, two all-reduces (two collectives, not three)."""
    p = plan((partial_sum, partial_max), (broadcast, broadcast), shape=BIG, placement=GRID)
    assert [(s.axis, s.src, s.collective) for s in p.steps] == [
        (1, partial_max, "reduce-scatter"),
        (0, partial_sum, "all-reduce"),
        (1, split(0), "all-gather"),
    ]
    assert p.bytes_sent == 3 * 2 * BIG_N < 2 * 4 * BIG_N
    small = plan((partial_sum, partial_max), (broadcast, broadcast), placement=GRID)
    assert [(s.axis, s.src, s.collective) for s in small.steps] == [
        (1, partial_max, "all-reduce"),
        (0, partial_sum, "all-reduce"),
    ]


def test_two_partial_axes_reduce_a_scattered_part():
    """(P, P) -> (B, B) of a large tensor: reduce-scatter on one axis, all-reduce of that half on the other,
    all-gather: 2 N per step over the 4 ranks (6 N, the minimum), not two full all-reduces (8 N)."""
    p = plan((partial_sum, partial_sum), (broadcast, broadcast), shape=BIG, placement=GRID)
    assert [s.collective for s in p.steps] == ["reduce-scatter", "all-reduce", "all-gather"]
    assert p.bytes_sent == 6 * BIG_N


def test_latency_counts_per_collective():
    """Each collective step costs its bytes plus the latency of the call; local steps cost nothing."""
    from sbp_torch._boxing.plan import LATENCY_BYTES_PER_RANK

    gather = plan(split(0), broadcast)
    assert gather.cost == gather.bytes_sent + 3 * LATENCY_BYTES_PER_RANK
    assert plan(broadcast, split(0)).cost == 0


SBPS = [split(0), split(1), broadcast, partial_sum, partial_max, partial_min]


@given(
    st_.sampled_from(list(itertools.product(SBPS, repeat=2))), st_.sampled_from(list(itertools.product(SBPS, repeat=2)))
)
def test_every_2d_plan_ends_at_the_target_and_is_deterministic(src, dst):
    grid = st.placement("cpu", [[0, 1], [2, 3]])
    p = plan(src, dst, placement=grid)
    state = list(src)
    for step in p.steps:
        if step.collective == POINT_TO_POINT:  # every axis at once, never from or to a partial layout
            assert tuple(state) == step.src and not any(s in (partial_sum, partial_max, partial_min) for s in state)
            state = list(step.dst)
            continue
        assert state[step.axis] == step.src
        state[step.axis] = step.dst
    assert tuple(state) == dst
    assert plan_boxing.__wrapped__(p.meta, dst) == p  # recomputed, not cached: same steps


@pytest.mark.parametrize(
    "src, dst, quarters_moved",
    [
        ((split(0), broadcast), (broadcast, split(0)), 4),  # ranks 1 and 2 swap halves (2 quarters each)
        ((split(0), split(1)), (split(1), split(0)), 2),  # ranks 1 and 2 swap their quarters
    ],
)
def test_swaps_are_point_to_point_at_the_minimum_bytes(src, dst, quarters_moved):
    """Any sequence of collectives gathers a whole axis first; sending just the missing pieces moves the
    minimum, for small tensors (fewer messages) and large ones (fewer bytes) alike."""
    for shape, n in [(BIG, BIG_N), ((8, 8), 8 * 8 * 4)]:
        p = plan(src, dst, shape=shape, placement=GRID)
        assert [s.collective for s in p.steps] == [POINT_TO_POINT]
        assert p.bytes_sent == quarters_moved * n // 4
        assert p.bytes_sent < sum(s.bytes_sent for s in search(p.meta, dst, point_to_point=False))


@pytest.mark.parametrize("shape", [(8, 8), (7, 5), (3, 9, 2), (1, 4), (0, 6)])
def test_a_point_to_point_step_is_priced_as_its_pieces_without_listing_them(shape):
    """The search prices point-to-point edges from counts (their pieces grow with the square of the ranks);
    the price must be the pieces' own, on uneven and empty parts and nested splits too."""
    from sbp_torch._boxing.plan import _point_to_point, _point_to_point_priced

    grid = st.placement("cpu", [[0, 1, 2], [3, 4, 5]])
    sbps = [broadcast] + [split(d) for d in range(len(shape))]
    for src, dst in itertools.product(itertools.product(sbps, repeat=2), repeat=2):
        meta = GlobalMeta(shape, torch.float32, grid, src)
        listed, priced = _point_to_point(meta, dst), _point_to_point_priced(meta, dst)
        assert (priced.bytes_sent, priced.cost) == (listed.bytes_sent, listed.cost)


def test_partial_sources_are_reduced_before_going_point_to_point():
    """(P, S0) -> (S0, S1): the minimum sends 3/4 N (the module docstring of benchmarks/suites/boxing.py);
    collectives alone send N."""
    p = plan((partial_sum, split(0)), (split(0), split(1)), shape=BIG, placement=GRID)
    assert POINT_TO_POINT in [s.collective for s in p.steps]
    assert p.steps[0].collective == "reduce-scatter" and p.steps[-1].collective == POINT_TO_POINT
    only_collectives = search(p.meta, (split(0), split(1)), point_to_point=False)
    assert p.bytes_sent < sum(s.bytes_sent for s in only_collectives)
    to_partial = plan((split(0), broadcast), (partial_sum, split(0)), shape=BIG, placement=GRID)
    assert POINT_TO_POINT not in [s.collective for s in to_partial.steps]


def test_local_changes_stay_local_slices():
    """B -> S needs no message: local slices (views), not a point-to-point step that copies pieces."""
    p = plan((broadcast, broadcast), (split(0), split(1)), shape=BIG, placement=GRID)
    assert [s.collective for s in p.steps] == ["local slice", "local slice"]
