"""Unmodified model code on global tensors: global mode, the automatic mode of laid-out modules, plain tensors
from user code (refused, or taken as broadcast under ``implicit_broadcast``, checked or not), torch's own formulas
that build plain tensors, fused attention, and the value readers of a training loop. Every result is compared with
the same computation on plain tensors in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch.sbp import broadcast, partial_sum, split

from world import run_on_world

pytestmark = pytest.mark.gloo


# global mode: factories return global tensors


def _build(shape) -> dict:
    """One tensor from each factory; under global mode the same calls give global tensors."""
    return {
        "zeros": torch.zeros(shape),
        "ones": torch.ones(*shape, dtype=torch.int64),
        "full": torch.full(shape, 2.5),
        "arange": torch.arange(3, 3 + 2 * math.prod(shape), 2).reshape(shape),
        "eye": torch.eye(shape[0]),
        "linspace": torch.linspace(0, 1, shape[-1]),
        "tensor": torch.tensor([[1.5, -2.0], [0.0, 4.0]]),
        "zeros_like": torch.zeros_like(torch.empty(shape)),
        "randn": torch.randn(shape),
        "rand_like": torch.rand_like(torch.empty(shape)),
        "randint": torch.randint(0, 9, shape),
    }


def _factories(ranks, sbp, shape, seed):
    p = st.placement("cpu", ranks)
    torch.manual_seed(seed)
    with st.global_mode(p, sbp):
        made = _build(shape)
        plain = torch.ones(3, device="meta")  # another device type: the plain tensor asked for
    assert not plain.is_global and not torch.zeros(2).is_global  # outside the block: plain again
    return {name: (t.is_global, t.full_tensor()) for name, t in made.items()}


@settings(max_examples=8, deadline=None)
@given(
    shape=st_.lists(st_.integers(1, 5), min_size=1, max_size=3).map(tuple),
    sbp=st_.sampled_from([broadcast, split(0), split(-1), partial_sum]),
    world=st_.sampled_from([2, 3]),
    seed=st_.integers(0, 2**16),
)
def test_factories_under_global_mode_give_the_plain_values(shape, sbp, world, seed):
    """Random (mostly uneven) shapes and layouts, partial included: each factory's logical value is the plain one;
    the random factories draw what one process draws after the same seed."""
    torch.manual_seed(seed)
    want = _build(shape)
    for got in run_on_world(world, _factories, list(range(world)), sbp, shape, seed):
        for name, (is_global, value) in got.items():
            assert is_global, name
            assert torch.equal(value, want[name]), name


# laid-out modules run their forward and backward in global mode


class PositionalMlp(torch.nn.Module):
    """A module that builds tensors of its own in forward, as model code does: positions, a mask, a constant; and
    converts an activation (whose collectives allocate plain buffers of this rank's own)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        h = self.embed((ids + positions) % 16)
        if h.is_global:  # (the reference runs it on plain tensors) sbp_torch's own buffers stay plain in global mode
            h = h.to_global(sbp=(broadcast,) * h.placement.ndim)
        causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), device=h.device).triu(1)
        weights = torch.softmax(h @ h.transpose(1, 2) + causal, dim=-1)
        h = weights @ self.down(torch.relu(self.up(h)))
        return (h * torch.tensor([0.5], device=h.device)).pow(2).mean()


def _module_run(ranks, plan):
    torch.manual_seed(0)
    model = PositionalMlp()
    ids = torch.randint(0, 16, (5, 7))
    p = st.placement("cpu", ranks)
    reference = PositionalMlp()
    reference.load_state_dict(model.state_dict())
    want = reference(ids)
    want.backward()
    model.to_global(p, plan)
    loss = model(ids.to_global(p, broadcast).to_global(sbp=split(0)))
    loss.backward()
    grads = {n: (q.grad.full_tensor(), reference.get_parameter(n).grad) for n, q in model.named_parameters()}
    return loss.item(), want.item(), grads


@pytest.mark.parametrize("plan", [None, {"up.*": split(0), "down.weight": split(1)}], ids=["dp", "tp"])
def test_a_laid_out_module_builds_global_tensors_in_forward_and_backward(plan):
    for loss, want, grads in run_on_world(3, _module_run, [0, 1, 2], plan):
        assert math.isclose(loss, want, rel_tol=1e-6)
        for name, (got, expected) in grads.items():
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def _plain_batch_into_a_laid_out_module(ranks):
    model = torch.nn.Linear(4, 3).to_global(st.placement("cpu", ranks))
    with pytest.raises(st.MixedTensorError) as info:
        model(torch.randn(5, 4))
    return str(info.value)


def test_a_plain_tensor_from_outside_still_raises_on_every_rank():
    for message in run_on_world(2, _plain_batch_into_a_laid_out_module, [0, 1]):
        assert "linear" in message and "(5, 4)" in message
        assert "to_global(placement, sbp)" in message and "implicit_broadcast(check=True)" in message


