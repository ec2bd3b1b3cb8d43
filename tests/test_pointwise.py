"""Element-wise ops on global tensors against plain torch (``_signatures/pointwise.py``): a split follows the
output's dims through broadcasting, every op keeps broadcast, and the partial kinds of ``PARTIAL_KINDS``
(sums through add/sub/neg, scaling by a broadcast factor, copies) keep a partial without reducing it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._signatures.pointwise import PARTIAL_KINDS, is_pointwise
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max as PMAX
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op, layout
from strict_check import recording_collectives, strict
from world import run_on_world

aten = torch.ops.aten
GEN = torch.Generator().manual_seed(0)
X = torch.randn(5, 7, generator=GEN, dtype=torch.float64)
Y = torch.randn(5, 7, generator=GEN, dtype=torch.float64)
ROW = torch.randn(7, generator=GEN, dtype=torch.float64)
COL = torch.randn(5, 1, generator=GEN, dtype=torch.float64)

# (name, function, inputs, input sbps, output sbp) on a 1-D placement; every case runs in strict mode, so an op
# that took the gathering fallback would fail, and with partial inputs none may reduce (checked below).
CASES_1D = [
    ("unary keeps a split", torch.tanh, [X], [S(0)], S(0)),
    ("binary, same split", torch.mul, [X, Y], [S(1), S(1)], S(1)),
    ("a broadcast row follows a row split", torch.add, [X, ROW], [S(0), B], S(0)),
    ("a row splits with a column split", torch.add, [X, ROW], [S(1), S(0)], S(1)),
    ("a size-1 dim stays whole", torch.sub, [X, COL], [S(1), B], S(1)),
    ("scalar operand", lambda x: x * 3.0 + 1.0, [X], [S(1)], S(1)),
    ("where with a mask", lambda x, y: torch.where(x > 0, x, y), [X, Y], [S(0), S(0)], S(0)),
    ("sum of partial sums", torch.add, [X, Y], [P, P], P),
    ("difference of partial sums", torch.sub, [X, Y], [P, P], P),
    ("negated partial sum", torch.neg, [X], [P], P),
    ("partial sum scaled by a broadcast factor", torch.mul, [X, Y], [P, B], P),
    ("broadcast factor scaling a partial sum", torch.mul, [X, Y], [B, P], P),
    ("partial sum over a broadcast divisor", torch.div, [X, Y], [P, B], P),
    ("partial sum times a number", lambda x: x * 2.5, [X], [P], P),
    ("a copy keeps a partial max", lambda x: x.clone(), [X], [PMAX], PMAX),
    ("every op keeps broadcast", torch.atan2, [X, Y], [B, B], B),
]

CASES_2D = [
    ("split on both axes", torch.mul, [X, Y], [(S(0), S(1)), (S(0), S(1))], (S(0), S(1))),
    ("partial on one axis, split on the other", torch.add, [X, Y], [(P, S(1)), (P, S(1))], (P, S(1))),
    ("broadcast row against a nested split", torch.add, [X, ROW], [(S(0), S(0)), (B, B)], (S(0), S(0))),
]


def _check_cases(cases, placement, kind):
    """Per case: the op alone, in strict mode and recording reductions, for its output layout (and, with partial
    inputs, that nothing was reduced); then ``check_op`` for values and gradients against torch."""
    for name, fn, inputs, sbps, expect in cases:
        sbps = [s if isinstance(s, tuple) else (s,) for s in sbps]
        expect = expect if isinstance(expect, tuple) else (expect,)
        partial_inputs = any(isinstance(s, type(P)) for layout_ in sbps for s in layout_)
        try:
            as_global = [layout(x, placement, s) for x, s in zip(inputs, sbps)]
            with recording_collectives("all_reduce", "reduce_scatter") as reductions:
                out = strict(fn)(*as_global)
            assert out.sbp == expect, f"output {out.sbp}, expected {expect}"
            assert not (partial_inputs and reductions), f"a partial input was reduced: {reductions}"
            check_op(fn, inputs, placement, sbps)
        except Exception as err:
            raise AssertionError(f"{kind} case {name!r}: {err}") from err


def pointwise_1d(n):
    _check_cases(CASES_1D, st.placement("cpu", list(range(n))), "1-D")


def pointwise_2d():
    _check_cases(CASES_2D, st.placement("cpu", [[0, 1], [2, 3]]), "2-D")


@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 3])
def test_pointwise_1d(n):
    run_on_world(n, pointwise_1d, n)


@pytest.mark.gloo
def test_pointwise_2x2():
    run_on_world(4, pointwise_2d)


def _random_layouts(shapes_and_sbps, seed):
    """Plain random inputs of the drawn shapes, the same on every rank, and a binary op over them."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape, _ in shapes_and_sbps]


def random_binary(n, a_shape, b_shape, a_sbp, b_sbp, op_name, seed):
    x, y = _random_layouts([(a_shape, a_sbp), (b_shape, b_sbp)], seed)
    op = {"add": torch.add, "mul": torch.mul, "maximum": torch.maximum, "hypot": torch.hypot}[op_name]
    check_op(op, [x, y], st.placement("cpu", list(range(n))), [(a_sbp,), (b_sbp,)])


