"""Embedding lookups on global tensors against plain torch: data-parallel indices, tables split on the
features, and vocabulary-parallel tables (rows split over ranks) whose lookups and gradients stay local."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from strict_check import check_cases
from world import run_on_world

pytestmark = pytest.mark.gloo

GEN = torch.Generator().manual_seed(0)
TABLE = torch.randn(11, 4, generator=GEN, dtype=torch.float64)
SMALL_TABLE = torch.randn(5, 3, generator=GEN, dtype=torch.float64)
IDS = torch.randint(0, 11, (3, 5), generator=GEN)
SMALL_IDS = torch.randint(0, 5, (7,), generator=GEN)


def _embed(**options):
    return lambda w, i: F.embedding(i, w, **options)


# (function, inputs, input sbps, output sbp, [gradient sbp of the table]) on a 1-D placement
CASES_1D = [
    (_embed(), [TABLE, IDS], [B, S(0)], S(0), [P]),
    (_embed(), [TABLE, IDS], [B, S(1)], S(1), [P]),
    (_embed(padding_idx=2), [TABLE, IDS], [S(1), B], S(2), [S(1)]),
    (_embed(), [TABLE, IDS], [S(0), B], P, [S(0)]),
    (_embed(padding_idx=3), [TABLE, IDS], [S(0), B], P, [S(0)]),
    (_embed(scale_grad_by_freq=True), [TABLE, IDS], [S(0), B], P, [S(0)]),
    (_embed(scale_grad_by_freq=True), [TABLE, IDS], [B, S(0)], S(0), [S(1)]),  # global frequencies: no P
    (_embed(padding_idx=4), [SMALL_TABLE, SMALL_IDS], [S(0), B], P, [S(0)]),
    (_embed(), [SMALL_TABLE, SMALL_IDS], [P, B], P, [S(0)]),
]

CASES_2D = [
    (_embed(), [TABLE, IDS], [(S(0), S(1)), (B, B)], (P, S(2)), [(S(0), S(1))]),
    (_embed(), [TABLE, IDS], [(B, S(0)), (S(0), B)], (S(0), P), [(P, S(0))]),
    (_embed(padding_idx=1), [TABLE, IDS], [(S(0), S(0)), (B, B)], (P, P), [(S(0), S(0))]),
    (_embed(), [TABLE, IDS], [(B, B), (S(0), S(1))], (S(0), S(1)), [(P, P)]),
]


def embedding_1d(n):
    check_cases(CASES_1D, st.placement("cpu", list(range(n))), "1-D")


def embedding_2d():
    check_cases(CASES_2D, st.placement("cpu", [[0, 1], [2, 3]]), "2-D")


def test_embedding_1d():
    run_on_world(2, embedding_1d, 2)
    run_on_world(3, embedding_1d, 3)


def test_embedding_2x2():
    run_on_world(4, embedding_2d)
