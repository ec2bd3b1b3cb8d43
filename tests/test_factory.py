"""Creation functions (randn, rand, zeros, ones, full, empty, arange, tensor) against their torch counterparts.

Random tensors must not depend on the placement or the SBP: after ``torch.manual_seed(s)`` on every rank, the
logical value equals what ``torch.randn``/``torch.rand`` give in a single process after the same seed, and the
generator ends in the same state, so later draws agree too. The counter-based generator used on CUDA has the
same property by construction (each element is a function of its logical index), checked here on CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch import gradient_sbp
from sbp_torch._layout import GlobalMeta, normalize_sbp
from sbp_torch._layout._philox import random_values, region_flat_indices
from sbp_torch.sbp import Split, broadcast, partial_max, partial_min, partial_sum, split

from reference import assemble, coords, expected_region, partial_free
from world import run_on_world

WORLD = 4  # every case runs on a world of 4, so 1-D placements of fewer ranks leave some ranks outside
SIMPLE = [broadcast, partial_sum, partial_max, partial_min]


@st_.composite
def placements(draw):
    """Ranks of a 1-D placement of 1..4 ranks of the world (any order) or of a 2x2 mesh."""
    if draw(st_.booleans()):
        return draw(st_.sampled_from([[[0, 1], [2, 3]], [[3, 1], [0, 2]]]))
    n = draw(st_.integers(1, WORLD))
    return draw(st_.permutations(list(range(WORLD))))[:n]


@st_.composite
def layouts(draw, min_ndim=0):
    """(ranks, shape, sbp): uneven shapes of 0..3 dims and one SBP per placement axis."""
    ranks = draw(placements())
    ndim = draw(st_.integers(min_ndim, 3))
    shape = tuple(draw(st_.lists(st_.integers(0, 6), min_size=ndim, max_size=ndim)))
    axes = 2 if isinstance(ranks[0], list) else 1
    sbp = tuple(draw(st_.sampled_from([split(d) for d in range(ndim)] + SIMPLE)) for _ in range(axes))
    return ranks, shape, sbp


def _arange_sbp(sbp):
    """The layout used for the 1-D arange: every split becomes split(0)."""
    sbp = sbp if isinstance(sbp, tuple) else (sbp,)
    return tuple(split(0) if isinstance(s, Split) else s for s in sbp)


def _tensor_data(shape):
    """Nested lists of ints with ``shape`` (zeros in it are replaced by 1: nested lists cannot spell (0, 3))."""
    shape = tuple(n or 1 for n in shape)
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) * 3 - 4).tolist()


def factory_body(ranks, shape, sbp, seed, dtype):
    """Every rank: build one tensor with each creation function and report its layout and values, plus the
    generator's next draws and state after the random ones."""
    p = st.placement("cpu", ranks)
    out = {}

    def report(name, g, *extra):
        out[name] = (g.sbp, tuple(g.shape), g.dtype, g.requires_grad, g.to_local(), g.full_tensor(), *extra)

    torch.manual_seed(seed)
    report("randn", st.randn(*shape, placement=p, sbp=sbp, dtype=dtype), torch.randn(3, dtype=dtype))
    report("rand", st.rand(*shape, placement=p, sbp=sbp, dtype=dtype), torch.rand(3, dtype=dtype))
    out["rng_state"] = torch.get_rng_state()
    report("zeros", st.zeros(*shape, placement=p, sbp=sbp, dtype=dtype))
    report("ones", st.ones(shape, placement=p, sbp=sbp))  # the size as one tuple works too
    report("full", st.full(shape, 2.5, placement=p, sbp=sbp, dtype=dtype))
    report("full_int", st.full(shape, 7, placement=p, sbp=sbp))
    report("empty", st.empty(*shape, placement=p, sbp=sbp, dtype=dtype))
    report("arange", st.arange(-1.0, 1 + len(shape) + sum(shape), 0.5, placement=p, sbp=_arange_sbp(sbp)))
    report("tensor", st.tensor(_tensor_data(shape), placement=p, sbp=sbp))
    return out


