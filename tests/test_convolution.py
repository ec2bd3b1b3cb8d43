"""Convolutions on global tensors against plain torch: batch, output-channel and input-channel splits
(plain and transposed), forward and backward without the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import check_cases
from world import run_on_world

pytestmark = pytest.mark.gloo

GEN = torch.Generator().manual_seed(0)
IMAGES = torch.randn(5, 4, 6, 6, generator=GEN, dtype=torch.float64)
FILTERS = torch.randn(7, 4, 3, 3, generator=GEN, dtype=torch.float64)
GROUPED = torch.randn(6, 2, 3, 3, generator=GEN, dtype=torch.float64)
BIAS = torch.randn(7, generator=GEN, dtype=torch.float64)
UP = torch.randn(4, 5, 3, 3, generator=GEN, dtype=torch.float64)  # transposed: [in, out, k, k]
SIGNALS = torch.randn(3, 4, 9, generator=GEN, dtype=torch.float64)
FILTERS_1D = torch.randn(5, 4, 3, generator=GEN, dtype=torch.float64)


def conv2d(x, w, b=None):
    return F.conv2d(x, w, b, padding=1)


def strided(x, w, b):
    return F.conv2d(x, w, b, stride=2, dilation=2, padding=2)


def grouped(x, w):
    return F.conv2d(x, w, groups=2)


def transposed(x, w):
    return F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)


def conv1d(x, w):
    return F.conv1d(x, w)


# (function, inputs, input sbps, output sbp, gradient sbps of the inputs) on a 1-D placement
CASES_1D = [
    (conv2d, [IMAGES, FILTERS, BIAS], [S(0), B, B], S(0), [S(0), P, P]),
    (conv2d, [IMAGES, FILTERS, BIAS], [B, S(0), S(0)], S(1), [P, S(0), S(0)]),
    (conv2d, [IMAGES, FILTERS, BIAS], [S(1), S(1), B], P, [S(1), S(1), B]),
    (conv2d, [IMAGES, FILTERS], [S(1), S(1)], P, [S(1), S(1)]),
    (conv2d, [IMAGES, FILTERS], [P, B], P, [B, B]),  # backward: the partial input is all-reduced (see _decision_cost)
    (strided, [IMAGES, FILTERS, BIAS], [S(0), B, B], S(0), [S(0), P, P]),
    (strided, [IMAGES, FILTERS, BIAS], [S(1), S(1), B], P, [S(1), S(1), B]),
    (grouped, [IMAGES, GROUPED], [S(0), B], S(0), [S(0), P]),
    (transposed, [IMAGES, UP], [S(1), S(0)], P, [S(1), S(0)]),
    (transposed, [IMAGES, UP], [B, S(1)], S(1), [P, S(1)]),
    (transposed, [IMAGES, UP], [S(0), B], S(0), [S(0), P]),
    (conv1d, [SIGNALS, FILTERS_1D], [S(0), B], S(0), [S(0), P]),
    (conv1d, [SIGNALS, FILTERS_1D], [B, S(0)], S(1), [P, S(0)]),
]

BIASED = [IMAGES, FILTERS, BIAS]
CASES_2D = [
    (conv2d, BIASED, [(S(0), B), (B, S(0)), (B, S(0))], (S(0), S(1)), [(S(0), P), (P, S(0)), (P, S(0))]),
    (conv2d, BIASED, [(S(0), S(1)), (B, S(1)), (B, B)], (S(0), P), [(S(0), S(1)), (P, S(1)), (P, B)]),
    (conv2d, BIASED, [(S(1), B), (S(1), S(0)), (B, S(0))], (P, S(1)), [(S(1), P), (S(1), S(0)), (B, S(0))]),
    (transposed, [IMAGES, UP], [(S(0), S(1)), (B, S(0))], (S(0), P), [(S(0), S(1)), (P, S(0))]),
]


def convolution_1d(n):
    check_cases(CASES_1D, st.placement("cpu", list(range(n))), "1-D")


def convolution_2d():
    check_cases(CASES_2D, st.placement("cpu", [[0, 1], [2, 3]]), "2-D")


def test_convolution_1d():
    run_on_world(2, convolution_1d, 2)
    run_on_world(3, convolution_1d, 3)


def test_convolution_2x2():
    run_on_world(4, convolution_2d)


def fewer_channels_than_ranks():
    """One input channel, one output channel, one sample on three ranks: every split leaves some rank with
    nothing, so the decision must avoid those splits (an empty channel part once failed on one rank only)."""
    p = st.placement("cpu", [0, 1, 2])
    x, w, b = IMAGES[:1, :1], FILTERS[:1, :1], BIAS[:1]
    for sbps in ([S(1), S(1), B], [B, S(0), S(0)], [S(0), B, B]):
        check_op(conv2d, [x, w, b], p, sbps)


def test_splits_that_leave_a_rank_empty_are_not_chosen():
    run_on_world(3, fewer_channels_than_ranks)
