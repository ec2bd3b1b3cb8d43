"""The rules a mixture-of-experts router needs with its tokens split: ``_signatures/sorting.py`` (``topk``,
``sort``, ``kthvalue``, ``cummax``, ``cummin``) and ``histc`` (``_signatures/reductions.py``).

Most checks run in one process on the rule checker's simulated ranks (``rule_checker.py``: 2, 3 and 4 ranks and
a 2x2 grid, against the plain op), on uneven shapes, parts left empty, and ties; one gloo test runs a router's
forward and backward in strict mode (no op gathers) and asserts the layouts its outputs come out in."""

from __future__ import annotations

import pytest
import rule_checker as rc
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import sbp_torch as st
from sbp_torch._dispatch._bound import BoundCall, call_key
from sbp_torch._dispatch._decide import decide
from sbp_torch._layout import GlobalMeta, Split
from sbp_torch._signatures import rule_for
from sbp_torch._signatures.core import B, P, S
from sbp_torch._signatures.sorting import ALONG_DIM
from sbp_torch._tensor import GlobalTensor

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


# Ranges that leave values outside (not counted), integer bounds, NaN (not counted), one row (empty parts)
HISTC_CALLS = [
    _call(aten.histc.default, _x(7, 5), 4, -1, 1),
    _call(aten.histc.default, _x(7), 10, -2, 2),
    _call(aten.histc.default, _x(5, 7, 3), 3, 0.5, 1.0),
    _call(aten.histc.default, _x(1, 3), 5, -1.0, 1.0),
    _call(aten.histc.default, _ties(9, 2), 3, 0, 2),
    _call(aten.histc.default, torch.tensor([[0.5, float("nan")], [0.25, 1.0], [-3.0, 0.0]]), 4, 0, 1),
    _call(aten.histc.default, _x(7, 5).float(), 6, -1.5, 1.5),
]


@pytest.mark.parametrize("call", HISTC_CALLS, ids=repr)
def test_histc_of_a_split_is_a_partial_sum(call):
    offered = _offered(call)
    assert offered[:-1] == [((S(d),), (P,)) for d in range(call.args[0].dim())] and offered[-1] == ((B,), (B,))
    report = rc.check_rules([call])
    assert not report.findings, "\n".join(map(str, report.findings))
    assert report.checked >= 4 * 2


@pytest.mark.parametrize("bounds", [(0, 0), (1.0, 1.0)], ids=["default", "equal"])
def test_histc_without_a_range_offers_no_partial(bounds):
    """Equal bounds bin by the data's own range, which differs between the parts."""
    assert _offered(_call(aten.histc.default, _x(7, 5), 4, *bounds)) == [((B,), (B,))]


def test_histc_offers_no_partial_where_a_count_could_round():
    """Beyond 2**8 elements of bfloat16 a count may round, and rounds otherwise in the sum of the parts."""
    held, too_many = torch.zeros(256, dtype=torch.bfloat16), torch.zeros(600, dtype=torch.bfloat16)
    assert _offered(_call(aten.histc.default, held, 1, -1, 1)) == [((S(0),), (P,)), ((B,), (B,))]
    assert _offered(_call(aten.histc.default, too_many, 1, -1, 1)) == [((B,), (B,))]
    assert not rc.check_rules([_call(aten.histc.default, held, 1, -1, 1)]).findings
    halves = torch.histc(too_many[:300], 1, -1, 1) + torch.histc(too_many[300:], 1, -1, 1)
    assert not torch.equal(halves, torch.histc(too_many, 1, -1, 1))  # why: the parts would not sum to it


def test_histc_decides_by_its_range():
    """The bounds are in the call's key, so a split input decided for a range is not replayed without one."""
    p = st.placement("cpu", [0, 1])
    x = GlobalTensor(torch.empty(0), GlobalMeta((7, 5), torch.float32, p, (Split(0),)))
    ranged, unranged = BoundCall(aten.histc.default, (x, 4, -1, 1), {}), BoundCall(aten.histc.default, (x, 4), {})
    assert call_key(ranged.func, rc.op_schema(ranged.func), ranged.args, ranged.kwargs) != call_key(
        unranged.func, rc.op_schema(unranged.func), unranged.args, unranged.kwargs
    )
    decided = decide(ranged)
    assert decided.input_sbps == ((Split(0),),) and decided.outputs[0].sbp == (P,)
    assert decide(unranged).input_sbps == ((B,),)


def test_bincount_has_no_rule():
    """Its length, ``max(input) + 1`` (at least ``minlength``), is data that differs between the parts, and no
    meta kernel can tell it: a partial sum of local counts would not even have one shape. It gathers."""
    assert rule_for(aten.bincount.default) is None


# -- on a gloo world --------------------------------------------------------------------------------------


def _route(logits: torch.Tensor):
    """A top-2 router: the gates of each token's two experts and the experts as one-hot rows."""
    values, experts = torch.topk(logits, 2, dim=-1)
    return torch.softmax(values, -1), F.one_hot(experts, logits.shape[-1])


def _load(logits: torch.Tensor) -> torch.Tensor:
    """How many tokens each expert gets from a top-2 router."""
    experts = torch.topk(logits, 2, dim=-1).indices
    return torch.histc(experts.double(), bins=logits.shape[-1], min=0, max=logits.shape[-1] - 1)


def router_body(ranks):
    p = st.placement("cpu", ranks)
    logits, ties = _x(7, 5), _ties(7, 5)
    for fn, x, want in [
        (_route, logits, S(0)),
        (_load, logits, P),
        (lambda x: torch.sort(x, -1, descending=True), ties, S(0)),
        (lambda x: torch.argsort(x, dim=-1, stable=True), ties, S(0)),
        (lambda x: torch.kthvalue(x, 2, 1), logits, S(0)),
        (lambda x: torch.cummax(x, 1), logits, S(0)),
    ]:
        sbps = strict(check_op)(fn, [x], p, [S(0)])
        assert all(s == (want,) for s in sbps), sbps
    return True


@pytest.mark.gloo
@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2]], ids=["2", "3"])
def test_a_router_keeps_its_tokens_split(ranks):
    """One-hot needs no rule: on a global tensor torch builds it from ``arange``, ``eq`` and a cast."""
    assert all(run_on_world(len(ranks), router_body, ranks))