def _two_placements(ranks):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].to_global(st.placement("cpu", ranks[:1]))
    model.to_global(st.placement("cpu", ranks))
    with pytest.raises(ValueError, match="two placements") as info:
        model(torch.zeros(2, 4).to_global(st.placement("cpu", ranks), broadcast))
    return str(info.value)


def test_a_module_on_two_placements_raises_naming_both():
    for message in run_on_world(2, _two_placements, [0, 1]):
        assert "ranks=[0]" in message and "ranks=[0, 1]" in message


# implicit broadcast, checked


def _implicit(ranks, same):
    p = st.placement("cpu", ranks)
    x = torch.arange(12.0).reshape(4, 3).to_global(p, broadcast).to_global(sbp=split(0))
    bias = torch.ones(4, 3) * (1 if same else torch.distributed.get_rank() + 1)
    with st.implicit_broadcast(check=True):  # (checked once per call site and shape: one site per case)
        try:
            if same:
                return (x + bias).full_tensor()
            return (x - bias).full_tensor()
        except st.MixedTensorError as err:
            return str(err)


def test_checked_implicit_broadcast_takes_equal_values_and_refuses_differing_ones():
    want = torch.arange(12.0).reshape(4, 3) + 1
    for got in run_on_world(2, _implicit, [0, 1], True):
        assert torch.equal(got, want)
    for message in run_on_world(2, _implicit, [0, 1], False):
        assert "sub" in message and "different values on different ranks" in message


# torch's own formulas build plain tensors below the frontend: no context needed


def _formulas(ranks):
    p = st.placement("cpu", ranks)
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    x[1, 2] = 0.0  # prod's backward takes its zero branch
    q, k, v = (torch.randn(4, 2, 5, 8, requires_grad=True) for _ in range(3))
    results = {}

    def both(name, fn, *inputs, sbp=None):
        plains = [t.detach().clone().requires_grad_() for t in inputs]
        want = fn(*plains)
        want.backward(torch.ones_like(want))
        sbp = sbp or split(0)
        globals_ = [t.detach().to_global(p, broadcast).to_global(sbp=sbp).requires_grad_() for t in inputs]
        got = fn(*globals_)
        got.backward(torch.ones_like(got))
        results[name] = [(got.full_tensor().detach(), want.detach())] + [
            (g.grad.full_tensor(), w.grad) for g, w in zip(globals_, plains)
        ]

    both("prod", lambda t: t.prod(dim=1), x)
    both("cummax", lambda t: torch.cummax(t, dim=1).values, x)
    both("getitem", lambda t: t[[1, 3]], x)
    with st.strict():  # these have rules of their own: no fallback
        both("pad", lambda t: F.pad(t, (1, 2), value=0.5), x)
        both("safe softmax", lambda t: torch.ops.aten._safe_softmax(t, -1), x)
        for sbp in (split(0), split(1)):
            both(
                f"attention {sbp}",
                lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                q,
                k,
                v,
                sbp=sbp,
            )
    return results


def test_torch_formulas_that_build_plain_tensors_run_on_global_tensors():
    for results in run_on_world(2, _formulas, [0, 1]):
        for name, pairs in results.items():
            for got, want in pairs:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


# value readers


def _readers(ranks):
    p = st.placement("cpu", ranks)
    x = torch.tensor([[1.25, 2.0], [3.0, 4.5], [5.0, 6.0]]).to_global(p, broadcast).to_global(sbp=split(0))
    loss = (x * 2).sum()
    return x.tolist(), x.numpy(), f"{loss:.4f}", loss.tolist()


def test_value_readers_give_the_logical_value():
    for as_list, array, text, number in run_on_world(3, _readers, [0, 1, 2]):
        assert as_list == [[1.25, 2.0], [3.0, 4.5], [5.0, 6.0]]
        assert array.tolist() == as_list
        assert text == "43.5000" and number == 43.5


# a KV cache's first concatenation: an empty 1-D tensor that global mode built, and split keys


def _cache_cat(ranks):
    p = st.placement("cpu", ranks)
    keys = torch.arange(60.0).reshape(5, 2, 6)
    with st.global_mode(p):
        empty = torch.tensor([])
    split_keys = keys.to_global(p, broadcast).to_global(sbp=split(0)).requires_grad_()
    got = torch.cat([empty, split_keys], dim=-2)
    (got * got).sum().backward()
    return got.sbp, got.detach().full_tensor(), split_keys.grad.full_tensor()


def test_concatenating_onto_an_empty_cache_keeps_the_split():
    keys = torch.arange(60.0).reshape(5, 2, 6)
    for sbp, value, grad in run_on_world(3, _cache_cat, [0, 1, 2]):
        assert sbp == (split(0),)  # not gathered to broadcast for the empty tensor's sake
        assert torch.equal(value, keys)
        assert torch.equal(grad, 2 * keys)  # the gradient of sum(x * x), as one process gives it
