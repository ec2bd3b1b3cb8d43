"""View and shape ops (``_signatures/views.py``) against plain torch, forward and backward.

Each case names the output SBP the rule must give (the fallback would give broadcast), and runs in strict
mode, backward included: the backward ops (``select_backward``, ``slice_backward``, ``cat``, ...) have
rules too. Shapes are uneven on 2 and 3 ranks; the exact-split cases of ``view`` use sizes divisible by the
number of parts.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import sbp_torch as st
from sbp_torch._signatures.views import view_blocks
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max, partial_sum
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import strict
from world import run_on_world

pytestmark = pytest.mark.gloo


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def cases_1d(n: int) -> list:
    """(name, fn, inputs, SBP per input, expected output SBP or None) on a 1-D placement of ``n`` ranks."""
    x, m, one = _x(5, 7, 3), _x(5, 7, seed=1), _x(5, 1, 3, seed=2)
    even = _x(6, 4, 5, seed=3)
    rows = _x(5, 12, seed=4)
    small = _x(n, 4, seed=5)  # one row per rank: a split dim whose local size is 1
    return [
        ("t", lambda a: a.t(), [m], [S(0)], S(1)),
        ("t partial", lambda a: a.t(), [m], [partial_sum], partial_sum),
        ("transpose", lambda a: a.transpose(0, 2), [x], [S(0)], S(2)),
        ("mT", lambda a: a.mT, [x], [S(1)], S(2)),
        ("permute", lambda a: a.permute(2, 0, 1), [x], [S(0)], S(1)),
        ("movedim", lambda a: a.movedim(0, -1), [x], [S(1)], S(0)),
        ("unsqueeze", lambda a: a.unsqueeze(1), [x], [S(1)], S(2)),
        ("squeeze", lambda a: a.squeeze(), [one], [S(2)], S(1)),
        ("squeeze dim", lambda a: a.squeeze(1), [one], [S(0)], S(0)),
        ("squeeze local size 1", lambda a: a.squeeze(), [small], [S(0)], S(0)),
        ("squeeze dim local size 1", lambda a: a.squeeze(0), [small], [S(0)], S(0)),
        ("expand", lambda a: a.expand(2, 5, 4, 3), [one], [S(0)], S(1)),
        ("expand partial", lambda a: a.expand(5, 4, 3), [one], [partial_max], partial_max),
        ("slice", lambda a: a[:, 1:5], [x], [S(0)], S(0)),
        ("slice step", lambda a: a[1:5:2], [x], [S(2)], S(2)),
        ("whole slice", lambda a: a[:, :], [x], [S(1)], S(1)),
        ("narrow", lambda a: a.narrow(1, 2, 3), [x], [S(2)], S(2)),
        ("select", lambda a: a[:, 2], [x], [S(2)], S(1)),
        ("select partial", lambda a: a[3], [x], [partial_sum], partial_sum),
        ("split", lambda a: a.split(3, dim=1), [x], [S(0)], S(0)),
        ("split_with_sizes", lambda a: a.split([2, 5], dim=1), [x], [S(2)], S(2)),
        ("chunk", lambda a: a.chunk(2, dim=2), [x], [S(1)], S(1)),
        ("unbind", lambda a: a.unbind(1), [x], [S(2)], S(1)),
        ("cat", lambda a, b: torch.cat([a, b], 1), [x, x.flip(1)[:, :4]], [S(0), S(0)], S(0)),
        ("cat partial", lambda a, b: torch.cat([a, b]), [m, m], [partial_sum, partial_sum], partial_sum),
        ("stack", lambda a, b: torch.stack([a, b], 1), [x, x + 1], [S(1), S(1)], S(2)),
        ("flip", lambda a: a.flip(1), [x], [S(0)], S(0)),
        ("roll", lambda a: a.roll(2, 1), [x], [S(2)], S(2)),
        ("rot90", lambda a: a.rot90(1, (0, 2)), [x], [S(1)], S(1)),
        ("narrow_copy", lambda a: a.narrow_copy(1, 2, 3), [x], [S(0)], S(0)),
        ("repeat", lambda a: a.repeat(2, 1, 2, 1), [x], [S(0)], S(1)),
        ("unfold", lambda a: a.unfold(1, 3, 2), [x], [S(0)], S(0)),
        ("view unchanged uneven", lambda a: a.view(5, 21), [x], [S(0)], S(0)),
        ("view split unchanged dim", lambda a: a.view(5, 4, 3), [rows], [S(0)], S(0)),
        ("view merge exact", lambda a: a.view(24, 5), [even], [S(0)], S(0)),
        ("view split exact", lambda a: a.view(6, 2, 2, 5), [even], [S(1)], S(1) if 4 % n == 0 else None),
        ("flatten", lambda a: a.flatten(1), [x], [S(0)], S(0)),
        ("reshape of transpose", lambda a: a.t().reshape(-1), [even[:, :, 0]], [S(1)], S(0) if 4 % n == 0 else None),
        ("view partial", lambda a: a.view(35, 3), [x], [partial_sum], partial_sum),
        ("view merge uneven", lambda a: a.view(35, 3), [x], [S(0)], None),
        # in-place views change the tensor's own shape and layout
        ("squeeze_", lambda a: a.clone().squeeze_(1), [one], [S(2)], S(1)),
        ("unsqueeze_", lambda a: a.clone().unsqueeze_(0), [x], [S(1)], S(2)),
        ("transpose_", lambda a: a.clone().transpose_(0, 2), [x], [S(0)], S(2)),
        ("t_", lambda a: a.clone().t_(), [m], [S(1)], S(0)),
        ("vector @ matrix", lambda v, a: v @ a, [m[:, 0], m], [B, S(1)], S(0)),  # unsqueeze_ then squeeze_ inside
    ]


def cases_mesh() -> list:
    """(name, fn, inputs, SBPs per input, expected output SBPs or None) on a 2x2 mesh."""
    x, big = _x(5, 7, 3), _x(12, 4, 5, seed=1)
    return [
        ("permute", lambda a: a.permute(2, 0, 1), [x], [(S(0), S(1))], (S(1), S(2))),
        ("nested splits", lambda a: a.transpose(0, 1), [x], [(S(0), S(0))], (S(1), S(1))),
        ("select", lambda a: a[:, 1], [x], [(S(2), partial_sum)], (S(1), partial_sum)),
        ("split", lambda a: a.split(2, dim=2), [x], [(S(1), S(0))], (S(1), S(0))),
        ("cat", lambda a, b: torch.cat([a, b], 2), [x, x], [(S(0), B), (S(0), B)], (S(0), B)),
        ("view merge exact nested", lambda a: a.view(48, 5), [big], [(S(0), S(0))], (S(0), S(0))),
        ("view two blocks", lambda a: a.view(6, 2, 20), [big], [(S(0), S(1))], (S(0), S(2))),
        ("view merge inexact", lambda a: a.view(12, 20), [_x(6, 8, 5, seed=2)], [(S(1), S(0))], None),
        ("expand", lambda a: a.unsqueeze(0).expand(3, 5, 7, 3), [x], [(S(2), S(0))], (S(3), S(1))),
    ]


def views_body(ranks):
    p = st.placement("cpu", ranks)
    cases = cases_mesh() if isinstance(ranks[0], list) else cases_1d(len(ranks))
    for name, fn, inputs, sbps, expect in cases:
        expect = expect if expect is None or isinstance(expect, tuple) else (expect,)
        try:
            strict(partial(check_op, expect_sbp=expect))(fn, inputs, p, sbps)
        except Exception as err:
            raise AssertionError(f"case {name!r}: {err}") from err
    return True


@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2], [[0, 1], [2, 3]]], ids=["2", "3", "2x2"])
def test_views_match_torch(ranks):
    assert all(run_on_world(4 if isinstance(ranks[0], list) else len(ranks), views_body, ranks))


def test_view_blocks():
    assert view_blocks((6, 4, 5), (24, 5)) == [([0, 1], [0]), ([2], [1])]
    assert view_blocks((6, 1, 4), (2, 3, 4)) == [([0], [0, 1]), ([2], [2])]
    assert view_blocks((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert view_blocks((1, 5), (5, 1)) == [([1], [0])]


PAD_VALUES = [0.0, 1.0, 2.5]


def pad_history_body(values: list[float], grad: bool) -> list:
    """``F.pad`` of one partial-sum tensor with each padding value in turn, in one world: each call must give the
    one-process result, whatever call came before it (a decision cached for ``value=0``, where a partial stays
    partial, must not be replayed for ``value=1``)."""
    p = st.placement("cpu", [0, 1])
    x = torch.arange(6.0).reshape(2, 3).to_global(p, B).to_global(sbp=partial_sum).requires_grad_(grad)
    out = []
    for value in values:
        padded = torch.nn.functional.pad(x, (1, 1), value=value)
        if grad:
            padded.sum().backward()
        out.append((padded.sbp, padded.full_tensor().detach(), None if x.grad is None else x.grad.full_tensor()))
        x.grad = None
    return out


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("order", [PAD_VALUES, PAD_VALUES[::-1]], ids=["zero_first", "zero_last"])
def test_a_pad_decision_is_not_replayed_for_another_value(order, grad):
    plain = torch.arange(6.0).reshape(2, 3)
    for results in run_on_world(2, pad_history_body, order, grad):
        for value, (sbp, full, gradient) in zip(order, results):
            torch.testing.assert_close(full, torch.nn.functional.pad(plain, (1, 1), value=value), msg=f"value={value}")
            assert (sbp == (partial_sum,)) == (value == 0), f"value={value} gave {sbp}"
            if grad:
                torch.testing.assert_close(gradient, torch.ones(2, 3))


def contiguous_body() -> list:
    """``contiguous()`` of a transposed view of a split tensor, written into: the base keeps its values (the copy
    is one), gradients flow; of a tensor whose part is contiguous, the tensor itself."""
    p = st.placement("cpu", [0, 1])
    base = _x(4, 6, seed=3).to_global(p, B).to_global(sbp=S(0)).requires_grad_()
    x = base * 1
    copy = x.transpose(0, 1).contiguous()
    copy.add_(1)
    (copy * _x(6, 4, seed=4).to_global(p, B)).sum().backward()
    return [x.full_tensor().detach(), copy.full_tensor().detach(), base.grad.full_tensor(), x.contiguous() is x]


def test_contiguous_of_a_transposed_view_is_a_copy():
    plain = _x(4, 6, seed=3).requires_grad_()
    x = plain * 1
    copy = x.transpose(0, 1).contiguous()
    copy.add_(1)
    (copy * _x(6, 4, seed=4)).sum().backward()
    for got_x, got_copy, grad, itself in run_on_world(2, contiguous_body):
        torch.testing.assert_close(got_x, x.detach())
        torch.testing.assert_close(got_copy, copy.detach())
        torch.testing.assert_close(grad, plain.grad)
        assert itself


def writes_through_views_body() -> list:
    """In-place adds through ``diagonal()``, ``as_strided()``, ``x[index]`` and the rows of ``unbind`` of a square
    tensor in each layout: (what, the base after the write, or the refusal's message). A diagonal of a broadcast or
    partial tensor, or of one split along a batch dim, and rows along a dim that is not split, are views of the parts;
    ``x[index]`` computed as a copy is written back; the other copies' writes would be lost: refused."""
    p = st.placement("cpu", [0, 1, 2])
    X = _x(2, 5, 5, seed=6)
    out = []
    writes = {
        "diagonal": lambda t: t.diagonal(dim1=1, dim2=2).add_(10.0),
        "as_strided": lambda t: t.as_strided((2, 2), (5, 1), 3).add_(10.0),
        "index": lambda t: t[:, 1:4].add_(10.0),  # (written back into t where the slice is a copy)
        "rows": lambda t: [row.add_(10.0) for row in t.unbind(1)],
    }
    for sbp in (B, partial_sum, S(0), S(1)):
        for what, write in writes.items():
            x = X.to_global(p, B).to_global(sbp=sbp)
            try:
                write(x)
                out.append((f"{what} of {sbp}", x.full_tensor()))
            except NotImplementedError as err:
                out.append((f"{what} of {sbp}", str(err)))
    return out


def test_writes_through_views_reach_the_base_or_are_refused():
    X = _x(2, 5, 5, seed=6)
    written = {what: X.clone() for what in ("diagonal", "as_strided", "index", "rows")}
    written["diagonal"].diagonal(dim1=1, dim2=2).add_(10.0)
    written["as_strided"].as_strided((2, 2), (5, 1), 3).add_(10.0)
    written["index"][:, 1:4].add_(10.0)
    written["rows"] += 10.0
    reach = {"diagonal of B", "diagonal of P", "diagonal of S(0)", "as_strided of B", "rows of B", "rows of P"}
    reach |= {f"index of {sbp}" for sbp in (B, partial_sum, S(0), S(1))} | {"rows of S(0)"}
    for results in run_on_world(3, writes_through_views_body):
        for what, got in results:
            if what in reach:
                torch.testing.assert_close(got, written[what.split(" of ")[0]], msg=what)
            else:
                assert isinstance(got, str) and "computed as a copy" in got, (what, got)
