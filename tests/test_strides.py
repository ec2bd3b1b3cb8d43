"""A global tensor's strides and contiguity are those plain torch gives the logical tensor after the same calls.

Random chains of the calls that decide strides (transposes, permutes, expands, slices with steps, selects, unsqueezes,
``contiguous()`` in each memory format, ``empty_like``, ``clone``, ``reshape``, element-wise ops on non-contiguous
inputs, reductions over permuted dims, matrix products of transposes) run on a global tensor of uneven shape in a
random layout (splits, broadcast, partial sums) on a 3-rank line and a 2x2 grid, and on the plain tensor; after each
call the strides (of every dim of more than one element), the contiguity in every memory format and the values must
agree. A ``view`` that plain torch
refuses is refused on every rank. What code decides by strides (``reshape`` choosing a view or a copy, autograd
laying out a gradient) then decides as it would on the plain tensor."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import layout
from world import run_on_world

pytestmark = pytest.mark.gloo

FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}

# name -> (the call on a tensor, the number of dims it needs at least)
CALLS = {
    "transpose": (lambda x, r: x.transpose(r.randrange(x.dim()), r.randrange(x.dim())), 2),
    "permute": (lambda x, r: x.permute(*r.sample(range(x.dim()), x.dim())), 2),
    "expand": (lambda x, r: x[:1].expand(3, *x.shape[1:]), 1),
    "slice with a step": (lambda x, r: x[:, ::2] if x.dim() > 1 else x[::2], 1),
    "select": (lambda x, r: x.select(r.randrange(x.dim()), 0), 2),
    "unsqueeze": (lambda x, r: x.unsqueeze(r.randrange(x.dim() + 1)), 0),
    "contiguous": (lambda x, r: x.contiguous(), 0),
    "contiguous in a memory format": (
        lambda x, r: x.contiguous(memory_format=FORMATS.get(x.dim(), torch.preserve_format)),
        0,
    ),
    "empty_like": (lambda x, r: torch.empty_like(x).fill_(1.5), 0),
    "clone": (lambda x, r: x.clone(), 0),
    "reshape": (lambda x, r: x.reshape(-1, *x.shape[2:]) if x.dim() > 1 else x.reshape(-1), 1),
    "element-wise": (lambda x, r: torch.tanh(x) * 2 + x, 0),
    "element-wise with a transposed operand": (
        lambda x, r: x * x.transpose(-1, -2) if x.dim() > 1 and x.shape[-1] == x.shape[-2] else x + 1,
        0,
    ),
    "reduction": (lambda x, r: x.sum(r.randrange(x.dim())), 2),
    "matrix product": (lambda x, r: x @ x.transpose(-1, -2) if x.dim() > 1 else x, 0),
}


def _compare(got, want, what: str) -> list[str]:
    problems = []
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"]
    # (a dim of size 1 may have any stride, and torch's kernels disagree there: clone's on meta tensors and on the CPU)
    if [s for n, s in zip(got.shape, got.stride()) if n != 1] != [
        s for n, s in zip(want.shape, want.stride()) if n != 1
    ]:
        problems.append(f"{what}: strides {got.stride()} vs {want.stride()}")
    formats = [torch.contiguous_format] + ([FORMATS[got.dim()]] if got.dim() in FORMATS else [])
    for memory_format in formats:
        if got.is_contiguous(memory_format=memory_format) != want.is_contiguous(memory_format=memory_format):
            problems.append(f"{what}: is_contiguous({memory_format}) differs")
    if not torch.allclose(got.full_tensor(), want, rtol=1e-5, atol=1e-5, equal_nan=True):
        problems.append(f"{what}: values differ")
    return problems


def chains(seed: int, mesh: bool) -> list[str]:
    """Three random chains of calls on a random uneven tensor in a random layout; every difference from plain torch,
    described."""
    rng = random.Random(seed)
    p = st.placement("cpu", [[0, 1], [2, 3]] if mesh else [0, 1, 2])
    problems = []
    for _ in range(3):
        shape = tuple(rng.choice([1, 2, 3, 5, 7]) for _ in range(rng.randint(2, 5)))
        if rng.random() < 0.3 and len(shape) > 2:  # (square trailing dims: a transposed operand fits)
            shape = shape[:-1] + (shape[-2],)
        X = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        sbp = tuple(rng.choice([B, P] + [S(d) for d in range(len(shape))]) for _ in range(p.ndim))
        x, plain, path = layout(X, p, sbp), X, f"{shape} laid out as {sbp}"
        for _ in range(rng.randint(1, 4)):
            name = rng.choice([n for n, (_, dims) in CALLS.items() if plain.dim() >= dims])
            call = CALLS[name][0]
            state = rng.getstate()
            path += f", {name}"
            try:
                want = call(plain, rng)
            except RuntimeError as err:  # refused by torch: refused alike here
                rng.setstate(state)
                try:
                    call(x, rng)
                    problems.append(f"{path}: plain torch refuses ({err}), the global tensor does not")
                except RuntimeError:
                    pass
                break
            rng.setstate(state)
            got = call(x, rng)
            problems += _compare(got, want, path)
            x, plain = got, want
    return problems


@settings(max_examples=8, deadline=None)
@given(seed=st_.integers(0, 2**20), mesh=st_.booleans())
def test_strides_and_contiguity_are_the_logical_tensors(seed, mesh):
    per_rank = run_on_world(4 if mesh else 3, chains, seed, mesh)
    assert per_rank[0] == [], "\n".join(per_rank[0])


def refused_view():
    p = st.placement("cpu", [0, 1, 2])
    x = layout(torch.randn(5, 4), p, S(0)).t()
    try:
        x.view(-1)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def test_a_view_plain_torch_refuses_is_refused_on_every_rank():
    with pytest.raises(RuntimeError) as plain:
        torch.randn(5, 4).t().view(-1)
    for message in run_on_world(3, refused_view):
        assert message is not None and str(plain.value).splitlines()[0] in message, message