def _check_global(name, got, logical, p, sbp, rank, exact=True):
    """One rank's report against the logical tensor ``logical``: layout, full value, local part."""
    got_sbp, shape, dtype, requires_grad, local, full = got[:6]
    norm = normalize_sbp(sbp, p, logical.dim(), logical.dtype)
    assert got_sbp == norm and shape == tuple(logical.shape) and dtype == logical.dtype, name
    assert requires_grad is False, name
    coord = p.coord_of(rank)
    if coord is None:
        assert local.numel() == 0 and full.numel() == 0, f"{name}: rank {rank} is outside the placement"
        return
    meta = GlobalMeta(tuple(logical.shape), logical.dtype, p, norm)
    assert tuple(local.shape) == meta.local_shape(coord), name
    if not exact:  # empty: only the layout is defined
        return
    assert torch.equal(full, logical), f"{name} on rank {rank}: {full} != {logical}"
    if partial_free(meta):
        assert torch.equal(local, expected_region(logical, meta, coord)), f"{name} local on rank {rank}"


def check_factories(ranks, shape, sbp, seed, dtype):
    results = run_on_world(WORLD, factory_body, ranks, shape, sbp, seed, dtype)
    p = st.placement("cpu", ranks)
    torch.manual_seed(seed)
    reference = {"randn": torch.randn(shape, dtype=dtype)}
    next_randn = torch.randn(3, dtype=dtype)
    reference["rand"] = torch.rand(shape, dtype=dtype)
    next_rand = torch.rand(3, dtype=dtype)
    state = torch.get_rng_state()
    reference.update(
        zeros=torch.zeros(shape, dtype=dtype),
        ones=torch.ones(shape),
        full=torch.full(shape, 2.5, dtype=dtype),
        full_int=torch.full(shape, 7),
        empty=torch.empty(shape, dtype=dtype),
        arange=torch.arange(-1.0, 1 + len(shape) + sum(shape), 0.5),
        tensor=torch.tensor(_tensor_data(shape)),
    )
    for rank, got in enumerate(results):
        for name, logical in reference.items():
            layout = _arange_sbp(sbp) if name == "arange" else sbp
            _check_global(name, got[name], logical, p, layout, rank, exact=name != "empty")
        # the generator advanced exactly as the single-process calls advanced it, on members and non-members
        assert torch.equal(got["randn"][6], next_randn) and torch.equal(got["rand"][6], next_rand), rank
        assert torch.equal(got["rng_state"], state), f"generator state on rank {rank}"
        # local parts rebuild the value (also for partial layouts)
        if p.coord_of(rank) is None:
            continue
        for name in ("randn", "rand", "ones", "tensor"):
            parts = {p.coord_of(r): results[r][name][4] for r in p.flat_ranks}
            norm = normalize_sbp(sbp, p, len(shape), reference[name].dtype)
            assert torch.equal(assemble(parts, p.shape, norm), reference[name]), name


@pytest.mark.gloo
@settings(max_examples=40)
@given(layouts(), st_.integers(0, 2**31 - 1), st_.sampled_from([torch.float32, torch.float64]))
def test_factories_match_torch(layout, seed, dtype):
    """Over random placements, SBPs and uneven shapes: randn/rand equal torch's draws after the same seed and
    leave the generator in the same state; zeros/ones/full/arange/tensor equal their torch counterparts;
    empty has the right layout and local shapes."""
    check_factories(*layout, seed, dtype)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "ranks,sbp",
    [
        ([0, 1, 2, 3], split(0)),
        ([2, 0], broadcast),
        ([[0, 1], [2, 3]], (split(0), split(0))),
        ([[3, 1], [0, 2]], (partial_sum, split(1))),
    ],
    ids=str,
)
def test_factories_fixed_cases(ranks, sbp):
    """A few fixed cases (uneven split over 4 ranks, nested split, partial on a mesh), so that failures are
    easy to reproduce without hypothesis."""
    check_factories(ranks, (7, 5), sbp, 1234, torch.float32)


def randn_twice_body(ranks, sbp):
    """Two consecutive randn calls on different layouts after one seed, and the draw after them."""
    p = st.placement("cpu", ranks)
    torch.manual_seed(7)
    a = st.randn(3, 4, placement=p, sbp=sbp)
    b = st.randn(5, placement=p, sbp=(broadcast,) * p.ndim, dtype=torch.float64)
    return a.full_tensor(), b.full_tensor(), torch.randn(2)


