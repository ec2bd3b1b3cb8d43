"""Boxing between every pair of layouts, forward and backward, against the single-process reference.

Each case builds random local parts on every rank, makes them global with ``to_global``, boxes to the target
layout and differentiates ``sum(full_tensor * W)``. The driver rebuilds the logical tensor from the parts (and
from the boxed parts) with ``reference.assemble`` and gets the reference gradients of the parts by autograd.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._layout import GlobalMeta, normalize_sbp
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split

from reference import assemble, random_parts
from world import run_on_world

SIMPLE = [broadcast, partial_sum, partial_max, partial_min]


def _case(ranks, shape, src, dst, dtype, seed):
    p = st.placement("cpu", ranks)
    meta = GlobalMeta(tuple(shape), dtype, p, normalize_sbp(src, p, len(shape), dtype))
    parts = random_parts(meta, torch.Generator().manual_seed(seed))
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    weight = weight.to(dtype) if dtype.is_floating_point else None
    return p, meta, parts, weight


def box_on_ranks(ranks, shape, src, dst, dtype, seed, backward=True):
    """Body run on every rank: returns (boxed local part, full tensor, gradient of this rank's part)."""
    p, meta, parts, weight = _case(ranks, shape, src, dst, dtype, seed)
    coord = p.coord_of(dist.get_rank())
    x = parts[coord].clone() if coord is not None else torch.empty(0, dtype=dtype)
    x.requires_grad_(backward)
    g = x.to_global(p, src)
    h = g.to_global(sbp=dst)
    assert h.sbp == normalize_sbp(dst, p, len(shape), dtype) and tuple(h.shape) == tuple(shape)
    full = h.full_tensor()
    if backward and coord is not None:  # outside the placement, full_tensor is empty
        (full * weight).sum().backward()
    return h.to_local().detach(), full.detach(), x.grad


def check_boxing(world, ranks, shape, src, dst, dtype=torch.float64, seed=0, backward=True):
    results = run_on_world(world, box_on_ranks, ranks, shape, src, dst, dtype, seed, backward)
    p, meta, parts, weight = _case(ranks, shape, src, dst, dtype, seed)
    leaves = {c: t.clone().requires_grad_(backward) for c, t in parts.items()}
    logical = assemble(leaves, p.shape, meta.sbp)
    dst_sbp = normalize_sbp(dst, p, len(shape), dtype)
    boxed = {p.coord_of(r): results[r][0] for r in p.flat_ranks}
    torch.testing.assert_close(assemble(boxed, p.shape, dst_sbp), logical.detach(), msg=f"{src}->{dst} value")
    for r in p.flat_ranks:
        torch.testing.assert_close(results[r][1], logical.detach(), msg=f"{src}->{dst} full_tensor on rank {r}")
    if backward:
        (logical * weight).sum().backward()
        for r in p.flat_ranks:
            got, want = results[r][2], leaves[p.coord_of(r)].grad
            torch.testing.assert_close(got, want, msg=f"{src}->{dst} gradient on rank {r}")


ONE_D = [split(0), split(1), *SIMPLE]


@pytest.mark.gloo
@pytest.mark.parametrize("src", ONE_D, ids=repr)
def test_every_1d_pair_on_three_ranks_uneven(src):
    for dst in ONE_D:
        check_boxing(3, [0, 1, 2], (7, 5), src, dst)


@pytest.mark.gloo
def test_every_2d_pair_on_2x2_mesh_uneven():
    layouts = list(itertools.product([split(0), split(1), broadcast, partial_sum, partial_max], repeat=2))
    for i, src in enumerate(layouts):
        for dst in layouts:
            check_boxing(4, [[0, 1], [2, 3]], (5, 3), src, dst, seed=i)


def _sbp_strategy(ndim):
    splits = [split(d) for d in range(ndim)]
    return st_.sampled_from(splits + SIMPLE)


@st_.composite
def boxing_cases(draw):
    """A move between two different layouts on 2 to 4 ranks (a line, a grid or a 1 x 4 grid, of a world of up to
    4), of a tensor whose sizes are mostly not multiples of the axes' sizes (an empty one now and then)."""
    world = draw(st_.sampled_from([3, 4, 2]))
    mesh = world == 4 and draw(st_.booleans())
    if mesh:
        ranks = draw(st_.sampled_from([[[0, 1], [2, 3]], [[3, 1], [0, 2]], [[0, 1, 2, 3]]]))
    else:
        n = draw(st_.sampled_from(range(world, 1, -1)))
        ranks = draw(st_.permutations(list(range(world))))[:n]
    ndim = draw(st_.integers(0, 3))
    size = st_.one_of(st_.sampled_from([3, 5, 7, 1, 2, 6]), st_.integers(0, 9))
    shape = tuple(draw(st_.lists(size, min_size=ndim, max_size=ndim)))
    axes = 2 if isinstance(ranks[0], list) else 1
    src = tuple(draw(_sbp_strategy(ndim)) for _ in range(axes))
    dst = draw(st_.tuples(*[_sbp_strategy(ndim)] * axes).filter(lambda d: d != src))
    dtype = draw(st_.sampled_from([torch.float64, torch.float32]))
    return world, ranks, shape, src, dst, dtype, draw(st_.integers(0, 2**16))


@pytest.mark.gloo
@settings(max_examples=250)
@given(boxing_cases())
def test_boxing_property(case):
    world, ranks, shape, src, dst, dtype, seed = case
    check_boxing(world, ranks, shape, src, dst, dtype, seed)


@pytest.mark.gloo
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.bool], ids=str)
def test_integer_and_bool_layouts(dtype):
    """int16 is one of the dtypes gloo cannot carry: it travels widened."""
    sbps = [split(0), broadcast, partial_max, partial_min] + ([partial_sum] if dtype != torch.bool else [])
    for src, dst in itertools.product(sbps, repeat=2):
        check_boxing(3, [0, 1, 2], (5, 2), src, dst, dtype=dtype, backward=False)


@pytest.mark.gloo
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_layouts_gloo_lacks(dtype):
    """torch's barebones unsigned types move between layouts (they have no arithmetic to reduce with)."""
    for src, dst in itertools.product([split(0), split(1), broadcast], repeat=2):
        check_boxing(3, [0, 1, 2], (5, 2), src, dst, dtype=dtype, backward=False)


@pytest.mark.gloo
def test_rank_order_of_placement_need_not_be_sorted():
    check_boxing(4, [[3, 1], [0, 2]], (5, 7), (split(0), split(1)), (split(1), split(0)))
    check_boxing(3, [2, 0, 1], (7, 4), split(0), split(1))
    check_boxing(3, [2, 0, 1], (7, 4), partial_sum, split(0))  # reduce-scatter of uneven parts
    check_boxing(4, [[3, 1], [0, 2]], (5, 7), (partial_max, partial_sum), (split(1), split(0)))
