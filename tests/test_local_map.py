"""``local_map`` regions against one process: random layouts (hypothesis: world sizes 2-4, lines in random rank
order and 2x2 grids, uneven and empty 2-D shapes, split or broadcast inputs), a pointwise region and a partial-sum
region, values and gradients; a region with a broadcast parameter; and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch.sbp import broadcast, partial_sum, split

from world import run_on_world

pytestmark = pytest.mark.gloo


def _local_map_job():
    p = st.placement("cpu", [0, 1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, generator=gen), torch.randn(3, 4, generator=gen)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    (ref_x @ ref_w).tanh().sum().backward()

    gx = st.to_global(x, p, broadcast).to_global(sbp=split(0)).detach().requires_grad_()
    gw = st.to_global(w, p, broadcast).detach().requires_grad_()
    # rows of x are uneven (2, 2, 2, 1): without out_shapes the ranks agree on them
    rows = st.local_map(lambda a, b: (a @ b).tanh(), (split(0), broadcast), split(0))
    out = rows(gx, gw)
    total = st.local_map(lambda a: a.sum(), (split(0),), partial_sum, out_shapes=lambda a: [()])(out)
    total.backward()
    errors = [
        (st.full_tensor(out) - (x @ w).tanh()).abs().max().item(),
        (st.full_tensor(gx.grad) - ref_x.grad).abs().max().item(),
        (st.full_tensor(gw.grad) - ref_w.grad).abs().max().item(),
        abs(total.full_tensor().item() - (x @ w).tanh().sum().item()),
    ]
    refusals = []
    for call in (
        lambda: st.local_map(lambda a: a * 2, (split(0),), broadcast)(gx),  # a broadcast output of per-rank work
        lambda: st.local_map(lambda a: a * 2, (partial_sum,), partial_sum)(gw.to_global(sbp=partial_sum)),
        lambda: st.local_map(lambda a: a, (split(0),), split(0), out_shapes=lambda a: [(7, 4)])(gx),
    ):
        try:
            call()
            refusals.append(None)
        except ValueError as err:
            refusals.append(str(err))
    return max(errors), out.sbp, total.sbp, gw.grad.sbp, refusals


def _outside_job():
    """A region on a placement that leaves rank 2 out, indexing its parts' second dim: the rank outside holds no
    part and must neither raise nor leave the others waiting; values and gradients against one process."""
    p = st.placement("cpu", [0, 1])
    x = torch.arange(28.0).reshape(7, 4)
    ref = x.clone().requires_grad_()
    (ref[:, 1:3] * 2).square().sum().backward()
    gx = x.to_global(p, broadcast).to_global(sbp=split(0)).requires_grad_()
    for shapes in (None, lambda a: [(7, 2)]):
        cols = st.local_map(lambda a: a[:, 1:3] * 2, (split(0),), split(0), out_shapes=shapes)(gx)
        cols.square().sum().backward()
        full, inside = cols.full_tensor(), torch.distributed.get_rank() in (0, 1)  # (empty outside the placement)
        assert torch.equal(full, x[:, 1:3] * 2) if inside else full.numel() == 0
    grad = gx.grad.full_tensor()
    if torch.distributed.get_rank() in (0, 1):
        torch.testing.assert_close(grad, 2 * ref.grad)  # (two regions' gradients)


def test_a_rank_outside_the_placement_runs_a_region_alike():
    run_on_world(3, _outside_job)


def test_local_map_against_one_process():
    for error, out_sbp, total_sbp, grad_sbp, refusals in run_on_world(4, _local_map_job):
        assert error < 1e-5, error
        assert out_sbp == (split(0),) and total_sbp == (partial_sum,)
        assert grad_sbp == (partial_sum,)  # each rank's share; Module.to_global would reduce it
        assert "declare it split" in refusals[0]
        assert "no gradient with respect to the sum" in refusals[1]
        assert "has a part of shape" in refusals[2]


@st_.composite
def region_cases(draw):
    world = draw(st_.sampled_from([2, 3, 4]))
    if world == 4 and draw(st_.booleans()):
        ranks = draw(st_.sampled_from([[[0, 1], [2, 3]], [[3, 1], [0, 2]]]))
    else:
        ranks = draw(st_.permutations(list(range(world))))
    axes = 2 if isinstance(ranks[0], list) else 1
    shape = tuple(draw(st_.lists(st_.integers(0, 7), min_size=2, max_size=2)))
    sbp = tuple(draw(st_.sampled_from([split(0), split(1), broadcast])) for _ in range(axes))
    return world, ranks, shape, sbp, draw(st_.booleans()), draw(st_.integers(0, 2**16))


def _region_job(ranks, shape, sbp, shapes_given, seed):
    p = st.placement("cpu", ranks)
    gen = torch.Generator().manual_seed(seed)
    x, upstream = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen)
    ref = x.clone().requires_grad_()
    want = ref.sin() * 2 + ref
    ((want * upstream).sum() + ref.square().sum()).backward()

    everywhere = (broadcast,) * p.ndim
    gx = st.to_global(x, p, everywhere).to_global(sbp=sbp).detach().requires_grad_()
    shapes = (lambda a: [tuple(a.shape)]) if shapes_given else None
    out = st.local_map(lambda a: a.sin() * 2 + a, (sbp,), sbp, out_shapes=shapes)(gx)
    # each rank's sum of its part: a share of the total along the axes where the rows or columns are split
    total_sbp = tuple(partial_sum if s != broadcast else broadcast for s in sbp)
    total = st.local_map(lambda a: a.square().sum(), (sbp,), total_sbp)(gx)
    ((out * st.to_global(upstream.double(), p, everywhere)).sum() + total).backward()
    errors = [
        _largest_difference(st.full_tensor(out), want.detach()),
        abs(st.full_tensor(total).item() - x.square().sum().item()),
        _largest_difference(st.full_tensor(gx.grad), ref.grad),
    ]
    return max(errors), gx.grad.sbp


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


@settings(max_examples=40)
@given(region_cases())
def test_local_map_property(case):
    world, ranks, shape, sbp, shapes_given, seed = case
    for error, grad_sbp in run_on_world(world, _region_job, ranks, shape, sbp, shapes_given, seed):
        assert error < 1e-9, (case, error)
        assert grad_sbp == sbp  # a split input's gradient is split alike; a broadcast one's whole