@pytest.mark.gloo
def test_consecutive_random_tensors_continue_the_stream():
    """The second random global tensor continues torch's stream where the first left it, as in one process."""
    results = run_on_world(WORLD, randn_twice_body, [[0, 1], [2, 3]], (split(1), split(0)))
    torch.manual_seed(7)
    want = torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(2)
    for got in results:
        for g, w in zip(got, want):
            assert torch.equal(g, w)


# ---------------------------------------------------------------------------------------------------------
# requires_grad: a global leaf whose gradient arrives in the gradient layout


def requires_grad_body(ranks, sbp, factory):
    """Every rank: a leaf made by ``factory`` with requires_grad=True; two losses, one through full_tensor,
    one through global ops (mul by a broadcast weight, then sum)."""
    p = st.placement("cpu", ranks)
    torch.manual_seed(3)
    make = {"randn": st.randn, "ones": st.ones, "zeros": st.zeros}[factory]
    g = make(4, 5, placement=p, sbp=sbp, requires_grad=True)
    leaf = (g.is_leaf, g.requires_grad, g.grad_fn is None)
    weight = torch.arange(20.0).reshape(4, 5)
    (g.full_tensor() * weight).sum().backward()
    first = (g.grad.sbp, g.grad.to_local().clone(), g.grad.full_tensor())
    g.grad = None
    (g * st.tensor(weight.tolist(), placement=p, sbp=(broadcast,) * p.ndim)).sum().backward()
    second = (g.grad.sbp, g.grad.to_local().clone(), g.grad.full_tensor())
    return leaf, first, second


@pytest.mark.gloo
@pytest.mark.parametrize(
    "ranks,sbp,factory",
    [
        ([0, 1, 2], split(0), "randn"),
        ([0, 1, 2], split(1), "ones"),
        ([0, 1, 2], broadcast, "randn"),
        ([0, 1, 2], partial_sum, "zeros"),
        ([0, 1, 2], partial_max, "randn"),
        ([[0, 1], [2, 3]], (split(0), broadcast), "randn"),
        ([[0, 1], [2, 3]], (split(1), split(0)), "ones"),
        ([[0, 1], [2, 3]], (partial_sum, split(1)), "randn"),
    ],
    ids=str,
)
def test_requires_grad_gives_leaf_with_gradient_in_gradient_layout(ranks, sbp, factory):
    """``requires_grad=True`` makes a leaf; after backward its ``.grad`` is a global tensor laid out as
    ``gradient_sbp(sbp)`` (split stays split, broadcast stays broadcast, partial sum becomes broadcast) whose
    logical value is the gradient, whether the loss went through ``full_tensor`` or through global ops."""
    p = st.placement("cpu", ranks)
    results = run_on_world(p.size, requires_grad_body, ranks, sbp, factory)
    norm = normalize_sbp(sbp, p, 2, torch.float32)
    want_sbp = gradient_sbp(norm)
    weight = torch.arange(20.0).reshape(4, 5)
    grad_meta = GlobalMeta((4, 5), torch.float32, p, want_sbp)
    for rank, (leaf, *grads) in enumerate(results):
        assert leaf == (True, True, True)
        for path, (got_sbp, local, full) in zip(["full_tensor", "ops"], grads):
            assert got_sbp == want_sbp, f"{path}: .grad of a {norm} leaf is laid out as {got_sbp}"
            torch.testing.assert_close(full, weight, msg=f"{path} on rank {rank}")
            if partial_free(grad_meta):
                torch.testing.assert_close(local, expected_region(weight, grad_meta, p.coord_of(rank)))


# ---------------------------------------------------------------------------------------------------------
# The counter-based (CUDA) generator, computed on CPU: split invariance


def counter_based_region(kind, meta, starts, lengths, seed, offset, device):
    """The region of a counter-based random tensor, as the CUDA path computes it (here on the CPU)."""
    return random_values(kind, region_flat_indices(meta.shape, starts, lengths, device), seed, offset, meta.dtype)


