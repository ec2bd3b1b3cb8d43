"""Boxing across placements, forward and backward, against the single-process reference.

Each multi-rank case builds random local parts on the ranks of the source placement, makes them global, moves
them to another placement and SBP with ``to_global(q, sbp)`` and differentiates ``sum(full_tensor * W)`` on
every rank (ranks outside the target hold an empty full tensor but still run backward: the gradient crosses
back through them). The driver rebuilds the logical tensor from the source parts and from the moved parts with
``reference.assemble`` and gets the reference gradients of the source parts by autograd.

The plan tests need no process group: they check which rank sends which box and the bytes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._boxing.cross_placement import cross_target, plan_cross
from sbp_torch._layout import GlobalMeta, Partial, normalize_sbp
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split

from reference import assemble, coords, random_parts
from world import run_on_world

SIMPLE = [broadcast, partial_sum, partial_max, partial_min]


def _meta(ranks, shape, sbp, dtype=torch.float64) -> GlobalMeta:
    p = st.placement("cpu", ranks)
    return GlobalMeta(tuple(shape), dtype, p, normalize_sbp(sbp, p, len(shape), dtype))


def _case(src_ranks, dst_ranks, shape, src, dst, dtype, seed):
    meta, target = _meta(src_ranks, shape, src, dtype), _meta(dst_ranks, shape, dst, dtype)
    parts = random_parts(meta, torch.Generator().manual_seed(seed))
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    weight = weight.to(dtype) if dtype.is_floating_point else None
    return meta, target, parts, weight


def cross_on_ranks(src_ranks, dst_ranks, shape, src, dst, dtype, seed, backward):
    """Body run on every rank: returns (moved local part, full tensor, gradient of this rank's source part)."""
    meta, target, parts, weight = _case(src_ranks, dst_ranks, shape, src, dst, dtype, seed)
    rank = dist.get_rank()
    coord = meta.placement.coord_of(rank)
    x = parts[coord].clone() if coord is not None else torch.empty(0, dtype=dtype)
    x.requires_grad_(backward)
    h = x.to_global(meta.placement, src).to_global(target.placement, dst)
    assert h.placement == target.placement and h.sbp == target.sbp and tuple(h.shape) == tuple(shape)
    full = h.full_tensor()
    if backward:  # every rank: the gradient crosses back through the ranks of both placements
        inside = target.placement.coord_of(rank) is not None
        (full * (weight if inside else 1.0)).sum().backward()
    return h.to_local().detach(), full.detach(), x.grad


def check_cross(world, src_ranks, dst_ranks, shape, src, dst, dtype=torch.float64, seed=0, backward=True):
    results = run_on_world(world, cross_on_ranks, src_ranks, dst_ranks, shape, src, dst, dtype, seed, backward)
    meta, target, parts, weight = _case(src_ranks, dst_ranks, shape, src, dst, dtype, seed)
    p, q = meta.placement, target.placement
    what = f"{p.ranks} {src} -> {q.ranks} {dst} {tuple(shape)}"
    leaves = {c: t.clone().requires_grad_(backward) for c, t in parts.items()}
    logical = assemble(leaves, p.shape, meta.sbp)
    moved = {q.coord_of(r): results[r][0] for r in q.flat_ranks}
    torch.testing.assert_close(assemble(moved, q.shape, target.sbp), logical.detach(), msg=f"{what}: value")
    for r in range(world):
        if r in q:
            torch.testing.assert_close(results[r][1], logical.detach(), msg=f"{what}: full_tensor on rank {r}")
        else:
            assert results[r][0].numel() == 0 and results[r][1].numel() == 0, f"{what}: rank {r} is outside"
    if backward:
        (logical * weight).sum().backward()
        for r in range(world):
            got = results[r][2]
            if r in p:
                torch.testing.assert_close(got, leaves[p.coord_of(r)].grad, msg=f"{what}: gradient on rank {r}")
            else:
                assert got.numel() == 0, f"{what}: rank {r} is outside the source"


# ---------------------------------------------------------------------------------------------------------
# Plans: who sends which box, and the bytes (no process group)

N = 7 * 5 * 4  # bytes of a (7, 5) float32 tensor


def plan(src_ranks, src, dst_ranks, dst, shape=(7, 5)):
    return plan_cross(_meta(src_ranks, shape, src, torch.float32), _meta(dst_ranks, shape, dst, torch.float32))


@pytest.mark.parametrize(
    "src_ranks, src, dst_ranks, dst, bytes_sent",
    [
        ([0, 1], split(0), [2, 3], split(0), N),  # a pipeline hand-over: every element once
        ([0, 1], split(0), [2, 3], split(1), N),
        ([0, 1], broadcast, [2, 3], split(0), N),  # the holders of a copy take turns
        ([0, 1], split(0), [0, 1, 2, 3], broadcast, 3 * N),  # ranks 0, 1 miss half each; 2, 3 miss all
        ([0, 1, 2, 3], broadcast, [1, 2], split(1), 0),  # nested: local slices only
        ([1, 2], split(0), [0, 1, 2, 3], split(0), 3 * 5 * 4),  # rows 0-1 and 6 leave their holder
        ([0, 1], split(0), [2, 3], partial_sum, N),  # the value goes to coordinate 0 only
        ([0, 1], partial_sum, [2, 3], split(0), N + N),  # reduce-scatter ((p-1) N in all), then N
        ([0, 1, 2], partial_max, [3], broadcast, 2 * N + N),
        ([0, 1, 2, 3], partial_sum, [3, 2, 1, 0], split(0), 3 * N),  # terms travel: each rank has its own
        ([0, 1], partial_min, [1, 0], partial_min, N),  # rank 1 combines rank 0's term with its own
    ],
)
def test_plan_bytes(src_ranks, src, dst_ranks, dst, bytes_sent):
    assert plan(src_ranks, src, dst_ranks, dst).bytes_sent == bytes_sent


def test_plan_of_a_pipeline_hand_over():
    """Rank i of the first stage sends its rows to rank i of the next; nobody else takes part."""
    pieces = plan([0, 1], split(0), [2, 3], split(0)).pieces
    assert [(p.src, p.dst, p.starts, p.lengths) for p in pieces] == [(0, 2, (0, 0), (4, 5)), (1, 3, (4, 0), (3, 5))]


def test_partial_source_is_reduced_inside_the_source_first():
    """P -> B across: a reduce-scatter on the source (half a copy each) beats sending both partial copies."""
    x = plan([0, 1], partial_sum, [2, 3], broadcast)
    assert [s.collective for s in x.reduce.steps] == ["reduce-scatter"]
    assert x.bytes_sent == N + 2 * N < 2 * 2 * N


def test_overlapping_partial_source_may_keep_its_terms():
    """When the destination ranks hold partial terms themselves, sending the other terms and combining them
    where they arrive beats reducing first (3N here, against 3N for the reduce-scatter alone)."""
    x = plan([0, 1, 2, 3], partial_sum, [3, 2, 1, 0], split(0))
    assert x.combine == "sum" and not x.reduce.steps
    assert {(p.src, p.dst) for p in x.pieces if p.is_local} == {(r, r) for r in range(4)}


def test_plan_str():
    text = str(plan([0, 1], partial_sum, [2], split(1), shape=(2, 2)))
    assert text.splitlines() == [
        "[0, 1] (P) -> [2] (S(1)) for (2, 2) torch.float32: 32 B sent",
        "  reduce on [0, 1] (P) -> (S(0))",
        "    axis 0: P -> S(0) by reduce-scatter (16 B sent)",
        "  rank 0 -> rank 2: [0:1, 0:2] by send (8 B sent)",
        "  rank 1 -> rank 2: [1:2, 0:2] by send (8 B sent)",
    ]


@pytest.mark.parametrize(
    "target, sbp, error, words",
    [
        (("cuda", [2, 3]), split(0), ValueError, ["device types differ", "'cpu'", "'cuda'"]),
        (("cpu", [[2, 3]]), None, ValueError, ["1 entries", "2 axes", "ranks=[0, 1]", "ranks=[[2, 3]]"]),
        (("cpu", [2, 3]), split(2), ValueError, ["split dim 2", "ranks=[2, 3]"]),
        (("cpu", [2, 3]), partial_max, TypeError, ["partial_max", "complex"]),
        (None, split(0), TypeError, ["sbp_torch.placement", "list"]),
    ],
)
def test_bad_targets_raise_before_any_data_moves(target, sbp, error, words):
    """The target is checked from the arguments alone, so every rank raises alike (see test_conversions)."""
    src = _meta([0, 1], (4, 3), split(0), torch.complex64)
    with pytest.raises(error) as info:
        cross_target(src, st.placement(*target) if target else [2, 3], sbp)
    assert all(word in str(info.value) for word in words), str(info.value)


def _placements(world: int):
    """1-D subsets in any order, and 2-D arrays (2x2, 1xk, kx1) of them."""
    return st_.permutations(list(range(world))).flatmap(
        lambda perm: st_.integers(1, world).flatmap(lambda n: st_.sampled_from(_arrays(perm[:n])))
    )


def _arrays(ranks: list[int]) -> list:
    out = [ranks, [ranks], [[r] for r in ranks]]
    if len(ranks) == 4:
        out.append([ranks[:2], ranks[2:]])
    return out


def _ndim(ranks) -> int:
    return 2 if isinstance(ranks[0], list) else 1


def _sbps(ranks, ndim: int):
    return st_.tuples(*[st_.sampled_from([split(d) for d in range(ndim)] + SIMPLE)] * _ndim(ranks))


@st_.composite
def cross_cases(draw, worlds=(2, 3, 4)):
    world = draw(st_.sampled_from(worlds))
    src_ranks, dst_ranks = draw(_placements(world)), draw(_placements(world))
    ndim = draw(st_.integers(0, 3))
    shape = tuple(draw(st_.lists(st_.integers(0, 7), min_size=ndim, max_size=ndim)))
    src, dst = draw(_sbps(src_ranks, ndim)), draw(_sbps(dst_ranks, ndim))
    return world, src_ranks, dst_ranks, shape, src, dst, draw(st_.integers(0, 2**16))


@settings(max_examples=300)
@given(cross_cases(worlds=(4, 6)))
def test_plan_covers_every_receiving_part_once(case):
    """The pieces of every receiving part tile its box (once per partial term when terms travel); senders hold
    what they send; only ranks of the two placements appear."""
    _, src_ranks, dst_ranks, shape, src, dst, _ = case
    x = plan_cross(_meta(src_ranks, shape, src), _meta(dst_ranks, shape, dst))
    held = x.src.with_sbp(x.reduce.dst_sbp)
    terms = math.prod(n for n, s in zip(held.placement.shape, held.sbp) if isinstance(s, Partial))
    for c in coords(x.dst.placement.shape):
        rank = x.dst.placement.rank_at(c)
        mine = [p for p in x.pieces if p.dst == rank]
        starts, lengths = x.dst.region(c)
        receives = all(c[a] == 0 for a, s in enumerate(x.dst.sbp) if isinstance(s, Partial))
        assert sum(p.numel for p in mine) == (math.prod(lengths) * terms if receives else 0)
        for p in mine:
            assert all(s <= a and a + n <= s + m for s, m, a, n in zip(starts, lengths, p.starts, p.lengths))
            s_starts, s_lengths = held.region(held.placement.coord_of(p.src))
            assert all(s <= a and a + n <= s + m for s, m, a, n in zip(s_starts, s_lengths, p.starts, p.lengths))


# ---------------------------------------------------------------------------------------------------------
# Fixed cases on real worlds

ONE_D = [split(0), split(1), *SIMPLE]


@pytest.mark.gloo
@pytest.mark.parametrize("src", ONE_D, ids=repr)
def test_disjoint_1d_pipeline_every_pair(src):
    """A stage hand-over: [0, 1] -> [3, 2] (reversed order), rows uneven, every pair of layouts."""
    for dst in ONE_D:
        check_cross(4, [0, 1], [3, 2], (7, 5), src, dst)


@pytest.mark.gloo
def test_overlapping_and_nested_placements():
    check_cross(4, [0, 1, 2], [1, 2, 3], (7, 5), split(0), split(1))
    check_cross(4, [2, 0, 1], [1, 3, 2], (5, 3), partial_sum, split(0))
    check_cross(4, [0, 1, 2, 3], [2, 1], (7, 5), broadcast, split(0))  # nested: local copies only
    check_cross(4, [2, 1], [0, 1, 2, 3], (7, 5), split(1), split(0))
    check_cross(4, [3, 1], [0, 1, 2, 3], (7, 5), partial_min, partial_max)
    check_cross(4, [0, 1, 2, 3], [3, 2, 1, 0], (7, 5), partial_sum, split(0))  # terms combine where they land
    check_cross(4, [[0, 1], [2, 3]], [1, 3], (7, 5), (partial_max, broadcast), split(1))


@pytest.mark.gloo
def test_between_2d_and_1d():
    mesh, other = [[0, 1], [2, 3]], [[3, 1], [0, 2]]
    check_cross(4, mesh, [3, 1], (7, 5), (split(0), split(1)), split(0))
    check_cross(4, mesh, [2, 0], (5, 7), (split(0), split(0)), split(1))  # nested splits of one dim
    check_cross(4, mesh, [0, 2], (5, 3), (partial_sum, split(0)), broadcast)
    check_cross(4, [1, 2, 0], mesh, (7, 5), split(0), (split(1), split(0)))
    check_cross(4, mesh, other, (5, 7), (split(1), partial_sum), (partial_max, split(0)))
    check_cross(4, [0, 3], other, (6, 5), partial_max, (partial_sum, partial_min))  # partial target axes nest


@pytest.mark.gloo
def test_partial_sources():
    for src in [partial_sum, partial_max, partial_min]:
        check_cross(3, [0, 1, 2], [2], (7, 5), src, broadcast)
        check_cross(3, [1, 0], [2, 1], (7, 5), src, split(1))
    check_cross(4, [[0, 1], [2, 3]], [3], (5, 3), (partial_sum, partial_max), broadcast)


@pytest.mark.gloo
def test_ranks_in_neither_placement_and_empty_or_scalar_tensors():
    check_cross(4, [0], [3], (5, 3), broadcast, broadcast)  # ranks 1 and 2 take no part
    check_cross(3, [0, 1], [2], (0, 3), split(0), split(1))
    check_cross(3, [0, 1], [1, 2], (), partial_sum, partial_max)


def mismatched_targets_body():
    """Every rank: rank 1 asks for another SBP than the others; check_meta makes all of them raise."""
    p, q = st.placement("cpu", [0, 1]), st.placement("cpu", [2, 1])
    g = torch.ones(4).to_global(p, split(0))
    try:
        g.to_global(q, broadcast if dist.get_rank() == 1 else split(0), check_meta=True)
    except ValueError as err:
        raised = str(err)
    else:
        raised = None
    return raised, g.to_global(q, broadcast).full_tensor()  # still in step


@pytest.mark.gloo
def test_mismatched_targets_raise_on_every_rank_with_check_meta():
    for rank, (raised, after) in enumerate(run_on_world(3, mismatched_targets_body)):
        assert raised is not None and "different metadata" in raised and "rank 1" in raised, (rank, raised)
        if rank in (1, 2):
            torch.testing.assert_close(after, torch.ones(8))


@pytest.mark.gloo
@pytest.mark.parametrize("dtype", [torch.int16, torch.bool, torch.complex64], ids=str)
def test_dtypes_on_the_wire(dtype):
    """Dtypes gloo lacks travel widened or reinterpreted, point to point too."""
    sbps = [split(0), broadcast] + ([partial_max] if not dtype.is_complex else [partial_sum])
    for src, dst in itertools.product(sbps, repeat=2):
        check_cross(3, [0, 1], [2, 1], (5, 2), src, dst, dtype=dtype, backward=False)


@pytest.mark.gloo
@settings(max_examples=200)
@given(cross_cases())
def test_cross_placement_property(case):
    world, src_ranks, dst_ranks, shape, src, dst, seed = case
    check_cross(world, src_ranks, dst_ranks, shape, src, dst, seed=seed)
