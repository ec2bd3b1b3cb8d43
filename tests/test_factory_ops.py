"""``*_like`` and ``new_*`` ops on global tensors (``_signatures/factory.py``) against plain torch.

The input's layout is taken as it is: splits are kept by ``*_like`` (and by ``new_*`` of the input's own
shape), broadcast and partial inputs give broadcast outputs, and ``new_*`` of another size keeps the splits of
dims that keep their index and size, and is broadcast elsewhere.
All of it runs in strict mode (no fallback), including the backward of a partial scalar loss, whose first
gradient is ``ones_like(loss)``.
"""

from __future__ import annotations

import pytest
import torch

import sbp_torch as st
from sbp_torch._layout import Partial
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max, partial_sum
from sbp_torch.sbp import split as S

from op_check import check_op, layout
from world import run_on_world

pytestmark = pytest.mark.gloo


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# expected output: the input's layout with partials made B; or its splits of dims the output keeps, B elsewhere
LIKE, KEPT = "like", "kept"


def cases() -> list:
    """(name, fn, input, expected output layout); uninitialised outputs are filled before the comparison."""
    x = _x(5, 7)
    return [
        ("zeros_like", torch.zeros_like, x, LIKE),
        ("ones_like", torch.ones_like, x, LIKE),
        ("full_like", lambda a: torch.full_like(a, 2.5, dtype=torch.float32), x, LIKE),
        ("empty_like", lambda a: torch.empty_like(a).zero_(), x, LIKE),
        ("new_zeros", lambda a: a.new_zeros(3, 4), x, KEPT),
        ("new_ones own shape", lambda a: a.new_ones(5, 7), x, LIKE),
        ("new_full", lambda a: a.new_full((2, 7), 3.0), x, KEPT),
        ("new_empty own shape", lambda a: a.new_empty(5, 7).fill_(1.0), x, LIKE),
        ("new_empty_strided", lambda a: a.new_empty_strided((5, 7), (7, 1)).zero_(), x, LIKE),
        ("new_empty_strided other", lambda a: a.new_empty_strided((7,), (1,)).zero_(), x, KEPT),
        ("new_empty rows kept", lambda a: a.new_empty(5, 3).fill_(1.0), x, KEPT),
    ]


def factory_body(ranks):
    p = st.placement("cpu", ranks)
    if isinstance(ranks[0], list):
        layouts = [(S(0), S(1)), (S(1), partial_max), (partial_sum, B)]
    else:
        layouts = [(S(0),), (S(1),), (partial_sum,), (B,)]
    st.set_strict(True)
    try:
        for name, fn, x, expected in cases():
            for sbp in layouts:
                like = tuple(B if isinstance(s, Partial) else s for s in sbp)
                out_shape = fn(x).shape
                kept = tuple(
                    s if isinstance(s, type(S(0))) and s.dim < len(out_shape) and out_shape[s.dim] == x.shape[s.dim]
                    else B
                    for s in sbp
                )  # fmt: skip
                expect = like if expected == LIKE else kept
                try:
                    check_op(fn, [x], p, [sbp], backward=False, expect_sbp=expect)
                except Exception as err:
                    raise AssertionError(f"case {name!r} on {sbp}: {err}") from err
        leaf = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
        loss = layout(leaf, p, (partial_sum,) * p.ndim) * 2.0
        loss.backward()  # autograd starts from ones_like(loss): a broadcast one
        return leaf.grad.item()
    finally:
        st.set_strict(False)


@pytest.mark.parametrize("ranks", [[0, 1], [0, 1, 2], [[0, 1], [2, 3]]], ids=["2", "3", "2x2"])
def test_factory_ops_keep_layouts(ranks):
    world = 4 if isinstance(ranks[0], list) else len(ranks)
    assert run_on_world(world, factory_body, ranks) == [2.0] * world
