"""Softmax, cross entropy (log-softmax + nll) and mse_loss on global tensors against plain torch, and proof
that cross entropy over logits split on the classes (vocabulary-parallel) never gathers the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op, layout
from strict_check import gradient_layouts, strict_recording_moves
from world import run_on_world

pytestmark = pytest.mark.gloo

GEN = torch.Generator().manual_seed(0)
X = torch.randn(5, 7, generator=GEN, dtype=torch.float64)
LOGITS = {v: torch.randn(6, v, generator=GEN, dtype=torch.float64) * 3 for v in (7, 11)}
TARGET = {v: torch.randint(0, v, (6,), generator=GEN) for v in (7, 11)}
CLASS_WEIGHT = torch.rand(11, generator=GEN, dtype=torch.float64) + 0.5
IMAGE = torch.randn(2, 5, 3, 4, generator=GEN, dtype=torch.float64)
PIXEL_TARGET = torch.randint(0, 5, (2, 3, 4), generator=GEN)
Y = torch.randn(5, 7, generator=GEN, dtype=torch.float64)


def _ce(**options):
    """Cross entropy with ``options``; class weights (optional third input) get no gradient in torch."""
    return lambda x, t, *w: F.cross_entropy(x, t, *[v.detach() for v in w], **options)


def _softmax(dim):
    return lambda x: torch.softmax(x, dim)


def _log_softmax(dim):
    return lambda x: torch.log_softmax(x, dim)


def _mse(**options):
    return lambda x, y: F.mse_loss(x, y, **options)


# (function, inputs, input sbps, output sbp, gradient sbp of the first input) on a 1-D placement
CASES_1D = [
    (_softmax(-1), [X], [S(0)], S(0), S(0)),
    (_softmax(-1), [X], [S(1)], S(1), S(1)),
    (_log_softmax(1), [X], [S(1)], S(1), S(1)),
    (_softmax(0), [X], [S(0)], S(0), S(0)),
    (_log_softmax(0), [X], [S(1)], S(1), S(1)),
    (_ce(), [LOGITS[7], TARGET[7]], [S(1), B], P, S(1)),
    (_ce(reduction="sum"), [LOGITS[11], TARGET[11]], [S(1), B], P, S(1)),
    (_ce(reduction="none"), [LOGITS[11], TARGET[11]], [S(1), B], P, S(1)),
    (_ce(ignore_index=3), [LOGITS[7], TARGET[7].clamp(max=3)], [S(1), B], P, S(1)),
    (_ce(), [LOGITS[11], TARGET[11], CLASS_WEIGHT], [S(1), B, B], P, S(1)),
    (_ce(reduction="sum", ignore_index=0), [LOGITS[11], TARGET[11], CLASS_WEIGHT], [S(1), B, B], P, S(1)),
    (_ce(), [LOGITS[7], TARGET[7]], [S(0), S(0)], P, S(0)),
    (_ce(reduction="sum"), [LOGITS[7], TARGET[7]], [S(0), S(0)], P, S(0)),
    (_ce(reduction="none"), [LOGITS[7], TARGET[7]], [S(0), S(0)], S(0), S(0)),
    (_ce(ignore_index=2), [LOGITS[11], TARGET[11] % 4, CLASS_WEIGHT], [S(0), S(0), B], P, S(0)),
    (_ce(), [IMAGE, PIXEL_TARGET], [S(1), B], P, S(1)),
    (_ce(), [IMAGE, PIXEL_TARGET], [S(2), S(1)], P, S(2)),
    (_ce(reduction="none"), [IMAGE, PIXEL_TARGET], [S(3), S(2)], S(2), S(3)),
    (_ce(), [LOGITS[7][0], TARGET[7][0]], [S(0), B], P, S(0)),
    (_ce(label_smoothing=0.1), [LOGITS[7], TARGET[7]], [S(1), B], P, None),  # values only: other families
    (_mse(), [X, Y], [S(0), S(0)], P, S(0)),
    (_mse(reduction="sum"), [X, Y], [S(1), S(1)], P, S(1)),
    (_mse(reduction="none"), [X, Y], [S(1), S(1)], S(1), S(1)),
]

CASES_2D = [
    (_softmax(1), [X], [(S(0), S(1))], (S(0), S(1)), (S(0), S(1))),
    (_log_softmax(1), [X], [(S(1), S(1))], (S(1), S(1)), (S(1), S(1))),
    (_ce(), [LOGITS[11], TARGET[11]], [(S(0), S(1)), (S(0), B)], (P, P), (S(0), S(1))),
    (_ce(reduction="sum"), [LOGITS[11], TARGET[11]], [(S(0), S(1)), (S(0), B)], (P, P), (S(0), S(1))),
    (_ce(reduction="none"), [LOGITS[11], TARGET[11]], [(S(0), S(1)), (S(0), B)], (S(0), P), (S(0), S(1))),
    (
        _ce(ignore_index=1),
        [LOGITS[11], TARGET[11] % 5, CLASS_WEIGHT],
        [(S(0), S(1)), (S(0), B), (B, B)],
        (P, P),
        (S(0), S(1)),
    ),
    (_ce(), [LOGITS[7], TARGET[7]], [(S(1), S(1)), (B, B)], (P, P), (S(1), S(1))),
    (_mse(), [X, Y], [(S(0), S(1))] * 2, (P, P), (S(0), S(1))),
]


def _check_cases(cases, p, kind):
    """Values against torch (``check_op``), then layouts with forward and backward in strict mode."""
    for i, (fn, inputs, sbps, expect, expect_grad) in enumerate(cases):
        expect = expect if isinstance(expect, tuple) else (expect,)
        expect_grad = expect_grad if isinstance(expect_grad, tuple) else (expect_grad,)
        sbps = [s if isinstance(s, tuple) else (s,) for s in sbps]
        try:
            check_op(fn, inputs, p, sbps, expect_sbp=expect)
            if expect_grad != (None,):
                out_sbp, grads = gradient_layouts(fn, inputs, p, sbps)
                assert (out_sbp, grads[0]) == (expect, expect_grad), f"output, gradient: {out_sbp}, {grads[0]}"
        except Exception as err:
            raise AssertionError(f"{kind} case {i}: {err}") from err


def _vocab_parallel_cross_entropy(p, logits_sbp, target_sbp, vocab):
    """Forward and backward of cross entropy with every all-gather and all-to-all recorded: none may move
    a tensor with the vocabulary dim (anything of more than a row's worth of numbers)."""
    full, target = LOGITS[vocab], TARGET[vocab]
    logits = layout(full, p, logits_sbp).detach().requires_grad_()
    target_global = layout(target, p, target_sbp)
    one = layout(torch.ones((), dtype=full.dtype), p, (B,) * p.ndim)  # d loss / d loss, made before recording
    with strict_recording_moves() as moved:
        loss = F.cross_entropy(logits, target_global)
        loss.backward(one)
    assert not [m for m in moved if len(m[1]) and m[1][-1] > 1], f"logits moved: {moved}"
    assert logits.grad.sbp == logits_sbp
    plain = full.clone().requires_grad_()
    want = F.cross_entropy(plain, target)
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want.detach())
    torch.testing.assert_close(logits.grad.full_tensor(), plain.grad)


def softmax_loss_1d(n):
    p = st.placement("cpu", list(range(n)))
    _check_cases(CASES_1D, p, "1-D")
    for vocab in (7, 11):
        _vocab_parallel_cross_entropy(p, (S(1),), (B,), vocab)


def softmax_loss_2d():
    p = st.placement("cpu", [[0, 1], [2, 3]])
    _check_cases(CASES_2D, p, "2-D")
    _vocab_parallel_cross_entropy(p, (S(0), S(1)), (S(0), B), 11)
    _vocab_parallel_cross_entropy(p, (S(1), S(1)), (B, B), 7)


def test_softmax_loss_1d():
    run_on_world(2, softmax_loss_1d, 2)
    run_on_world(3, softmax_loss_1d, 3)


def test_softmax_loss_2x2():
    run_on_world(4, softmax_loss_2d)
