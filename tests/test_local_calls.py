"""Local calls (``_frontend/_local_calls.py``): torch functions that autograd does not record, run on the local parts.

Each test runs the calls on a real gloo world and compares with the same calls on plain tensors in one
process; it also checks that the local call was (or, for views, composites that read a shape, and calls
that touch the wrapper itself, was not) taken, so that a test of the fast path cannot pass on the slow one.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._frontend import _local_calls
from sbp_torch._layout import GlobalMeta, normalize_sbp
from sbp_torch.sbp import broadcast, partial_max, partial_sum, split

from reference import assemble, random_parts
from world import run_on_world

pytestmark = pytest.mark.gloo

PLACEMENTS = [[0, 1, 2], [2, 0], [1], [[0, 1], [2, 3]], [[3, 1], [0, 2]]]

# name -> (number of inputs, function); each is called three times on the same inputs, in-place ones too.
OPS = {
    "add": (2, lambda a, b: a + b),
    "mul_float": (1, lambda a: a * 0.5),
    "add_float": (1, lambda a: a + 1.5),
    "relu": (1, torch.relu),
    "gelu": (1, F.gelu),
    "exp": (1, torch.exp),
    "sum_dim": (1, lambda a: a.sum(dim=-1)),
    "mean": (1, lambda a: a.mean()),
    "softmax": (1, lambda a: torch.softmax(a, dim=-1)),
    "layer_norm": (1, lambda a: F.layer_norm(a, (a.shape[-1],))),
    "cat": (2, lambda a, b: torch.cat([a, b], dim=0)),
    "flatten": (1, torch.flatten),
    "reshape": (1, lambda a: a.reshape(-1)),
    "transpose": (1, lambda a: a.transpose(0, 1)),
    "clone": (1, torch.clone),
    "add_": (2, lambda a, b: a.add_(b)),
    "mul_": (1, lambda a: a.mul_(0.9)),
    "lerp_": (2, lambda a, b: a.lerp_(b, 0.25)),
    "foreach_mul": (2, lambda a, b: torch._foreach_mul([a, b], 3.0)),
    "foreach_add_": (2, lambda a, b: torch._foreach_add_([a, b], [b, a], alpha=0.5)),
}


def _world(ranks) -> int:
    return 4 if isinstance(ranks[0], list) else 3


def _inputs(ranks, shape, sbps, seed):
    p = st.placement("cpu", ranks)
    out = []
    for i, sbp in enumerate(sbps):
        meta = GlobalMeta(shape, torch.float64, p, normalize_sbp(sbp, p, len(shape), torch.float64))
        out.append((meta, random_parts(meta, torch.Generator().manual_seed(seed + i))))
    return p, out


def _full(result):
    """The full values, copied: full_tensor() of a broadcast tensor is its part, which in-place ops change."""
    if isinstance(result, (list, tuple)):
        return [t.full_tensor().clone() for t in result]
    return result.full_tensor().clone()


def calls_body(ranks, name, shape, sbps, seed):
    """Every rank: the op three times under no_grad (seen, learnt, run as a local call); the full values of
    each result, and how many local calls were learnt."""
    p, inputs = _inputs(ranks, shape, sbps, seed)
    coord = p.coord_of(dist.get_rank())
    globals_ = [
        (parts[coord].clone() if coord is not None else torch.empty(0, dtype=torch.float64)).to_global(p, meta.sbp)
        for meta, parts in inputs
    ]
    fn = OPS[name][1]
    learnt_before = _learnt()
    with torch.no_grad():
        results = [_full(fn(*globals_)) for _ in range(3)]
    return results, _learnt() - learnt_before


def _learnt() -> int:
    return sum(isinstance(v, _local_calls.LocalCall) for v in _local_calls.LOCAL_CALLS.entries())


@st_.composite
def cases(draw):
    ranks = draw(st_.sampled_from(PLACEMENTS))
    axes = 2 if isinstance(ranks[0], list) else 1
    name = draw(st_.sampled_from(sorted(OPS)))
    shape = tuple(draw(st_.lists(st_.integers(1, 5), min_size=2, max_size=3)))
    choices = [split(d) for d in range(len(shape))] + [broadcast, partial_sum, partial_max]
    sbps = [tuple(draw(st_.sampled_from(choices)) for _ in range(axes)) for _ in range(OPS[name][0])]
    return ranks, name, shape, sbps, draw(st_.integers(0, 2**16))


@settings(max_examples=40)
@given(cases())
def test_repeated_calls_match_one_process(case):
    """Learnt or not, the first, second and third call of an op give what plain torch gives: the first
    takes the dispatch path, the second learns (when the call qualifies), the third is a local call."""
    ranks, name, shape, sbps, seed = case
    results = run_on_world(_world(ranks), calls_body, ranks, name, shape, sbps, seed)
    p, inputs = _inputs(ranks, shape, sbps, seed)
    logical = [assemble(parts, p.shape, meta.sbp) for meta, parts in inputs]
    fn = OPS[name][1]
    want = []
    with torch.no_grad():
        for _ in range(3):  # (cloned at once: an in-place op returns its input, which the next call changes)
            w = fn(*logical)
            want.append([t.clone() for t in w] if isinstance(w, (list, tuple)) else w.clone())
    for rank, (got, _) in enumerate(results):
        if p.coord_of(rank) is None:
            continue
        for k in range(3):
            torch.testing.assert_close(got[k], want[k], msg=f"{name} call {k} on rank {rank}")


def expected_learning_body(name, sbp_name):
    p = st.placement("cpu", [0, 1])
    sbp = {"S0": (split(0),), "B": (broadcast,), "P": (partial_sum,)}[sbp_name]
    a, b = (torch.randn(5, 3).to_global(p, sbp) for _ in range(2))
    fn = OPS[name][1]
    before = _learnt()
    with torch.no_grad():
        for _ in range(3):
            fn(*(a, b)[: OPS[name][0]])
    return _learnt() - before


@pytest.mark.parametrize(
    "name, sbp, learnt",
    [
        ("add", "S0", 1),
        ("mul_float", "P", 1),
        ("softmax", "S0", 1),
        ("add_", "S0", 1),
        ("lerp_", "B", 1),
        ("foreach_mul", "S0", 1),
        ("foreach_add_", "S0", 1),
        ("add_float", "P", 0),  # P + 1.5 boxes the partial sum first
        ("transpose", "S0", 0),  # a view: the dispatch path makes it an autograd view of its base
        ("reshape", "S0", 0),  # its size comes from the logical shape; the local call would get 3 rows, not 5
        ("softmax", "P", 0),  # needs the reduced values
    ],
)
def test_which_calls_are_learnt(name, sbp, learnt):
    assert run_on_world(2, expected_learning_body, name, sbp) == [learnt, learnt]


def version_body():
    """A tensor saved for backward and then changed in place by a local call must still fail the backward."""
    p = st.placement("cpu", [0, 1])
    x = torch.randn(4, 3).to_global(p, (split(0),))
    w = torch.randn(4, 3, requires_grad=True).to_global(p, (split(0),))
    before = _learnt()
    with torch.no_grad():
        x.add_(1.0)
        x.add_(1.0)  # learnt here
    y = (x * w).sum()  # saves x
    with torch.no_grad():
        x.add_(1.0)  # a local call
    assert _learnt() - before == 1
    try:
        y.backward()
    except RuntimeError as err:
        return "modified by an inplace operation" in str(err)
    return False


def test_in_place_local_calls_bump_the_version():
    assert run_on_world(2, version_body) == [True, True]


def grad_after_learning_body():
    """A key learnt under no_grad must not serve a call that autograd records."""
    p = st.placement("cpu", [0, 1])
    torch.manual_seed(1)
    full = torch.randn(6, 4, dtype=torch.float64)
    x = full[3 * dist.get_rank() : 3 * dist.get_rank() + 3].clone().requires_grad_()
    g = x.to_global(p, (split(0),))
    with torch.no_grad():
        for _ in range(3):
            torch.tanh(g)
    y = torch.tanh(g)
    y.sum().backward()
    h = torch.zeros(6, 4).to_global(p, (split(0),))
    for flag in (True, False, True):  # (a setter that dispatches nothing: it must act on the wrapper each time)
        h.requires_grad_(flag)
    return y.requires_grad, x.grad, h.requires_grad


def test_learnt_keys_do_not_serve_autograd():
    results = run_on_world(2, grad_after_learning_body)
    torch.manual_seed(1)
    full = torch.randn(6, 4, dtype=torch.float64)
    want = 1 - torch.tanh(full) ** 2
    for rank, (requires_grad, grad, wrapper_requires_grad) in enumerate(results):
        assert requires_grad and wrapper_requires_grad
        torch.testing.assert_close(grad, want[3 * rank : 3 * rank + 3])


def dropout_body():
    """dropout(p=0) returns its input; a later p=0.5 must still drop (floats are keyed by value): the same
    values as with local calls off, where every call takes the dispatch path."""
    p = st.placement("cpu", [0, 1])
    x = st.ones(6, 4, placement=p, sbp=(split(0),))
    with torch.no_grad():
        for _ in range(3):
            F.dropout(x, 0.0)
        results = []
        for enabled in (True, False):
            _local_calls.ENABLED = enabled
            try:
                torch.manual_seed(7)
                results.append(F.dropout(x, 0.5).full_tensor())
            finally:
                _local_calls.ENABLED = True
    return results


def test_a_float_that_changes_what_a_composite_does_is_keyed_by_value():
    for with_local_calls, without in run_on_world(2, dropout_body):
        torch.testing.assert_close(with_local_calls, without)
        assert 0 < int((with_local_calls == 0).sum()) < with_local_calls.numel()


def mixed_body():
    p = st.placement("cpu", [0, 1])
    x = torch.randn(4, 3).to_global(p, (split(0),))
    errors = 0
    with torch.no_grad():
        x + x
        for _ in range(3):
            try:
                x + torch.ones(4, 3)
            except st.MixedTensorError:
                errors += 1
    return errors


def test_mixing_a_plain_tensor_still_raises():
    assert run_on_world(2, mixed_body) == [3, 3]


def adamw_body(foreach, steps):
    """AdamW with a learning rate that changes every step, on data-parallel (broadcast) parameters."""
    p = st.placement("cpu", [0, 1])
    torch.manual_seed(3)
    plain = [torch.randn(5, 3), torch.randn(3), torch.randn(2, 2)]
    params = [torch.nn.Parameter(t.clone().to_global(p, (broadcast,))) for t in plain]
    opt = torch.optim.AdamW(params, lr=0.1, foreach=foreach)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    learnt = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        for param in params:
            param.grad = torch.randn(param.shape).to_global(p, (broadcast,))
        opt.step()
        schedule.step()
        learnt.append(len(_local_calls.LOCAL_CALLS))
    return [param.detach().full_tensor() for param in params], learnt


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_with_a_changing_learning_rate(foreach):
    steps = 5
    results = run_on_world(2, adamw_body, foreach, steps)
    torch.manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(5, 3)),
        torch.nn.Parameter(torch.randn(3)),
        torch.nn.Parameter(torch.randn(2, 2)),
    ]
    opt = torch.optim.AdamW(params, lr=0.1, foreach=foreach)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for step in range(steps):
        torch.manual_seed(10 + step)
        for param in params:
            param.grad = torch.randn(param.shape)
        opt.step()
        schedule.step()
    for got, learnt in results:
        for g, want in zip(got, params):
            torch.testing.assert_close(g, want.detach())
        assert learnt[1] == learnt[-1], f"keys kept growing with the step: {learnt}"


def foreach_in_place_body():
    """An in-place foreach op returns its own list and bumps each tensor's version, on every path."""
    p = st.placement("cpu", [0, 1])
    a, b = (torch.randn(5, 3).to_global(p, (split(0),)) for _ in range(2))
    seen = []
    with torch.no_grad():
        for _ in range(3):  # the dispatch path, the learning call, a local call
            tensors, before = [a, b], (a._version, b._version)
            out = torch._foreach_add_(tensors, 1.0)
            seen.append((out is tensors, a._version - before[0], b._version - before[1]))
    return seen