@st_.composite
def _binary_case(draw):
    """Two broadcastable shapes (mostly uneven sizes) with a split, broadcast, partial-sum or partial-max layout
    each."""
    ndim = draw(st_.integers(1, 3))
    out = [draw(st_.integers(1, 7)) for _ in range(ndim)]
    b_ndim = draw(st_.integers(1, ndim))
    b_shape = [1 if draw(st_.booleans()) else n for n in out[ndim - b_ndim :]]
    layouts = [S(d) for d in range(ndim)] + [B, P, PMAX]
    a_sbp = draw(st_.sampled_from(layouts))
    b_sbp = draw(st_.sampled_from([S(d) for d in range(b_ndim)] + [B, P, PMAX]))
    return tuple(out), tuple(b_shape), a_sbp, b_sbp


@pytest.mark.gloo
@settings(max_examples=25)
@given(case=_binary_case(), n=st_.sampled_from([2, 3]), op_name=st_.sampled_from(["add", "mul", "maximum", "hypot"]))
@example(case=((5, 3), (3,), P, B), n=3, op_name="maximum")  # (the ops that must box a partial input)
@example(case=((5, 3), (5, 1), S(0), PMAX), n=2, op_name="hypot")
@example(case=((4, 7), (7,), PMAX, P), n=3, op_name="maximum")
def test_random_binary_layouts(case, n, op_name):
    """Any pair of layouts, partial ones included, gives torch's values and gradients (boxing where needed)."""
    a_shape, b_shape, a_sbp, b_sbp = case
    run_on_world(n, random_binary, n, a_shape, b_shape, a_sbp, b_sbp, op_name, 0)


def test_the_family_is_found_by_torch_tag():
    """Pointwise ops are found by torch's own tag (new ones are covered without a list); every op of the
    partial table is one of them."""
    assert is_pointwise(aten.hypot.default) and is_pointwise(aten.special_erfcx.default)
    assert not is_pointwise(aten.mm.default) and not is_pointwise(aten.sum.dim_IntList)
    assert all(is_pointwise(op) for op in PARTIAL_KINDS)


def partial_casts() -> list:
    """Conversions of a partial sum whose parts cancel: narrowing ones (to float16, bfloat16, an integer, and a
    copy into an integer tensor) must reduce first, widening ones keep it partial; (name, layout, full value)."""
    p = st.placement("cpu", [0, 1])
    parts = [torch.tensor([1000.3, 300.1, 0.6]), torch.tensor([-1000.0, -300.0, 0.6])]
    x = parts[dist.get_rank()].to_global(p, P)
    into = torch.zeros(3, dtype=torch.int64).to_global(p, P)
    into.copy_(x)
    converted = {"half": x.half(), "bfloat16": x.bfloat16(), "long": x.long(), "copy_ into int64": into}
    converted["double"] = x.double()
    return [(name, t.sbp, t.full_tensor()) for name, t in converted.items()]


@pytest.mark.gloo
def test_a_partial_sum_is_reduced_before_a_narrowing_conversion():
    whole = torch.tensor([1000.3, 300.1, 0.6]) + torch.tensor([-1000.0, -300.0, 0.6])
    want = {"half": whole.half(), "bfloat16": whole.bfloat16(), "long": whole.long(), "copy_ into int64": whole.long()}
    for results in run_on_world(2, partial_casts):
        for name, sbp, got in results:
            if name == "double":
                assert sbp == (P,), sbp
                torch.testing.assert_close(got, whole.double(), rtol=1e-6, atol=1e-4)
            else:
                torch.testing.assert_close(got, want[name], rtol=0, atol=0, msg=name)


_SCALED = torch.tensor([[1.5, -2.0, 0.0], [3.0, 0.25, -0.5]])
# where scaling a partial sum stops being linear (0, -0.0, inf, -inf, nan), and where it holds, in two orders
_NUMBERS = [2.0, 0.0, -0.0, math.inf, -math.inf, math.nan, 0.5]
_NUMBERS += _NUMBERS[::-1]


def _scalings(x) -> list:
    """``x`` over, times and plus-alpha-times each number, and divided in place, every infinity and nan made finite to
    compare: (what, result)."""
    out = []
    for n in _NUMBERS:
        for what, f in (("/", lambda t: t / n), ("*", lambda t: t * n), (".mul", lambda t: t.mul(n))):
            out.append((f"x {what} {n}", f(x)))
        out.append((f"x + x * {n} (alpha)", torch.add(x, x, alpha=n)))
        out.append((f"x.div_({n})", x.clone().div_(n)))
    return [(what, torch.nan_to_num(t, nan=7.0, posinf=8.0, neginf=-8.0)) for what, t in out]


def partial_scalings() -> list:
    """``_scalings`` of a partial sum on 3 ranks (each op twice, in two orders: an earlier call's decision must not
    answer a later one)."""
    x = _SCALED.to_global(st.placement("cpu", [0, 1, 2]), B).to_global(sbp=P)
    return [(what, t.full_tensor()) for what, t in _scalings(x)]


@pytest.mark.gloo
def test_a_partial_sum_is_reduced_before_a_number_that_breaks_linearity():
    want = _scalings(_SCALED)
    for rank in run_on_world(3, partial_scalings):
        for (what, got), (_, expected) in zip(rank, want):
            torch.testing.assert_close(got, expected, msg=what)
