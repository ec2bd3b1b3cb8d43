"""Every signature of every rule on simulated ranks, in one process (``rule_checker.py``), and the contract that a
call's key holds everything its decision reads. No process group needed.

The checker runs each recorded call of torch's OpInfo samples (forward and backward) on placements of 2, 3 and 4 ranks
and a 2x2 grid; the tests below first show that it finds a wrong signature and a missing one when there is one."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import rule_checker as rc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._dispatch._bound import BoundCall, call_key
from sbp_torch._dispatch._decide import NoSignature, decide
from sbp_torch._layout import GlobalMeta, Partial, Split, broadcast
from sbp_torch._signatures import RULES, NumberClass, UndeclaredArgument, rule_for, shown_arguments, sig
from sbp_torch._signatures.core import _FAMILY_RULES, B, P, S
from sbp_torch._tensor import GlobalTensor

aten = torch.ops.aten

# Rules that no OpInfo sample reaches, each checked elsewhere: (rule function name, where)
UNSAMPLED = {
    "fresh": "random draws: tests/test_random_ops.py",
    "bernoulli": "random draws: tests/test_random_ops.py",
    "fill_random": "random draws: tests/test_random_ops.py",
    "native_dropout": "random draws: tests/test_random_ops.py",
    "gradient_boundary": "sbp_torch's own op inside compiled programs: tests/test_compile.py",
    "bias_dropout_add": "sbp_torch.kernels' random dropout: tests/test_kernels.py",
}


@pytest.fixture(scope="module")
def calls():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = rc.sample_calls(per_op=2, samples_per_opinfo=2)
    return calls + rc.attention_calls() + rc.other_calls() + rc.kernel_calls()


def _name(rule) -> str:
    return rule.signatures.__name__


def test_every_signature_of_every_rule_gives_the_plain_result(calls):
    report = rc.check_rules(calls)
    assert not report.findings, "\n".join(map(str, report.findings[:20]))
    assert report.checked > 5000, report.checked  # the sample did not shrink unnoticed
    ruled = {_name(rule) for rule in RULES.values()} | {_name(rule) for _, rule in _FAMILY_RULES}
    assert ruled - report.rules == set(UNSAMPLED), "rules no sample call reaches"


def test_partials_pass_numbers_only_where_they_stay_exact(calls):
    """Every call that passes a number, with it at 0, -0.0, inf, -inf and nan: a partial kept through a factor of inf
    or a divisor of 0 would reduce to nan where one process gives an infinity."""
    extreme = rc.with_extreme_numbers(calls)
    assert len(extreme) > 200, len(extreme)
    report = rc.check_rules(extreme, meshes=[(2,), (2, 2)])
    # (only where a partial is kept: torch's own kernels give other non-finite results on other shapes, as addmm
    # with alpha=inf does on a slice of columns, which a split signature's parts would show)
    kept = [f for f in report.findings if any(isinstance(x, Partial) for s in f.combo for x in _sbps_of(s))]
    assert not kept, "\n".join(map(str, kept[:20]))


def _sbps_of(signature) -> list:
    outputs = signature.outputs if isinstance(signature.outputs, tuple) else (signature.outputs,)
    return [sbp for _, sbp in signature.inputs] + list(outputs)


def _with_rule(func, **changes):
    """Temporarily replace fields of ``func``'s rule (``RULES`` entry)."""
    original = rule_for(func)
    RULES[func] = dataclasses.replace(original, **changes)
    return original


def test_the_checker_finds_wrong_signatures():
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    wrong = {
        # exp does not commute with a sum of parts
        aten.exp.default: (rc.SampleCall(aten.exp.default, (x,), {}), lambda call: [sig(P, self=P)]),
        # a transpose moves the split to the other dim
        aten.t.default: (rc.SampleCall(aten.t.default, (x,), {}), lambda call: [sig(S(0), self=S(0))]),
        # a product split on the contraction dim is partial, not split
        aten.mm.default: (rc.SampleCall(aten.mm.default, (x, y), {}), lambda call: [sig(S(1), self=S(1), mat2=S(0))]),
    }
    for func, (call, signatures) in wrong.items():
        original = _with_rule(func, signatures=signatures)
        try:
            report = rc.check_rules([call], meshes=[(2,), (3,)])
        finally:
            RULES[func] = original
        assert len(report.findings) == 2, (func, report.findings)


def test_the_checker_finds_a_missing_signature():
    call = rc.SampleCall(aten.mm.default, (torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 4)), {})
    call.args = (call.args[0], call.args[1].double())
    offered = rule_for(aten.mm.default).signatures
    original = _with_rule(aten.mm.default, signatures=lambda c: [s for s in offered(c) if s.outputs != S(0)])
    try:
        missing = rc.missing_signatures(call)
    finally:
        RULES[aten.mm.default] = original
    assert any("(S(0), B) -> [S(0)]" in m for m in missing), missing
    assert not rc.missing_signatures(call), "mm's own rule misses nothing here"


