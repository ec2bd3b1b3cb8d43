"""``_foreach_norm`` on global tensors (what ``clip_grad_norm_`` calls): the single-process norms, with one
all-reduce per group of tensors sharing a placement and split axes, never a gather; and ``clip_grad_norm_``
itself, against plain tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch.sbp import broadcast, partial_sum, split

from strict_check import recording_collectives, strict_recording_moves
from world import run_on_world

pytestmark = pytest.mark.gloo

ORDERS = [2, 1, 3.5, math.inf, -math.inf, 0, -1, -2.5]


def _values(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _norms(ranks, shapes, sbps, order, seed):
    placement = st.placement("cpu", ranks)
    fulls = _values(shapes, seed)
    replicated = (broadcast,) * placement.ndim
    tensors = [f.to_global(placement, replicated).to_global(sbp=sbp) for f, sbp in zip(fulls, sbps)]
    with recording_collectives("all_reduce") as reductions, strict_recording_moves() as moved:
        norms = torch._foreach_norm(tensors, order)  # strict: no op may fall back to gathering
    return [n.full_tensor() for n in norms], [n.sbp for n in norms], moved, reductions


SHAPE = st_.lists(st_.integers(1, 7), min_size=1, max_size=3).map(tuple)
SBP_1D = st_.sampled_from([broadcast, split(0), split(1), split(2), partial_sum])


@settings(max_examples=12, deadline=None)
@given(
    mesh=st_.sampled_from([[0, 1, 2], [[0, 1], [2, 3]]]),
    shapes=st_.lists(SHAPE, min_size=1, max_size=5),
    data=st_.data(),
    order=st_.sampled_from(ORDERS),
    seed=st_.integers(0, 100),
)
def test_foreach_norm_matches_one_process(mesh, shapes, data, order, seed):
    ndim = 2 if isinstance(mesh[0], list) else 1
    sbps = []
    for shape in shapes:  # a split only of a dim the tensor has
        axes = data.draw(st_.tuples(*[SBP_1D] * ndim))
        sbps.append(
            tuple(s if not (s.__class__.__name__ == "Split" and s.dim >= len(shape)) else broadcast for s in axes)
        )
    world = 4 if ndim == 2 else 3
    want = torch._foreach_norm(_values(shapes, seed), order)
    for norms, layouts, moved, reductions in run_on_world(world, _norms, mesh, shapes, sbps, order, seed):
        for got, expected in zip(norms, want):
            torch.testing.assert_close(got, expected)
        assert all(sbp == (broadcast,) * ndim for sbp in layouts)
        assert moved == [], "no gradient is gathered"
        # one all-reduce per split axis of each group of tensors, plus one per partial tensor (reduced first)
        groups = {tuple(a for a, s in enumerate(sbp) if s.__class__.__name__ == "Split") for sbp in sbps}
        partial_axes = sum(s == partial_sum for sbp in sbps for s in sbp)
        assert len(reductions) <= sum(len(axes) for axes in groups) + partial_axes


def _negative_orders_with_an_empty_part() -> list:
    """Norms of negative order (no identity) of a tensor split so that a rank holds no row, foreach and alone."""
    placement = st.placement("cpu", [0, 1, 2])
    x = torch.tensor([[1.0, 2.0, 4.0], [2.0, 2.0, 2.0]]).to_global(placement, broadcast).to_global(sbp=split(0))
    return [(order, torch._foreach_norm([x], order)[0].full_tensor(), torch.linalg.vector_norm(x, order).full_tensor())
            for order in (-1.0, -2.5, -math.inf)]  # fmt: skip


def test_negative_orders_with_an_empty_part():
    x = torch.tensor([[1.0, 2.0, 4.0], [2.0, 2.0, 2.0]])
    for results in run_on_world(3, _negative_orders_with_an_empty_part):
        for order, foreach, alone in results:
            torch.testing.assert_close(foreach, torch.linalg.vector_norm(x, order), msg=f"foreach, order {order}")
            torch.testing.assert_close(alone, torch.linalg.vector_norm(x, order), msg=f"vector_norm, order {order}")


def _clipped(ranks, sbps, shapes, foreach):
    placement = st.placement("cpu", ranks)
    fulls = _values(shapes, 7)
    params = [torch.nn.Parameter(f.to_global(placement, broadcast).to_global(sbp=s)) for f, s in zip(fulls, sbps)]
    for p, f in zip(params, fulls):
        p.grad = (f * 3).to_global(placement, broadcast).to_global(sbp=p.sbp)
    with strict_recording_moves() as moved:
        total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
    return total.full_tensor(), [p.grad.full_tensor() for p in params], moved


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm_matches_one_process(foreach):
    shapes = [(5, 7), (7,), (4, 3), (3,)]
    sbps = [split(0), broadcast, split(1), split(0)]
    plain = [torch.nn.Parameter(f) for f in _values(shapes, 7)]
    for p in plain:
        p.grad = p.detach() * 3
    want = torch.nn.utils.clip_grad_norm_(plain, 1.0, foreach=foreach)
    for total, grads, moved in run_on_world(3, _clipped, [0, 1, 2], sbps, shapes, foreach):
        torch.testing.assert_close(total, want)
        for got, p in zip(grads, plain):
            torch.testing.assert_close(got, p.grad)
        assert moved == []