def test_in_place_foreach_returns_its_list_and_bumps_versions():
    for seen in run_on_world(2, foreach_in_place_body):
        assert seen == [(True, 1, 1)] * 3


def _plainly(result):
    """A call's result as plain tensors that can leave the rank: None, a full tensor, or a list of them."""
    if isinstance(result, (list, tuple)):
        return [_plainly(r) for r in result]
    return None if result is None else result.full_tensor().detach()


def native_local_body():
    import sys

    from sbp_torch._frontend import _torch_function, python_handlers

    p = st.placement("cpu", [0, 1])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 4, generator=gen).to_global(p, broadcast).to_global(sbp=split(0))
    y = torch.randn(5, 4, generator=gen).to_global(p, broadcast).to_global(sbp=split(0))
    w = torch.randn(4, generator=gen).to_global(p, broadcast).requires_grad_()
    cases = [
        lambda: x + y,  # a new tensor
        lambda: torch.mul(x, 0.5),  # a float keyed by type
        lambda: x.sum(dim=0),  # a keyword argument
        lambda: x * torch.tensor(2.0),  # a plain 0-dim tensor
        lambda: y.mul_(1.0),  # in place: returns its argument, bumps its version
        lambda: torch._foreach_mul_([x, y], 1.0),  # returns None, bumps a list
        lambda: torch._foreach_add([x, y], 1.0),  # a list of outputs: the Python path
        lambda: (x * w).sum(),  # autograd records it: below autograd
        lambda: x.transpose(0, 1),  # a view: never a local call
    ]
    python = functools.partial(python_handlers, dispatch=False)
    results, counts, versions, entered = {}, {}, {}, {}
    for name, handlers in (("python", python), ("c", contextlib.nullcontext)):
        calls = []

        def profiler(frame, event, arg):
            if event == "call" and frame.f_code is _local_calls.call.__code__:
                calls.append(None)

        with handlers():
            st.cache_clear()
            _local_calls.DISPATCH_ONLY.clear()
            with torch.no_grad():
                x.copy_(torch.ones(5, 4).to_global(p, broadcast))
                y.copy_(torch.full((5, 4), 2.0).to_global(p, broadcast))
            start = [x._version, y._version]
            out = []
            for fn in cases:
                for _ in range(3):  # a first sight, the learning call, then the local call
                    out.append(_plainly(fn()))
            results[name] = out
            counts[name] = st.cache_info()
            versions[name] = [x._version - start[0], y._version - start[1]]
            with pytest.raises(st.MixedTensorError):
                x + torch.ones(5, 4)  # a plain tensor with dims from user code
            sys.setprofile(profiler)
            x + y  # a learnt local call
            sys.setprofile(None)
            entered[name] = len(calls)
    return _torch_function._EAGER is not None, results, counts, versions, entered


