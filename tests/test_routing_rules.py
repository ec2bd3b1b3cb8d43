"""The rules a mixture-of-experts router needs with its tokens split: ``_signatures/sorting.py`` (``topk``,
``sort``, ``kthvalue``, ``cummax``, ``cummin``).

Most checks run in one process on the rule checker's simulated ranks (``rule_checker.py``: 2, 3 and 4 ranks and
a 2x2 grid, against the plain op), on uneven shapes, parts left empty, and ties; one gloo test runs a router's
forward and backward in strict mode and asserts the layouts its outputs and gradient come out in."""

from __future__ import annotations

import pytest
import rule_checker as rc
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import sbp_torch as st
from sbp_torch._signatures import rule_for
from sbp_torch._signatures.core import B, S
from sbp_torch._signatures.sorting import ALONG_DIM

from op_check import check_op
from strict_check import strict
from world import run_on_world

aten = torch.ops.aten


def _x(*shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ties(*shape, seed=0) -> torch.Tensor:
    """Few distinct values: many ties in every slice."""
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed)).double()


def _call(func, *args, **kwargs) -> rc.SampleCall:
    return rc.SampleCall(func, args, kwargs)


# 7 tokens do not divide by 2, 3 or 4; 3 experts leave a rank of 4 without any; 1 token leaves all but one empty
SORTING_CALLS = [
    _call(aten.topk.default, _x(7, 5), 2),
    _call(aten.topk.default, _x(7, 5), 2, 1, False, False),
    _call(aten.topk.default, _x(7, 3, 6), 3, 1),
    _call(aten.topk.default, _x(1, 5), 2, -1),
    _call(aten.topk.default, _ties(7, 5), 3, -1),
    _call(aten.sort.default, _x(7, 5), -1, True),
    _call(aten.sort.default, _x(5, 7, 3), 1),
    _call(aten.sort.default, _ties(9, 4), 0),
    _call(aten.sort.stable, _ties(7, 5), stable=True, dim=-1, descending=True),
    _call(aten.sort.stable, _ties(7, 5), stable=False, dim=0),
    _call(aten.kthvalue.default, _x(7, 5), 2),
    _call(aten.kthvalue.default, _x(5, 7, 3), 3, 1),
    _call(aten.kthvalue.default, _x(5, 7, 3), 3, 1, True),
    _call(aten.kthvalue.default, _ties(7, 5), 2, 0),
    _call(aten.cummax.default, _x(7, 5), 1),
    _call(aten.cummin.default, _ties(5, 7, 3), 1),
]


def _offered(call: rc.SampleCall, mesh=(2,)) -> list:
    """The 1-D signatures the call's rule offers, as (input SBPs, output SBPs)."""
    outputs = rc.expected_outputs(call)
    shown = rc.shown_call(call, mesh, outputs)
    slots = rc.tensor_slots(call)
    return [rc.resolved(s, slots, call, outputs) for s in rule_for(call.func).offered(shown)]


@pytest.mark.parametrize("call", SORTING_CALLS, ids=repr)
def test_sorting_signatures_give_the_plain_result(call):
    report = rc.check_rules([call])
    assert not report.findings, "\n".join(map(str, report.findings))
    assert report.checked >= 4 * 2  # a split beside B on every placement, at least


@pytest.mark.parametrize("call", SORTING_CALLS, ids=repr)
def test_sorting_rules_miss_no_split(call):
    missing = [m for m in rc.missing_signatures(call) if "S(" in m.split(": ")[-1].split(" -> ")[0]]
    assert not missing, missing


def test_a_split_of_any_other_dim_passes_through():
    x = _x(4, 5, 6)
    calls = [
        _call(aten.sort.default, x, 1),
        _call(aten.sort.stable, x, stable=True, dim=1),
        _call(aten.topk.default, x, 2, -2),
        _call(aten.cummax.default, x, 1),
        _call(aten.cummin.default, x, 1),
    ]
    assert {c.func for c in calls} == set(ALONG_DIM)
    for call in calls:
        assert _offered(call) == [((S(0),), (S(0), S(0))), ((S(2),), (S(2), S(2))), ((B,), (B, B))], call
    kth = _offered(_call(aten.kthvalue.default, x, 2, -2))
    assert kth == [((S(0),), (S(0), S(0))), ((S(2),), (S(1), S(1))), ((B,), (B, B))]
    kept = _offered(_call(aten.kthvalue.default, x, 2, -2, True))
    assert kept == [((S(0),), (S(0), S(0))), ((S(2),), (S(2), S(2))), ((B,), (B, B))]


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_argsort_and_msort_reach_dispatch_as_sort():
    """They have no rule of their own: torch decomposes them into ``sort`` before dispatch."""
    x = _x(4, 5)
    for fn, want in [
        (lambda: torch.argsort(x, 1), aten.sort.default),
        (lambda: torch.argsort(x, dim=0, stable=True), aten.sort.stable),
        (lambda: torch.msort(x), aten.sort.default),
    ]:
        recorder = _Recorder()
        with recorder:
            fn()
        assert recorder.seen == [want]


# -- on a gloo world --------------------------------------------------------------------------------------


def _route(logits: torch.Tensor):
    """A top-2 router: the gates of each token's two experts and the experts as one-hot rows."""
    values, experts = torch.topk(logits, 2, dim=-1)
    return torch.softmax(values, -1), F.one_hot(experts, logits.shape[-1])


def router_body(ranks):
    p = st.placement("cpu", ranks)
    logits, ties = _x(7, 5), _ties(7, 5)
    for fn, x in [
        (_route, logits),
        (lambda x: torch.sort(x, -1, descending=True), ties),
        (lambda x: torch.argsort(x, dim=-1, stable=True), ties),
        (lambda x: torch.kthvalue(x, 2, 1), logits),
        (lambda x: torch.cummax(x, 1), logits),
    ]:
        sbps = strict(check_op)(fn, [x], p, [S(0)])
        assert all(s == (S(0),) for s in sbps), sbps
    return True


@pytest.mark.gloo
@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2]], ids=["2", "3"])
def test_a_router_keeps_its_tokens_split(ranks):
    """One-hot needs no rule: on a global tensor torch builds it from ``arange``, ``eq`` and a cast."""
    assert all(run_on_world(len(ranks), router_body, ranks))
