"""Random ops on global tensors (``_signatures/random_ops.py``): the logical values do not depend on the
world size, the placement or the SBPs.

After the same seed, every layout on 2 and 3 ranks and on a 2x2 mesh must give the one-rank result, which on
CPU is a formula of torch's draws of the logical shape (``torch.rand``/``torch.randn``): ``reference`` below.
The generator must also end in the same state (the next draw agrees), outputs must keep their layouts
(strict mode: no fallback), and the dropout gradient must be the output gradient times the mask over 1 - p.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch import gradient_sbp
from sbp_torch._layout import Partial
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max, partial_sum
from sbp_torch.sbp import split as S

from op_check import layout
from world import run_on_world

pytestmark = pytest.mark.gloo

SHAPE, P_DROP, SEED = (5, 7), 0.4, 11
X = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
PROBS = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _uniform():
    return torch.rand(SHAPE, dtype=X.dtype)


def _dropped():
    return X * (_uniform() < 1 - P_DROP) / (1 - P_DROP)


# name -> (op on a global input x and global probabilities q, its one-rank value from fresh draws)
OPS = {
    "rand_like": (lambda x, q: torch.rand_like(x), _uniform),
    "randn_like": (lambda x, q: torch.randn_like(x), lambda: torch.randn(SHAPE, dtype=X.dtype)),
    "bernoulli_": (lambda x, q: torch.empty_like(x).bernoulli_(0.3), lambda: (_uniform() < 0.3).to(X.dtype)),
    "bernoulli p": (lambda x, q: torch.bernoulli(x, 0.3), lambda: (_uniform() < 0.3).to(X.dtype)),
    "bernoulli probs": (lambda x, q: torch.bernoulli(q), lambda: (_uniform() < PROBS).to(X.dtype)),
    "normal_": (lambda x, q: x.clone().normal_(2.0, 3.0), lambda: torch.randn(SHAPE, dtype=X.dtype) * 3.0 + 2.0),
    "uniform_": (lambda x, q: x.clone().uniform_(-1.0, 2.0), lambda: _uniform() * 3.0 - 1.0),
    "dropout": (lambda x, q: F.dropout(x, P_DROP), _dropped),
    "native_dropout": (lambda x, q: torch.native_dropout(x, P_DROP, True)[0], _dropped),
}
# Ops whose output keeps a partial input's layout (the others make it broadcast).
KEEP_PARTIAL = {"normal_", "uniform_", "dropout", "native_dropout"}


def reference(name):
    """The one-rank value of op ``name`` after the seed, and the generator's next draw."""
    torch.manual_seed(SEED)
    value = OPS[name][1]()
    return value, torch.rand(3)


def _expected_sbp(name, sbp):
    """The output layout, or None where another family decides it (F.dropout's ``mul`` by the mask keeps
    partial sums only)."""
    if name == "dropout" and partial_max in sbp:
        return None
    if name in KEEP_PARTIAL:
        return sbp
    return tuple(B if isinstance(s, Partial) else s for s in sbp)


def layouts(ranks):
    if isinstance(ranks[0], list):
        return [(S(0), S(1)), (S(1), S(1)), (B, S(0)), (partial_sum, S(1)), (S(0), partial_max)]
    return [(S(0),), (S(1),), (B,), (partial_sum,)]


def random_body(ranks):
    p = st.placement("cpu", ranks)
    mismatches = []
    st.set_strict(True)
    try:
        for sbp in layouts(ranks):
            x = layout(X, p, sbp)
            q = layout(PROBS, p, _expected_sbp("bernoulli p", sbp))  # probabilities are never partial
            for name, (op, _) in OPS.items():
                want, want_next = reference(name)
                torch.manual_seed(SEED)
                out = op(x, q)
                got_next = torch.rand(3)
                if _expected_sbp(name, sbp) not in (None, out.sbp):
                    mismatches.append((name, sbp, "layout", out.sbp))
                if not torch.allclose(out.full_tensor(), want, atol=1e-6) or not torch.equal(got_next, want_next):
                    mismatches.append((name, sbp, "value"))
    finally:
        st.set_strict(False)
    return mismatches


def dropout_backward_body(ranks):
    p = st.placement("cpu", ranks)
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    errors = []
    for sbp in layouts(ranks):
        leaf = X.clone().requires_grad_()
        torch.manual_seed(SEED)
        y = F.dropout(layout(leaf, p, sbp), P_DROP)
        torch.autograd.backward(y, layout(weight, p, gradient_sbp(y.sbp)))
        mask = y.full_tensor() != 0  # X has no zeros
        errors.append(float((leaf.grad - weight * mask / (1 - P_DROP)).abs().max()))
    return errors


@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2], [[0, 1], [2, 3]]], ids=["2", "3", "2x2"])
def test_random_values_do_not_depend_on_layout(ranks):
    world = 4 if isinstance(ranks[0], list) else len(ranks)
    assert run_on_world(world, random_body, ranks) == [[]] * world
    assert all(e < 1e-12 for errors in run_on_world(world, dropout_backward_body, ranks) for e in errors)


def outside_body():
    """A draw with a rule, then draws of ops that take the broadcast fallback (no rule), on placements that leave
    rank 2, then rank 0, out; the next draw of each rank."""
    p = st.placement("cpu", [0, 1])
    torch.manual_seed(SEED)
    torch.rand_like(layout(X, p, (S(0),)))
    draws = [torch.rand(3)]
    for ranks in ([0, 1], [2, 1]):
        torch.manual_seed(SEED)
        x = layout(X, st.placement("cpu", ranks), (S(0),))
        x.exponential_()
        torch.poisson(x.abs())
        draws.append(torch.rand(3))
    return draws


def test_ranks_outside_the_placement_advance_their_generator():
    draws = run_on_world(3, outside_body)
    torch.manual_seed(SEED)
    torch.poisson(torch.zeros_like(X).exponential_().abs())  # (the fallback's draws, as one process makes them)
    want = torch.rand(3)
    for rank_draws in draws:
        assert all(torch.equal(d, e) for d, e in zip(rank_draws, draws[0]))
        assert torch.equal(rank_draws[1], want) and torch.equal(rank_draws[2], want)
