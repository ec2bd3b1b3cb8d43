"""Dispatch modes (strict mode, implicit broadcast) hold per thread and per context, and nest; and an op call
is bound to its schema once (``BoundCall``): where its global tensors are, what it reads and writes."""

from __future__ import annotations

import threading

import pytest
import torch

import sbp_torch as st
from sbp_torch._dispatch import BoundCall
from sbp_torch._dispatch._modes import IMPLICIT_BROADCAST, STRICT
from sbp_torch._layout import GlobalMeta
from sbp_torch._tensor import GlobalTensor
from sbp_torch.sbp import broadcast, split

from world import run_on_world

aten = torch.ops.aten


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join()
    return out["value"]


def test_a_mode_set_in_one_thread_does_not_reach_another():
    with st.strict(), st.implicit_broadcast():
        assert STRICT.get() and IMPLICIT_BROADCAST.get()
        assert _in_thread(lambda: (STRICT.get(), IMPLICIT_BROADCAST.get())) == (False, False)
    assert not STRICT.get() and not IMPLICIT_BROADCAST.get()


def test_modes_nest_and_restore():
    with st.strict():
        with st.strict(False):
            assert not STRICT.get()
        assert STRICT.get()
        with st.implicit_broadcast(), st.implicit_broadcast():
            assert IMPLICIT_BROADCAST.get()
        assert not IMPLICIT_BROADCAST.get()
    assert not STRICT.get()


def _strict_per_thread() -> tuple:
    """median has no rule: in strict mode it raises; another thread at the same moment still takes the fallback.
    (Each rank's ``arange(6)`` is its part: the logical tensor holds it twice.)"""
    g = torch.arange(6.0).to_global(st.placement("cpu", [0, 1]), split(0))
    with st.strict():
        other = _in_thread(lambda: torch.median(g).full_tensor())
        try:
            torch.median(g)
            raised = False
        except NotImplementedError:
            raised = True
    return raised, other


@pytest.mark.gloo
def test_strict_mode_holds_in_its_thread_only():
    for raised, other in run_on_world(2, _strict_per_thread):
        assert raised
        torch.testing.assert_close(other, torch.median(torch.arange(6.0).repeat(2)))


def _global(shape, placement=None) -> GlobalTensor:
    """A global tensor's wrapper with its metadata and an empty part: binding reads only the metadata."""
    placement = placement or st.placement("cpu", [0])
    return GlobalTensor(torch.empty(0), GlobalMeta(shape, torch.float32, placement, (broadcast,)))


def test_a_call_is_bound_once_with_slots_reads_and_writes():
    x, y, out = _global((2, 3)), _global((2, 3)), _global((2, 3))
    bound = BoundCall(aten.add.out, (x, y), {"alpha": 2, "out": out})
    assert bound.slots == ((0, None), (1, None), ("out", None))
    assert bound.inputs == (0, 1) and bound.outs == (2,) and bound.written == (2,)
    assert bound.by_name == {"self": x, "other": y, "alpha": 2, "out": out}

    cat = BoundCall(aten.cat.default, ([x, y],), {})
    assert cat.slots == ((0, 0), (0, 1)) and cat.by_name["dim"] == 0

    plain = torch.ones(2, 3)
    assert BoundCall(aten.mul.Tensor, (x, plain), {}).plain == [plain]


def test_batch_norm_writes_its_running_statistics_only_in_training():
    x, mean, var = _global((4, 3)), _global((3,)), _global((3,))
    args = (x, None, None, mean, var)
    assert BoundCall(aten.native_batch_norm.default, (*args, True, 0.1, 1e-5), {}).written == (1, 2)
    assert BoundCall(aten.native_batch_norm.default, (*args, False, 0.1, 1e-5), {}).written == ()


def test_numbers_typed_scalar_key_by_type_others_by_value():
    """A learning rate that changes every step keys alike; a dim does not."""
    x = _global((2, 3))
    assert BoundCall(aten.mul.Scalar, (x, 0.1), {}).key == BoundCall(aten.mul.Scalar, (x, 0.2), {}).key
    assert BoundCall(aten.sum.dim_IntList, (x, [0]), {}).key != BoundCall(aten.sum.dim_IntList, (x, [1]), {}).key
