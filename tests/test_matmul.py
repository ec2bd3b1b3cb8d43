"""Matrix products: every signature of the matmul rule runs without the fallback and gives plain torch's
values and gradients; the cheapest signature is the one chosen."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import strict
from world import run_on_world

pytestmark = pytest.mark.gloo

_gen = torch.Generator().manual_seed(0)  # the same values on every rank


def _randn(*shape):
    return torch.randn(shape, generator=_gen)


A, W, BIAS = _randn(7, 5), _randn(5, 6), _randn(6)
BATCH_A, BATCH_B = _randn(3, 7, 5), _randn(3, 5, 4)

# (function, inputs, input sbps, expected output sbp)
CASES = [
    (torch.mm, [A, W], [S(0), B], S(0)),
    (torch.mm, [A, W], [B, S(1)], S(1)),
    (torch.mm, [A, W], [S(1), S(0)], P),
    (torch.mm, [A, W], [P, B], P),
    (torch.mm, [A, W], [B, P], P),
    (torch.addmm, [BIAS, A, W], [B, S(0), B], S(0)),
    (torch.addmm, [BIAS, A, W], [S(0), B, S(1)], S(1)),
    (torch.addmm, [BIAS, A, W], [B, S(1), S(0)], P),  # row-parallel linear: the bias joins the partial sum
    (lambda x, w, b: F.linear(x, w.t(), b), [A, W, BIAS], [S(1), S(0), B], P),
    (torch.bmm, [BATCH_A, BATCH_B], [S(0), S(0)], S(0)),
    (torch.bmm, [BATCH_A, BATCH_B], [S(2), S(1)], P),
    (torch.baddbmm, [_randn(3, 7, 4), BATCH_A, BATCH_B], [S(1), S(1), B], S(1)),
]


def _run_cases(ranks):
    p = st.placement("cpu", ranks)
    got = []
    for fn, inputs, sbps, expect in CASES:
        if p.ndim == 2:
            sbps = [(s, B) for s in sbps]
            expect = (expect, B)
        got.append(strict(check_op)(fn, inputs, p, sbps, expect_sbp=expect if isinstance(expect, tuple) else (expect,)))
    return len(got)


def test_matmul_signatures_1d():
    for n in (2, 3):
        run_on_world(n, _run_cases, list(range(n)))


def test_matmul_signatures_on_mesh_axis_0():
    run_on_world(4, _run_cases, [[0, 1], [2, 3]])
