"""Torch ops on global tensors against the same ops on plain tensors in one process.

Ops with a layout rule run part by part and keep their inputs' layout; every other op falls back to running
on broadcast (gathered) inputs, with a one-time warning. Either way the logical value and the gradient must be
what plain torch gives on the logical tensors, which the driver computes from the same local parts with
``reference.assemble``.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch import gradient_sbp
from sbp_torch._dispatch import _fallback
from sbp_torch._layout import GlobalMeta, normalize_sbp
from sbp_torch.sbp import broadcast, partial_max, partial_min, partial_sum, split

from reference import assemble, expected_region, random_parts
from world import run_on_world

pytestmark = pytest.mark.gloo

SIMPLE = [broadcast, partial_sum, partial_max, partial_min]


def _world(ranks) -> int:
    """1-D placements run on a world of 3 (so [2, 0] and [1] leave ranks outside); meshes on 4."""
    return 4 if isinstance(ranks[0], list) else 3


def _inputs(ranks, specs, seed):
    """For each (shape, sbp) in ``specs``: (meta, random local parts by coordinate) of a float64 tensor."""
    p = st.placement("cpu", ranks)
    out = []
    for i, (shape, sbp) in enumerate(specs):
        meta = GlobalMeta(tuple(shape), torch.float64, p, normalize_sbp(sbp, p, len(shape), torch.float64))
        out.append((meta, random_parts(meta, torch.Generator().manual_seed(seed + i))))
    return p, out


def _weight(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)


def _global_inputs(ranks, specs, seed):
    """Every rank: its parts of the inputs, as leaves, and the global tensors made from them."""
    p, inputs = _inputs(ranks, specs, seed)
    coord = p.coord_of(dist.get_rank())
    leaves = [
        (parts[coord].clone() if coord is not None else torch.empty(0, dtype=torch.float64)).requires_grad_()
        for _, parts in inputs
    ]
    return p, leaves, [x.to_global(p, meta.sbp) for x, (meta, _) in zip(leaves, inputs)]


# ---------------------------------------------------------------------------------------------------------
# Ops on random layouts: value, gradient and the path each op took


def op_matmul(a, b):
    return a @ b


def op_sum(a):
    return a.sum()


def op_sum_dim(a):
    return a.sum(dim=0)


def op_softmax(a):
    return torch.softmax(a, dim=-1)


def op_mean_of_exp(a):
    return a.exp().mean(dim=-1, keepdim=True)


def op_cumprod(a):
    return a.cumprod(dim=0)  # no rule: the fallback, forward and backward


OPS = {f.__name__: f for f in (op_matmul, op_sum, op_sum_dim, op_softmax, op_mean_of_exp, op_cumprod)}
FALLBACK_OPS = {"op_cumprod"}


def op_body(ranks, name, specs, seed):
    """Every rank: out = op(*globals); returns (out's sbp, full_tensor(out), gradients of this rank's parts of
    sum(full_tensor(out) * W), whether strict mode refused the op). The ops with rules run in strict mode, so a
    fallback would raise; the fallback ops are first run in strict mode to show that they take the fallback."""
    p, leaves, globals_ = _global_inputs(ranks, specs, seed)
    refused = False
    if name in FALLBACK_OPS:
        try:
            with st.strict():
                OPS[name](*globals_)
        except NotImplementedError:
            refused = True
    with contextlib.nullcontext() if name in FALLBACK_OPS else st.strict(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = OPS[name](*globals_)
        full = out.full_tensor()
        if p.coord_of(dist.get_rank()) is not None:
            (full * _weight(full.shape, seed)).sum().backward()
    return out.sbp, full.detach(), [x.grad for x in leaves], refused


def check_op(ranks, name, specs, seed=0):
    results = run_on_world(_world(ranks), op_body, ranks, name, specs, seed)
    p, inputs = _inputs(ranks, specs, seed)
    leaves = [{c: t.clone().requires_grad_() for c, t in parts.items()} for _, parts in inputs]
    logical = [assemble(parts, p.shape, meta.sbp) for parts, (meta, _) in zip(leaves, inputs)]
    want = OPS[name](*logical)
    (want * _weight(want.shape, seed)).sum().backward()
    for rank, (out_sbp, full, grads, refused) in enumerate(results):
        coord = p.coord_of(rank)
        assert len(out_sbp) == p.ndim
        assert refused == (name in FALLBACK_OPS), f"{name}: strict mode refused it: {refused}"
        if coord is None:
            assert full.numel() == 0
            continue
        torch.testing.assert_close(full, want.detach(), msg=f"{name} value on rank {rank}")
        for i, (grad, parts) in enumerate(zip(grads, leaves)):
            torch.testing.assert_close(grad, parts[coord].grad, msg=f"{name} gradient of input {i} on rank {rank}")


PLACEMENTS = [[0, 1, 2], [2, 0], [1], [[0, 1], [2, 3]], [[3, 1], [0, 2]]]


@st_.composite
def op_cases(draw):
    ranks = draw(st_.sampled_from(PLACEMENTS))
    axes = 2 if isinstance(ranks[0], list) else 1
    name = draw(st_.sampled_from(sorted(OPS)))
    size = st_.integers(1, 5)
    if name == "op_matmul":
        m, k, n = draw(size), draw(size), draw(size)
        shapes = [(m, k), (k, n)]
    else:
        shapes = [tuple(draw(st_.lists(size, min_size=2, max_size=3)))]

    def layout(ndim):
        return tuple(draw(st_.sampled_from([split(d) for d in range(ndim)] + SIMPLE)) for _ in range(axes))

    specs = [(shape, layout(len(shape))) for shape in shapes]
    return ranks, name, specs, draw(st_.integers(0, 2**16))


@settings(max_examples=30)
@given(op_cases())
def test_ops_on_random_layouts_value_and_gradient(case):
    """matmul, sum, softmax, ... on random layouts (partial ones too, ranks outside the placement too) give
    plain torch's logical value through their rules (strict mode), ``cumprod`` through the fallback, and the
    gradients of the local parts match the single-process reference."""
    check_op(*case)


@pytest.mark.parametrize(
    "ranks,name,specs",
    [
        ([0, 1, 2], "op_matmul", [((5, 4), split(0)), ((4, 3), split(1))]),
        ([0, 1, 2], "op_matmul", [((2, 5), split(1)), ((5, 3), partial_sum)]),
        ([[0, 1], [2, 3]], "op_matmul", [((3, 4), (split(0), split(1))), ((4, 2), (partial_max, broadcast))]),
        ([0, 1, 2], "op_sum", [((7, 2), split(0))]),
        ([[0, 1], [2, 3]], "op_sum_dim", [((3, 5), (partial_sum, split(1)))]),
        ([2, 0], "op_softmax", [((4, 5), split(1))]),
        ([0, 1, 2], "op_softmax", [((3, 4), partial_min)]),
        ([0, 1, 2], "op_cumprod", [((5, 2), split(0))]),
        ([[0, 1], [2, 3]], "op_cumprod", [((3, 4), (partial_sum, split(1)))]),
    ],
    ids=str,
)
def test_ops_on_random_layouts_fixed_cases(ranks, name, specs):
    """Fixed cases of the above, easy to reproduce."""
    check_op(ranks, name, specs, seed=5)


# ---------------------------------------------------------------------------------------------------------
# Layout-keeping rules


def rules_body():
    """Every rank: ops that have a layout rule; returns (sbp, full value) per case."""
    p = st.placement("cpu", [0, 1, 2])
    rank = dist.get_rank()
    a = torch.arange(14.0).reshape(7, 2)
    b = torch.arange(14.0).reshape(7, 2) * 0.5 - 2
    mine = torch.arange(6.0).reshape(2, 3) + rank  # a different part on every rank
    s_a, s_b = st.tensor(a.tolist(), placement=p, sbp=split(0)), st.tensor(b.tolist(), placement=p, sbp=split(0))
    part = mine.to_global(p, partial_sum)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {
            "S+S": s_a + s_b,
            "S-S": s_a - s_b,
            "S*S": s_a * s_b,
            "S+S alpha": torch.add(s_a, s_b, alpha=3),
            "S*2": s_a * 2,
            "-P": -part,
            "P*2.5": part * 2.5,
            "P/4": part / 4,
            "P*0dim": part * torch.tensor(3.0),
            "P+P": part + part,
            "P-2P": part - part * 2,
            "P+1": part + 1,
            "1-P": 1 - part,
            "P*P": part * part,
            "P+S": part + part.to_global(sbp=split(1)),
            "S+P": part.to_global(sbp=split(1)) + part,
        }
        for name, g in cases.items():
            out[name] = (g.sbp, g.full_tensor())
    return out


def test_layout_keeping_rules():
    """Element-wise ops on equal layouts keep them (split + split is split, no collective needed); scaling a
    partial sum (neg, mul/div by a number or 0-dim tensor) and adding partial sums stay partial sums; ops that
    do not commute with the partial sum (adding a number, products of partials) still give the right value."""
    results = run_on_world(3, rules_body)
    a = torch.arange(14.0).reshape(7, 2)
    b = a * 0.5 - 2
    x = sum(torch.arange(6.0).reshape(2, 3) + r for r in range(3))  # the partial sum's logical value
    want = {
        "S+S": (a + b, (split(0),)),
        "S-S": (a - b, (split(0),)),
        "S*S": (a * b, (split(0),)),
        "S+S alpha": (a + 3 * b, (split(0),)),
        "S*2": (a * 2, (split(0),)),
        "-P": (-x, (partial_sum,)),
        "P*2.5": (x * 2.5, (partial_sum,)),
        "P/4": (x / 4, (partial_sum,)),
        "P*0dim": (x * 3, (partial_sum,)),
        "P+P": (x + x, (partial_sum,)),
        "P-2P": (-x, None),
        "P+1": (x + 1, None),
        "1-P": (1 - x, None),
        "P*P": (x * x, None),
        "P+S": (x + x, None),
        "S+P": (x + x, None),
    }
    for rank, got in enumerate(results):
        for name, (value, sbp) in want.items():
            got_sbp, full = got[name]
            if sbp is not None:
                assert got_sbp == sbp, f"{name}: {got_sbp}"
            torch.testing.assert_close(full, value, msg=f"{name} on rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# In-place ops


def inplace_body():
    """Every rank: in-place ops on global tensors of several layouts; returns (same object, sbp, local, full)."""
    p = st.placement("cpu", [0, 1, 2])
    rank = dist.get_rank()
    a = torch.arange(15.0).reshape(5, 3) - 7
    h = st.tensor((a * 0.25).tolist(), placement=p, sbp=broadcast)
    out = {}

    def run(name, sbp, op, path="rule"):
        """``op(g, h)`` through ``path``: a rule (strict mode, where a fallback would raise) or the fallback (which
        strict mode must refuse first)."""

        def fresh():
            if isinstance(sbp, type(partial_sum)):  # rank r holds a + r
                return (a + rank).to_global(p, sbp)
            return st.tensor(a.tolist(), placement=p, sbp=sbp)

        g = fresh()
        if path == "fallback":
            with st.strict(), pytest.raises(NotImplementedError, match="would run on gathered inputs"):
                op(fresh(), h)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = op(g, h)
        else:
            with st.strict():
                result = op(g, h)
        out[name] = (result is g, g.sbp, g.to_local().clone(), g.full_tensor())

    run("S0.add_(B)", split(0), lambda g, h: g.add_(h))
    run("S1.sub_(P)", split(1), lambda g, h: g.sub_(h.to_global(sbp=partial_sum)))
    run("B.mul_(S0)", broadcast, lambda g, h: g.mul_(h.to_global(sbp=split(0))))
    run("P.mul_(2)", partial_sum, lambda g, h: g.mul_(2))
    run("P.mul_(B)", partial_sum, lambda g, h: g.mul_(h))  # a partial sum scaled by a broadcast factor
    run("P.add_(1)", partial_sum, lambda g, h: g.add_(1), "fallback")  # a number added to each part would count n times
    run("S1.clamp_", split(1), lambda g, h: g.clamp_(-3, 4))
    run("Pmax.clamp_", partial_max, lambda g, h: g.clamp_(min=-2))
    run("S0.exp_", split(0), lambda g, h: g.div_(10).exp_())
    run("S0.cumprod_", split(0), lambda g, h: g.div_(10).cumprod_(0), "fallback")  # no rule for cumprod_
    return out


def test_inplace_ops_keep_self_layout():
    """In-place ops with a rule (the other operand boxed to self's layout) and in-place ops that take the fallback
    (a number added to a partial sum, ``cumprod_``) return self, keep self's SBP and local region, and give the
    right value."""
    results = run_on_world(3, inplace_body)
    p = st.placement("cpu", [0, 1, 2])
    a = torch.arange(15.0).reshape(5, 3) - 7
    x_sum, x_max = sum(a + r for r in range(3)), a + 2
    want = {
        "S0.add_(B)": (a + a * 0.25, split(0)),
        "S1.sub_(P)": (a - a * 0.25, split(1)),
        "B.mul_(S0)": (a * a * 0.25, broadcast),
        "P.mul_(2)": (x_sum * 2, partial_sum),
        "P.mul_(B)": (x_sum * a * 0.25, partial_sum),
        "P.add_(1)": (x_sum + 1, partial_sum),
        "S1.clamp_": (a.clamp(-3, 4), split(1)),
        "Pmax.clamp_": (x_max.clamp(min=-2), partial_max),
        "S0.exp_": ((a / 10).exp(), split(0)),
        "S0.cumprod_": ((a / 10).cumprod(0), split(0)),
    }
    for rank, got in enumerate(results):
        for name, (value, sbp) in want.items():
            same, got_sbp, local, full = got[name]
            assert same, f"{name} did not return self"
            assert got_sbp == (sbp,), f"{name}: self's sbp changed to {got_sbp}"
            torch.testing.assert_close(full, value, msg=f"{name} on rank {rank}")
            meta = GlobalMeta(tuple(value.shape), value.dtype, p, (sbp,))
            if isinstance(sbp, type(partial_sum)):
                parts = {(r,): results[r][name][2] for r in range(3)}
                torch.testing.assert_close(assemble(parts, p.shape, (sbp,)), value, msg=name)
            else:
                torch.testing.assert_close(local, expected_region(value, meta, (rank,)), msg=name)


# ---------------------------------------------------------------------------------------------------------
# Gradient accumulation


def accumulation_body(ranks, sbp):
    """Every rank: a global leaf used several times in one loss (rule ops, fallback ops, full_tensor), then a
    second backward that accumulates."""
    p = st.placement("cpu", ranks)
    torch.manual_seed(11)
    g = st.randn(4, 3, placement=p, sbp=sbp, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = lambda: (g * 2).sum() + (g * g).sum() + g.full_tensor().sum()  # noqa: E731
        loss().backward()
        first = (g.grad.sbp, g.grad.full_tensor().clone())
        loss().backward()
        second = (g.grad.sbp, g.grad.full_tensor())
    return g.full_tensor().detach(), first, second


@pytest.mark.parametrize(
    "ranks,sbp",
    [
        ([0, 1, 2], split(0)),
        ([0, 1, 2], broadcast),
        ([0, 1, 2], partial_sum),
        ([[0, 1], [2, 3]], (split(1), broadcast)),
    ],
    ids=str,
)
def test_gradient_accumulation_keeps_layout(ranks, sbp):
    """A leaf used three times gets the sum of the three gradients (2 + 2g + 1), laid out as its gradient
    layout; a second backward adds the same again without changing the layout. (The loss adds a plain 0-dim
    tensor from ``full_tensor`` to global ones, so that gradient reaches ``full_tensor`` as a global tensor.)"""
    p = st.placement("cpu", ranks)
    results = run_on_world(_world(ranks), accumulation_body, ranks, sbp)
    want_sbp = gradient_sbp(normalize_sbp(sbp, p, 2, torch.float64))
    for value, (sbp1, grad1), (sbp2, grad2) in results:
        assert sbp1 == want_sbp and sbp2 == want_sbp
        torch.testing.assert_close(grad1, 2 + 2 * value + 1)
        torch.testing.assert_close(grad2, 2 * (2 + 2 * value + 1))


# ---------------------------------------------------------------------------------------------------------
# Fallback warning


def warning_body():
    """Every rank: forget earlier warnings for median (no rule), then run it twice and a rule op once, recording."""
    p = st.placement("cpu", [0, 1])
    g = torch.arange(6.0).reshape(3, 2).to_global(p, split(0))
    _fallback.warned_ops.discard(torch.ops.aten.median.default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.median(g)
        second = torch.median(g)
        g + g  # has a rule: no warning
    return [str(w.message) for w in caught], first.full_tensor(), second.full_tensor()


def test_fallback_warns_once_per_op():
    """An op without a rule warns once (naming the op), not on every call; ops with a rule do not warn. The
    fallback's value is still right."""
    for messages, first, second in run_on_world(2, warning_body):
        assert len(messages) == 1, messages
        assert "aten.median.default" in messages[0] and "no SBP rule" in messages[0]
        want = torch.median(torch.arange(6.0).reshape(3, 2).repeat(2, 1))
        torch.testing.assert_close(first, want)
        torch.testing.assert_close(second, want)


def strided_values_body():
    from op_check import check_op

    p = st.placement("cpu", [0, 1])
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check_op(torch.linalg.det, [a], p, [split(1)])  # gathered along dim 1, then a fallback op
    check_op(lambda x: torch.linalg.det(x.t()), [a], p, [broadcast])  # a transposed local part, then fallback


def test_fallback_reads_full_values_in_the_strides_torch_sees():
    """Global tensors report contiguous strides; a gathered value laid out otherwise once made det's
    backward (which reads strides) return the transposed gradient."""
    run_on_world(2, strided_values_body)


def conjugate_views_body():
    from op_check import check_op

    p = st.placement("cpu", [0, 1])
    gen = torch.Generator().manual_seed(4)
    a = torch.complex(torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen))
    cases = [
        lambda x: x.conj() + 1,
        lambda x: x.conj().sum(0),
        lambda x: (x.conj() * x).real,
        lambda x: x.conj().imag,
        lambda x: x.mH @ x,
        lambda x: torch.neg(x)._neg_view() * 2,
    ]
    for sbp in (broadcast, split(0), split(1)):
        for fn in cases:
            check_op(fn, [a], p, [sbp], backward=False)
    lazily_conjugated = a.conj().to_global(p, broadcast)  # a local part with the conjugate bit
    torch.testing.assert_close((lazily_conjugated + 1).full_tensor(), a.conj() + 1)