def test_a_rule_cannot_read_an_argument_it_does_not_declare():
    p = st.placement("cpu", [0, 1])
    x = GlobalTensor(torch.empty(0), GlobalMeta((2, 3), torch.float32, p, (Partial("sum"),)))
    original = _with_rule(aten.constant_pad_nd.default, reads=frozenset({"value"}))
    try:
        with pytest.raises(UndeclaredArgument, match="'pad'"):
            decide(BoundCall(aten.constant_pad_nd.default, (x, [1, 1], 1.0), {}))
    finally:
        RULES[aten.constant_pad_nd.default] = original
    # an undeclared number is shown as the class the key holds of it, not its value
    shown = shown_arguments(aten.mul.Scalar, {"self": x, "other": 0.0}, frozenset(), lambda v: v)
    assert shown["other"] is NumberClass.ZERO
    with pytest.raises(ValueError, match="declares reads=\\['valu'\\]"):
        from sbp_torch._signatures import register

        register(aten.constant_pad_nd.default, reads=("valu",))(lambda call: [])


def test_the_registry_adds_the_all_broadcast_signature():
    p = st.placement("cpu", [0, 1])
    x = GlobalTensor(torch.empty(0), GlobalMeta((5,), torch.float32, p, (Split(0),)))
    decision = decide(BoundCall(aten.cumsum.default, (x, 0), {}))  # the rule lists no B; only B fits
    assert decision.input_sbps == ((broadcast,),) and decision.outputs[0].sbp == (broadcast,)


# -- one key, one decision -----------------------------------------------------------------------------------------


def _numbers(call: rc.SampleCall) -> list[tuple[str, type]]:
    """(name, type) of the Scalar-typed arguments that the call passes a number."""
    named = rc.by_name(rc.op_schema(call.func), call.args, call.kwargs)
    return [
        (a.name, type(named[a.name]))
        for a in call.func._schema.arguments
        if str(a.type) == "number" and isinstance(named.get(a.name), (bool, int, float)) and a.name in named
    ]


def _value(kind: type):
    if kind is bool:
        return st_.booleans()
    if kind is int:
        return st_.integers(-3, 3)
    return st_.sampled_from([0.0, 1.0, -2.5, 0.5, math.inf, -math.inf, 1e-3])


@pytest.fixture(scope="module")
def scalar_calls(calls):
    return [c for c in calls if _numbers(c) and not c.shapes_only] + [
        rc.SampleCall(aten.constant_pad_nd.default, (torch.randn(2, 3, dtype=torch.float64), [1, 1], 0.0), {}),
        rc.SampleCall(aten.linalg_vector_norm.default, (torch.randn(4, 3, dtype=torch.float64), 2.0, [0]), {}),
    ]


def _decision(call: rc.SampleCall, layouts, values: dict, p):
    """(key, decision or the reason there is none) of ``call`` with its tensors global in ``layouts`` (no data) and
    its numbers replaced by ``values``."""

    def make_global(slot, t):
        return GlobalTensor(torch.empty(0, dtype=t.dtype), GlobalMeta(tuple(t.shape), t.dtype, p, layouts[slot]))

    args, kwargs = rc._with_tensors(call, make_global)
    names = rc.op_schema(call.func).names
    args = [values.get(names[i], a) for i, a in enumerate(args)]
    kwargs = {k: values.get(k, v) for k, v in kwargs.items()}
    bound = BoundCall(call.func, args, kwargs)
    try:
        decision = decide(bound)
        return bound.key, (decision.input_sbps, decision.outputs, decision.signatures)
    except NoSignature as why:
        return bound.key, str(why)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st_.data())
def test_one_key_never_maps_to_two_decisions(scalar_calls, data):
    """Numbers a rule does not read are keyed by type: any two calls that differ only in them must decide alike."""
    call = data.draw(st_.sampled_from(scalar_calls))
    p = st.placement("cpu", data.draw(st_.sampled_from([[0, 1], [[0, 1], [2, 3]]])))
    slots = rc.tensor_slots(call)
    layouts = {
        s: tuple(data.draw(st_.sampled_from(rc._candidates(rc._tensor_at(call, s)))) for _ in range(p.ndim))
        for s in slots
    }
    if any(len({x.op for x in sbp if isinstance(x, Partial)}) > 1 for sbp in layouts.values()):
        return
    numbers = _numbers(call)
    first = {name: data.draw(_value(kind)) for name, kind in numbers}
    second = {name: data.draw(_value(kind)) for name, kind in numbers}
    key, decided = _decision(call, layouts, first, p)
    other_key, other = _decision(call, layouts, second, p)
    if key == other_key:
        assert decided == other, f"{call}: {first} and {second} share a key but decide {decided} and {other}"


def test_the_pad_value_and_the_norm_order_are_in_the_key():
    p = st.placement("cpu", [0, 1])
    x = GlobalTensor(torch.empty(0), GlobalMeta((2, 3), torch.float32, p, (Partial("sum"),)))
    keys = {
        call_key(aten.constant_pad_nd.default, rc.op_schema(aten.constant_pad_nd.default), (x, [1], v), {})
        for v in (0.0, 1.0)
    }
    assert len(keys) == 2
    norm = aten.linalg_vector_norm.default
    keys = {call_key(norm, rc.op_schema(norm), (x, o, [0]), {}) for o in (2.0, math.inf)}
    assert len(keys) == 2
    lr_keys = {call_key(aten.mul.Scalar, rc.op_schema(aten.mul.Scalar), (x, lr), {}) for lr in (0.1, 0.01)}
    assert len(lr_keys) == 1, "a number no rule reads is keyed by type"
    assert B == broadcast