def test_the_c_local_calls_answer_as_the_python_ones():
    """The local calls' hit path in C (``csrc/local_calls_hit.c``) is in use, answers a learnt call without entering
    Python's ``call``, and gives the values, cache counts and version bumps the Python path gives."""
    for native, results, counts, versions, entered in run_on_world(2, native_local_body):
        assert native, "the C hit paths are not built (setup.py builds them wherever a C compiler is)"
        for want, got in zip(results["python"], results["c"]):
            if want is None or got is None:
                assert want is got
            elif isinstance(want, list):
                for a, b in zip(want, got):
                    torch.testing.assert_close(b, a, rtol=0, atol=0)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert counts["c"] == counts["python"]
        assert versions["c"] == versions["python"]
        assert entered == {"python": 1, "c": 0}


def hostile_arguments_body():
    p = st.placement("cpu", [0])
    x = torch.randn(4, 4).to_global(p, broadcast)
    arguments = []

    class ClearsTheList:
        @property
        def __class__(self):  # read by isinstance while the argument is walked
            arguments.clear()
            return ClearsTheList

    arguments.extend([ClearsTheList()] + [object() for _ in range(50)])
    ran = torch.overrides.handle_torch_function(lambda *a: "ran", (x,), x, arguments)
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(RecursionError):
        torch.overrides.handle_torch_function(lambda *a: "ran", (x,), x, nested)
    return ran


def test_arguments_that_change_or_nest_deeply_are_walked_safely():
    """An argument list that a walked element changes, and a list nested 100000 deep: the C walk over a snapshot,
    within Python's recursion limit, as Python's own walk (either once crashed the process)."""
    assert run_on_world(1, hostile_arguments_body) == ["ran"]