@settings(max_examples=60)
@given(
    st_.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (3, 2), (2, 1, 2)]),
    st_.data(),
    st_.sampled_from(["normal", "uniform"]),
    st_.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    st_.integers(-(2**63), 2**63 - 1),
    st_.integers(0, 2**40).map(lambda n: n * 4),
)
def test_counter_based_region_is_split_invariant(mesh, data, kind, dtype, seed, offset):
    """Every rank's region of a counter-based random tensor, computed on its own, is the same slice of the
    tensor computed in one piece; for layouts without partial axes the regions tile the whole tensor."""
    ndim = data.draw(st_.integers(0, 3), label="ndim")
    shape = tuple(data.draw(st_.lists(st_.integers(0, 7), min_size=ndim, max_size=ndim), label="shape"))
    sbp = tuple(data.draw(st_.sampled_from([split(d) for d in range(ndim)] + SIMPLE)) for _ in mesh)
    ranks = torch.arange(torch.Size(mesh).numel()).reshape(mesh).tolist()
    p = st.placement("cpu", ranks)
    meta = GlobalMeta(shape, dtype, p, normalize_sbp(sbp, p, ndim, dtype))
    cpu = torch.device("cpu")
    whole = counter_based_region(kind, meta, [0] * ndim, list(shape), seed, offset, cpu)
    assert whole.shape == shape and whole.dtype == dtype
    tiled = torch.full(shape, float("nan"), dtype=dtype)
    for coord in coords(mesh):
        starts, lengths = meta.region(coord)
        part = counter_based_region(kind, meta, starts, lengths, seed, offset, cpu)
        region = tuple(slice(s, s + n) for s, n in zip(starts, lengths))
        assert torch.equal(part, whole[region]), f"region of {coord} under {sbp}"
        tiled[region] = part
    if partial_free(meta):
        assert torch.equal(tiled, whole)


def test_counter_based_values_look_random():
    """Sanity: the counter-based stream depends on seed and offset, and its values are in range."""
    p = st.placement("cpu", [0, 1])
    meta = GlobalMeta((64, 33), torch.float32, p, (split(1),))
    cpu = torch.device("cpu")
    full = [0, 0], [64, 33]
    u = counter_based_region("uniform", meta, *full, 5, 0, cpu)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    n = counter_based_region("normal", meta, *full, 5, 0, cpu)
    assert abs(n.mean().item()) < 0.05 and abs(n.std().item() - 1) < 0.05
    assert not torch.equal(n, counter_based_region("normal", meta, *full, 6, 0, cpu))
    assert not torch.equal(n, counter_based_region("normal", meta, *full, 5, 4, cpu))
    assert len(set(itertools.chain.from_iterable(u.tolist()))) == u.numel()


def accumulation_body() -> list:
    """A factory's leaf, and a leaf made by ``requires_grad_()`` or by setting ``requires_grad``, through ``sum()``
    twice (its gradient an expand), then its gradient scaled in place, on each layout: (layout, the gradient after
    two backward passes, after ``mul_``)."""
    out = []
    p = st.placement("cpu", [0, 1])
    for sbp in (split(0), broadcast, partial_sum, "leaf S(0)", "leaf B", "flag S(0)"):
        if isinstance(sbp, str):
            laid_out = split(0) if "S(0)" in sbp else broadcast
            leaf = torch.ones(4, 3).to_global(p, broadcast).to_global(sbp=laid_out).detach()
            if sbp.startswith("flag"):  # (the attribute, not requires_grad_())
                leaf.requires_grad = True
            else:
                leaf.requires_grad_()
        else:
            leaf = st.ones(4, 3, placement=p, sbp=sbp, requires_grad=True)
        for _ in range(2):
            (leaf.sum() * 2).backward()
        accumulated = leaf.grad.full_tensor().clone()  # (of a broadcast gradient: its part itself)
        leaf.grad.mul_(0.5)
        out.append((repr(sbp), accumulated, leaf.grad.full_tensor()))
    return out


@pytest.mark.gloo
def test_a_global_leaf_accumulates_gradients_as_one_process():
    """As ``AccumulateGrad`` gives a plain leaf a gradient of its own strides, never the expand a sum's gradient
    is (which no later accumulation or in-place scaling could write into)."""
    leaf = torch.ones(4, 3, requires_grad=True)
    for _ in range(2):
        (leaf.sum() * 2).backward()
    for results in run_on_world(2, accumulation_body):
        for sbp, accumulated, scaled in results:
            torch.testing.assert_close(accumulated, leaf.grad, msg=sbp)
            torch.testing.assert_close(scaled, leaf.grad * 0.5, msg=sbp)
