"""Reductions on global tensors against plain torch: values, gradients and the output layouts of
``_signatures/reductions.py`` (a split on a kept dim stays, a split on a reduced dim gives a partial)."""

from __future__ import annotations

import pytest
import torch

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max as PMAX
from sbp_torch.sbp import partial_min as PMIN
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import strict
from world import run_on_world

pytestmark = pytest.mark.gloo

X = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
X3 = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

# (function, input, input sbp, output sbp) on a 1-D placement
CASES_1D = [
    (lambda x: x.sum(), X, S(0), P),
    (lambda x: x.sum(1), X, S(0), S(0)),
    (lambda x: x.sum(0), X, S(1), S(0)),
    (lambda x: x.sum(0, keepdim=True), X, S(1), S(1)),
    (lambda x: x.sum((0, 2)), X3, S(2), P),
    (lambda x: x.sum(1), X, P, P),
    (lambda x: x.mean(), X, S(1), P),
    (lambda x: x.mean(0), X, S(0), P),
    (lambda x: x.mean((1, 2), keepdim=True), X3, S(0), S(0)),
    (lambda x: x.mean(1), X, P, P),
    (lambda x: x.amax(1), X, S(1), PMAX),
    (lambda x: x.amax(0), X, S(1), S(0)),
    (lambda x: x.amax(0), X, PMAX, PMAX),
    (lambda x: x.amin((0, 1)), X3, S(1), PMIN),
    (lambda x: x.max(), X, S(0), PMAX),
    (lambda x: x.min(), X, S(1), PMIN),
    (lambda x: x.max(1), X, S(0), S(0)),
    (lambda x: x.min(0, keepdim=True), X, S(1), S(1)),
    (lambda x: x.max(1), X, S(1), S(0)),  # no partial indices: boxed to S(0) first
    (lambda x: x.var(1), X, S(0), S(0)),
    (lambda x: x.std(0, keepdim=True), X, S(1), S(1)),
    (lambda x: torch.var_mean(x, 2, correction=0), X3, S(1), S(1)),
    (lambda x: x.argmax(1), X, S(0), S(0)),
    (lambda x: x.argmin(0), X, S(1), S(0)),
    (lambda x: (x > 0).any(1), X, S(1), PMAX),
    (lambda x: (x > 0).all(0), X, S(0), PMIN),
    (lambda x: (x > 0).all(), X, S(1), PMIN),
    (lambda x: (x > 0).any(), X, S(0), PMAX),
    (lambda x: torch.any(x > 0, dim=()), X, S(0), S(0)),  # an empty list of dims reduces none here (not all)
    (lambda x: torch.all(x > 0, dim=()), X, S(1), S(1)),
    (lambda x: torch.logsumexp(x, 1), X, S(0), S(0)),
    (lambda x: x.cumsum(1), X, S(0), S(0)),
    (lambda x: x.cumsum(1), X, P, P),
    (lambda x: torch.count_nonzero(x > 0, 1), X, S(1), P),
    (lambda x: torch.linalg.vector_norm(x, dim=1), X, S(1), B),
    (lambda x: torch.linalg.vector_norm(x, 1), X3, S(2), B),
    (lambda x: torch.linalg.vector_norm(x, float("inf"), dim=0), X, S(0), B),
    (lambda x: torch.linalg.vector_norm(x, 3, dim=(0, 2), keepdim=True), X3, S(0), B),
    (lambda x: torch.linalg.vector_norm(x, 2, dim=0), X, S(1), S(0)),
]

CASES_2D = [
    (lambda x: x.sum(1), X, (S(0), S(1)), (S(0), P)),
    (lambda x: x.sum(), X, (S(1), S(1)), (P, P)),
    (lambda x: x.mean(), X, (S(0), S(1)), (P, P)),
    (lambda x: x.mean(0), X3, (S(0), S(2)), (P, S(1))),
    (lambda x: x.amax(0), X, (S(0), S(0)), (PMAX, PMAX)),
    (lambda x: x.amin(1), X, (S(1), B), (PMIN, B)),
    (lambda x: x.max(0), X, (S(1), S(1)), (S(0), S(0))),
    (lambda x: torch.linalg.vector_norm(x, dim=1), X, (S(0), S(1)), (S(0), B)),
    (lambda x: torch.linalg.vector_norm(x), X, (S(0), S(1)), (B, B)),
]


def _check(fn, x, p, sbp, expect, name):
    expect = expect if isinstance(expect, tuple) else (expect,)
    try:
        check_op(strict(fn), [x], p, [sbp], expect_sbp=expect)
    except Exception as err:
        raise AssertionError(f"{name}: {err}") from err


def reductions_1d(n):
    p = st.placement("cpu", list(range(n)))
    # The backward of prod makes a plain tensor (aten.ones) that is not the reductions' business.
    check_op(strict(lambda x: x.prod(1)), [X], p, [S(0)], backward=False, expect_sbp=(S(0),))
    for i, (fn, x, sbp, expect) in enumerate(CASES_1D):
        _check(fn, x, p, sbp, expect, f"1-D case {i}")
    # Max needs a non-empty part on every rank: 2 rows on 3 ranks are boxed first, not reduced empty.
    check_op(lambda x: x.amax(0), [X[:2]], p, [S(0)])


def reductions_2d():
    p = st.placement("cpu", [[0, 1], [2, 3]])
    for i, (fn, x, sbp, expect) in enumerate(CASES_2D):
        _check(fn, x, p, sbp, expect, f"2-D case {i}")


def test_reductions_1d():
    run_on_world(2, reductions_1d, 2)
    run_on_world(3, reductions_1d, 3)


def test_reductions_2x2():
    run_on_world(4, reductions_2d)
