"""Indexing ops (``_signatures/indexing.py``) against plain torch, forward and backward.

Each case names the output SBP its rule must give (the fallback would give broadcast) and runs in strict
mode, backward included; the backward passes go through ``new_zeros`` and the ``index_add``/``scatter_add``/
``index_put`` rules. Data-dependent ops (``masked_select``, ``nonzero``, ``unique``, boolean masks) must
take the broadcast fallback and still be right.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

import sbp_torch as st
from sbp_torch._signatures.indexing import index_result_dims
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max as P_MAX
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import strict
from world import run_on_world

pytestmark = pytest.mark.gloo


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _unique_positions(shape, dim, size, seed):
    """An index of ``shape`` along ``dim`` of a tensor of ``size`` whose positions are distinct per line."""
    keys = torch.rand(shape[:dim] + (size,) + shape[dim + 1 :], generator=torch.Generator().manual_seed(seed))
    return keys.argsort(dim).narrow(dim, 0, shape[dim])


def _put(x, i, v):
    y = x.clone()
    y[:, i] = v
    return y


def _accumulate(x, i, v):
    return x.index_put((i,), v, accumulate=True)


def _under_mask(x, mask):
    y = x.clone()
    y[mask] = 0.5
    return y


def cases_1d() -> list:
    """(name, fn, inputs, SBP per input, expected output SBP)."""
    x, src = _x(5, 7, 3), _x(5, 4, 3, seed=1)
    idx = torch.tensor([0, 2, 2, 6])
    rows = torch.tensor([4, 0, 1])
    repeated_rows = torch.tensor([0, 2, 2, 4])
    near = torch.randint(0, 7, (5, 4, 3), generator=torch.Generator().manual_seed(2))
    unique = _unique_positions((5, 4, 3), 1, 7, seed=3)
    pair = torch.tensor([[0, 4], [1, 1], [3, 2]]), torch.tensor([[2, 0], [1, 2], [0, 0]])
    return [
        ("index_select", lambda a, i: a.index_select(1, i), [x, idx], [S(0), B], S(0)),
        ("index_select split index", lambda a, i: a.index_select(1, i), [x, idx], [B, S(0)], S(1)),
        ("index_select partial", lambda a, i: a.index_select(2, i[:2]), [x, idx], [P, B], P),
        ("gather", lambda a, i: a.gather(1, i), [x, near], [S(0), S(0)], S(0)),
        ("gather split index", lambda a, i: a.gather(1, i), [x, near], [B, S(1)], S(1)),
        ("gather partial", lambda a, i: a.gather(1, i), [x, near], [P_MAX, B], P_MAX),
        ("scatter", lambda a, i, s: a.scatter(1, i, s), [x, unique, src], [S(2), S(2), S(2)], S(2)),
        ("scatter partial", lambda a, i, s: a.scatter(1, i, s), [x, unique, src], [P, B, P], P),
        ("scatter value", lambda a, i: a.scatter(1, i, 2.0), [x, unique], [S(0), S(0)], S(0)),
        ("scatter_add", lambda a, i, s: a.scatter_add(1, i, s), [x, near, src], [S(0), S(0), S(0)], S(0)),
        ("scatter_add partial", lambda a, i, s: a.scatter_add(1, i, s), [x, near, src], [P, B, P], P),
        ("index_add", lambda a, i, s: a.index_add(1, i, s, alpha=2), [x, idx, src], [S(2), B, S(2)], S(2)),
        ("index_add partial", lambda a, i, s: a.index_add(1, i, s), [x, idx, src], [P, B, P], P),
        ("index", lambda a, i: a[:, i], [x, idx], [S(0), B], S(0)),
        ("index first dim", lambda a, i: a[i], [x, rows], [S(2), B], S(2)),
        ("index split index", lambda a, i: a[:, i], [x, idx], [B, S(0)], S(1)),
        ("index apart", lambda a, i, j: a[i, :, j], [x, *pair], [S(1), B, B], S(2)),
        ("index apart split index", lambda a, i, j: a[i, :, j], [x, *pair], [B, S(1), S(1)], S(1)),
        ("index partial", lambda a, i: a[:, i], [x, idx], [P, B], P),
        ("index_put", _put, [x, rows, _x(5, 3, 3, seed=4)], [S(0), B, S(0)], S(0)),
        ("index_put number", lambda a, i: _put(a, i, 1.5), [x, rows], [S(2), B], S(2)),
        ("index_put accumulate", _accumulate, [x, repeated_rows, _x(7, 3, seed=5)], [S(2), B, S(1)], S(2)),
        ("index_put partial", _accumulate, [x, repeated_rows, _x(4, 7, 3, seed=6)], [P, B, P], P),
        ("index_put one value under a mask", _under_mask, [x, x[..., 0] > 0], [S(1), S(1)], S(1)),
        ("index_put one value under a mask of fewer dims", _under_mask, [x, x[..., 0] > 0], [S(2), B], S(2)),
    ]


def cases_mesh() -> list:
    x, src = _x(5, 7, 3), _x(5, 4, 3, seed=1)
    idx = torch.tensor([0, 2, 2, 6])
    return [
        ("index_select", lambda a, i: a.index_select(1, i), [x, idx], [(S(0), S(2)), (B, B)], (S(0), S(2))),
        ("index_select split index", lambda a, i: a.index_select(1, i), [x, idx], [(S(0), B), (B, S(0))], (S(0), S(1))),
        ("index_add", lambda a, i, s: a.index_add(1, i, s), [x, idx, src], [(S(0), P), (B, B), (S(0), P)], (S(0), P)),
        ("index", lambda a, i: a[:, i], [x, idx], [(S(2), B), (B, S(0))], (S(2), S(1))),
        ("index_put one value under a mask", _under_mask, [x, x > 0], [(S(0), S(2)), (S(0), S(2))], (S(0), S(2))),
    ]


# Autograd's backward of index_put_ with tensor values makes a plain ``zeros`` of the values' shape, which
# dispatch refuses to mix with global tensors: forward only until dispatch accepts such tensors.
FORWARD_ONLY = {"index_put"}


def indexing_body(ranks):
    p = st.placement("cpu", ranks)
    for name, fn, inputs, sbps, expect in cases_mesh() if isinstance(ranks[0], list) else cases_1d():
        expect = expect if isinstance(expect, tuple) else (expect,)
        try:
            check = partial(check_op, expect_sbp=expect, backward=name not in FORWARD_ONLY)
            strict(check)(fn, inputs, p, sbps)
        except Exception as err:
            raise AssertionError(f"case {name!r}: {err}") from err
    return True


@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2], [[0, 1], [2, 3]]], ids=["2", "3", "2x2"])
def test_indexing_matches_torch(ranks):
    assert all(run_on_world(4 if isinstance(ranks[0], list) else len(ranks), indexing_body, ranks))


def data_dependent_body():
    p = st.placement("cpu", [0, 1, 2])
    x = _x(5, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warns once per op
        sbps = [
            check_op(lambda a: a.masked_select(a > 0), [x], p, [S(0)]),
            check_op(lambda a: a[a > 0], [x], p, [S(1)]),
            check_op(lambda a: (a > 0).nonzero(), [x], p, [S(0)], backward=False),
            check_op(lambda a: a.round().unique(), [x], p, [S(1)], backward=False),
        ]
    return sbps


def test_data_dependent_ops_fall_back():
    for sbps in run_on_world(3, data_dependent_body):
        assert all(s == [(B,)] for s in sbps)


def test_index_result_dims():
    i = torch.zeros(2, 3, dtype=torch.long)
    assert index_result_dims(4, [None, i, i]) == ({0: 0, 3: 3}, 1, (2, 3))
    assert index_result_dims(4, [i, None, i]) == ({1: 2, 3: 3}, 0, (2, 3))
    assert index_result_dims(3, [i]) == ({1: 2, 2: 3}, 0, (2, 3))


def _assign(x, index, value):
    x[index] = value
    return x


def _assign_add(x, index):
    x[index] += 1.5
    return x


def assignment_body(ranks):
    """``x[index] = value`` whose index cuts a dim that ``x`` splits (a view of it would be a copy), against plain
    torch, in strict mode (nothing gathered): ints, slices with steps and negative ends, ``...`` and ``None``,
    numbers, global values broadcast into the picked positions, and gradients to ``x``'s source and to the value;
    then augmented assignment, assignment into a view, ``fill_diagonal_`` and ``.data =``, and a placement that
    leaves a rank out."""
    p = st.placement("cpu", ranks)
    mesh = isinstance(ranks[0], list)
    full = _x(5, 7, 3, seed=7)
    cases = [
        ((S(0),), slice(1, 3), 7.0),
        ((S(0),), 1, 2.5),
        ((S(1),), (-1, slice(2, 6, 2)), _x(2, 3, seed=8)),
        ((S(2),), (Ellipsis, slice(1, None)), _x(2, seed=9)),
        ((S(0),), (None, slice(0, 4), 3), _x(1, 4, 3, seed=10)),
        ((S(1),), (slice(None), slice(-3, None)), _x(5, 1, 1, seed=11)),
        # a basic entry cutting the split dim beside advanced ones: torch writes into the basic entry's view
        ((S(0),), (1, [0, 2]), 5.0),
        ((S(0),), (slice(1, 3), [0, 2], 1), _x(2, 2, seed=15)),
        ((S(0),), torch.tensor(2), 4.0),  # (a 0-dim integer tensor: indexed as an int)
        ((S(1),), ([1, 2], 3), _x(2, 3, seed=16)),
    ]
    if mesh:
        cases = [((S(0), S(1)), (slice(1, 4), 2), 3.0), ((B, S(2)), (Ellipsis, 0), _x(5, 7, seed=12))]
        cases.append(((S(0), S(1)), ([0, 3], 2), 6.0))
    for sbp, index, value in cases:
        source = full.clone().requires_grad_()
        want = _assign(source * 1, index, value.requires_grad_() if isinstance(value, torch.Tensor) else value)
        got_source = full.to_global(p, (B,) * len(sbp)).to_global(sbp=sbp).requires_grad_()
        got_value = value
        if isinstance(value, torch.Tensor):
            got_value = value.detach().to_global(p, (B,) * len(sbp)).requires_grad_()
        with st.strict():
            got = _assign(got_source * 1, index, got_value)
        assert got.sbp == sbp, (index, got.sbp)
        torch.testing.assert_close(got.full_tensor(), want, msg=str(index))
        weights = _x(5, 7, 3, seed=13)
        (want * weights).sum().backward()
        (got * weights.to_global(p, (B,) * len(sbp))).sum().backward()
        torch.testing.assert_close(got_source.grad.full_tensor(), source.grad, msg=str(index))
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got_value.grad.full_tensor(), value.grad, msg=str(index))
    layout = (S(0), S(1)) if mesh else (S(0),)
    writes = [
        lambda t: _assign_add(t, slice(None, None, 2)),
        lambda t: t[..., 1:].__setitem__(2, 3.0),  # (into a view that shares t's parts)
        lambda t: t[:, :, 0].fill_diagonal_(0.5, wrap=True),  # (a write through as_strided in torch)
        lambda t: setattr(t, "data", t.data * 2),
    ]
    for k, write in enumerate(writes):
        source = full.clone().requires_grad_()
        got_source = full.to_global(p, (B,) * len(layout)).to_global(sbp=layout).requires_grad_()
        want, got = source * 1, got_source * 1
        write(want)
        with st.strict():
            write(got)
        assert got.sbp == layout
        torch.testing.assert_close(got.full_tensor(), want, msg=f"write {k}")
        weights = _x(5, 7, 3, seed=14)
        (want * weights).sum().backward()
        (got * weights.to_global(p, (B,) * len(layout))).sum().backward()
        torch.testing.assert_close(got_source.grad.full_tensor(), source.grad, msg=f"write {k}")
    want = full.clone()
    got = full.to_global(p, (B,) * len(layout)).to_global(sbp=layout)
    for t in (want, got):
        t[0, t[0] > 0] = 1.5  # (a global mask beside an int: the mask is made whole to pick the positions)
    torch.testing.assert_close(got.full_tensor(), want)
    if not mesh:  # (on a placement that leaves rank 0 out, which holds no part and runs every call alike)
        x, want = full.to_global(st.placement("cpu", [2, 1]), B).to_global(sbp=S(0)), full.clone()
        for t in (x, want):
            t[1:3] = 7.0
            t[0] = t[4]
        got = x.full_tensor()
        assert torch.equal(got, want) if torch.distributed.get_rank() else got.numel() == 0
    with pytest.raises(st.MixedTensorError):  # (this rank's plain tensor, as any op refuses it)
        full.to_global(p, (B,) * len(layout)).data = full.clone()
    return True


@pytest.mark.parametrize("ranks", [[0, 1, 2], [[0, 1], [2, 3]]], ids=["3", "2x2"])
def test_assignment_into_split_dims_writes_the_tensor(ranks):
    assert all(run_on_world(4 if isinstance(ranks[0], list) else 3, assignment_body, ranks))