def test_conjugate_and_negative_views_are_applied():
    """Inside __torch_dispatch__ torch ignores a part's conjugate bit: x.conj() + 1 once added to x."""
    run_on_world(2, conjugate_views_body)


def index_tensor_body():
    p = st.placement("cpu", [0, 1])
    x = torch.arange(10.0).to_global(p, broadcast).to_global(sbp=split(0))
    with pytest.raises(TypeError, match="reads the values of a global tensor argument"):
        torch.tensor_split(x, torch.tensor([2, 5]).to_global(p, broadcast))
    return [t.full_tensor() for t in torch.tensor_split(x, [2, 5])]


def test_values_read_in_cpp_give_a_clear_error():
    """tensor_split's C++ reads its index tensor's storage, which a global tensor's wrapper does not have."""
    for parts in run_on_world(2, index_tensor_body):
        assert [t.tolist() for t in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]


def implicit_broadcast_body():
    from op_check import check_op

    p = st.placement("cpu", [0, 1])
    a = torch.randn(5, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    bias = torch.randn(4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with st.implicit_broadcast():
        for sbp in (broadcast, split(0), split(1)):
            check_op(lambda x: x[[1, 3]], [a], p, [sbp])  # torch makes the index list a plain tensor
            check_op(lambda x: torch.cummax(x, 0).values, [a], p, [sbp])  # its backward builds plain zeros
            check_op(lambda x: x + bias, [a], p, [sbp])
            check_op(lambda x: x.prod(0), [a], p, [sbp])
        with pytest.raises(st.MixedTensorError, match="requires grad"):
            layout_of_a = a.to_global(p, broadcast)
            layout_of_a * bias.clone().requires_grad_()
    with pytest.raises(st.MixedTensorError, match="implicit_broadcast"):
        a.to_global(p, broadcast) + bias


def test_implicit_broadcast_of_plain_tensors():
    run_on_world(2, implicit_broadcast_body)


def sparse_result_body():
    x = torch.randn(4, 3).to_global(st.placement("cpu", [0, 1]), broadcast)
    with pytest.raises(NotImplementedError, match="sparse_coo tensor; global tensors are dense"):
        x.to_sparse()


def test_an_op_with_a_sparse_result_raises_instead_of_wrapping_it():
    """A global tensor reporting a strided layout over a sparse part would give wrong layouts downstream."""
    run_on_world(2, sparse_result_body)


def native_hit_body():
    import sys

    from sbp_torch._dispatch import CALLS, NATIVE, _dispatcher, python_dispatch

    p = st.placement("cpu", [0, 1])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 4, generator=gen).to_global(p, broadcast).to_global(sbp=split(0))
    w = torch.randn(4, generator=gen).to_global(p, broadcast).requires_grad_()
    cases = [
        lambda x, w: x + x,
        lambda x, w: x * 0.5,  # a Scalar: keyed by type
        lambda x, w: x * 2,  # the same op and layout, an int Scalar
        lambda x, w: torch.relu(x - 1),
        lambda x, w: x.sum(dim=[0]),  # a list argument
        lambda x, w: (x * w).detach(),  # detach, and a backward-recording op
        lambda x, w: x.add_(1).mul_(0.5),  # in place: returns its self
        lambda x, w: x.view(5, 2, 2),  # a view keeping the split: its plan reshapes the part, which C does itself
        lambda x, w: x.transpose(0, 1),  # a view with another local function: C hands it to Python
        lambda x, w: torch.cat([x, x * w], dim=1),  # a list argument: the op runs on the parts as they are
        lambda x, w: F.layer_norm(x, (4,), w, w),  # three outputs (native_layer_norm)
    ]
    handlers = {"python": python_dispatch, "c": contextlib.nullcontext}
    results, counts, entered = {}, {}, {}
    for name, handler in handlers.items():
        calls = []

        def profiler(frame, event, arg):
            if event == "call" and frame.f_code is _dispatcher.dispatch.__code__:
                calls.append(None)

        with handler():
            st.cache_clear()  # (the learnt local calls too: a call learnt by one handler would skip the other)
            x.copy_(torch.randn(5, 4, generator=torch.Generator().manual_seed(6)).to_global(p, broadcast))
            results[name] = [[fn(x, w).full_tensor().detach() for _ in range(3)] for fn in cases]  # a miss, hits
            counts[name] = CALLS.info()[:2]  # (hits, misses) of the call cache
            sys.setprofile(profiler)
            x * w  # a hit of a simple plan (w requires grad: not a local call)
            x.view(5, 2, 2)  # a hit of a plan that reshapes the part (views are never local calls)
            F.layer_norm(x, (4,), w, w)  # a hit of a plan that runs as it is, with three outputs
            sys.setprofile(None)
            entered[name] = len(calls)
    x, w = torch.randn(5, 4, generator=torch.Generator().manual_seed(6)), w.full_tensor().detach().requires_grad_()
    results["plain"] = [[fn(x, w).detach().clone() for _ in range(3)] for fn in cases]  # (the same, plain)
    return NATIVE, results, counts, entered


def test_the_c_hit_path_answers_as_the_python_one():
    """The dispatcher's hit path in C (``csrc/dispatch_hit.c``) is built, runs a cached simple plan, a view's plan and a
    plan with several outputs without entering Python's ``dispatch``, and gives the values and cache counts the
    Python handler gives, call for call; both give the plain ops' values."""
    for native, results, counts, entered in run_on_world(2, native_hit_body):
        assert native, "the C hit path is not built (setup.py builds it wherever a C compiler is)"
        for plain, want, got in zip(results["plain"], results["python"], results["c"]):
            for p, a, b in zip(plain, want, got):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
                torch.testing.assert_close(a, p)
        assert counts["c"] == counts["python"]
        assert entered == {"python": 3, "c": 0}


def earlier_calls_body():
    """Calls that an earlier call's cache entry or learnt shortcut must not answer, under both dispatch handlers:
    numbers equal in value but not in type (``1``, ``1.0``, ``True``, ``1+0j``: their results' dtypes differ), and a
    plain index once indexing has been learnt to give views."""
    from sbp_torch._dispatch import python_dispatch

    p = st.placement("cpu", [0, 1])
    ints = torch.arange(5).to_global(p, broadcast).to_global(sbp=split(0))
    bools = (torch.arange(5) % 2 == 0).to_global(p, broadcast)
    pairs = [("x + 1", "x + 1.0"), ("x * 1", "x * 1.0"), ("x.clamp(min=0)", "x.clamp(min=0.0)")]
    pairs += [("b + True", "b + 1"), ("x + 1", "x + (1+0j)")]
    for handler in (python_dispatch, contextlib.nullcontext):
        with handler():
            for first, second in pairs:
                st.cache_clear()
                for expression in (first, first, second, second):  # (each a miss, a hit or a learnt local call)
                    got = eval(expression, {"x": ints, "b": bools})
                    want = eval(expression, {"x": ints.full_tensor(), "b": bools.full_tensor()})
                    assert got.dtype == got.to_local().dtype == want.dtype, (first, expression, got.dtype)
                    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    x = torch.arange(4.0).to_global(p, broadcast)
    x[0], x[0]  # (a view, seen twice: indexing is learnt to take the dispatch path)
    with pytest.raises(st.MixedTensorError):
        x[torch.tensor([0, 2])]


def test_calls_that_an_earlier_call_must_not_answer():
    run_on_world(2, earlier_calls_body)


def _fallback_warning():
    from sbp_torch._dispatch._fallback import warned_ops

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)).to_global(st.placement("cpu", [0, 1]), split(0))
    warned_ops.discard(torch.ops.aten.linalg_qr.default)  # (once per op and process: a worker may have warned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.linalg.qr(x)
    return [(os.path.basename(w.filename), str(w.message)) for w in caught]


@pytest.mark.gloo
def test_a_fallback_warns_at_the_users_line():
    for caught in run_on_world(2, _fallback_warning):
        assert len(caught) == 1 and "runs on broadcast (gathered) inputs" in caught[0][1], caught
        assert caught[0][0] == "test_dispatch.py", caught  # not a file of sbp_torch or torch
