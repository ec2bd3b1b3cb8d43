"""Check an op on global tensors against the same op on plain tensors, forward and backward.

Call ``check_op`` inside a ``run_on_world`` body. Every rank builds the same full input tensors (from a
seed), lays them out in the given SBPs, runs ``fn`` on the global tensors and on the plain ones, and compares
the logical outputs and the gradients of every floating input (through a fixed random weighting of the
outputs, so that every output element matters).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from sbp_torch.sbp import broadcast


def layout(full: torch.Tensor, placement, sbp) -> torch.Tensor:
    """The global tensor whose logical value is ``full`` (the same on every rank), laid out as ``sbp``."""
    replicated = (broadcast,) * placement.ndim
    return full.to_global(placement, replicated).to_global(sbp=sbp)


def _float_leaves(tensors):
    return [t for t in tensors if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def check_op(fn, inputs, placement, sbps, *, backward=True, atol=1e-5, rtol=1e-4, expect_sbp=None):
    """Compare ``fn(*global inputs)`` with ``fn(*inputs)``.

    Args:
        fn: the computation, on tensors (and Python values, passed through unchanged).
        inputs: full input values (tensors are the logical values, equal on every rank).
        placement: where the global inputs live.
        sbps: one SBP (or tuple) per input; None for a non-tensor input.
        backward: also compare gradients of the floating inputs.
        expect_sbp: if given, the SBP the (first) output must have.
    Returns:
        The SBPs of the global outputs, for the caller to inspect.
    """
    plain = [x.detach().clone().requires_grad_(backward) if _float_leaves([x]) else x for x in inputs]
    mine = [x.detach().clone().requires_grad_(backward) if _float_leaves([x]) else x for x in inputs]
    as_global = [
        layout(x, placement, s) if isinstance(x, torch.Tensor) and s is not None else x for x, s in zip(mine, sbps)
    ]
    member = placement.coord_of(torch.distributed.get_rank()) is not None  # others hold empty parts
    want, got = fn(*plain), fn(*as_global)
    want_leaves, _ = tree_flatten(want)
    got_leaves, _ = tree_flatten(got)
    assert len(want_leaves) == len(got_leaves)
    out_sbps = []
    for w, g in zip(want_leaves, got_leaves):
        if not isinstance(w, torch.Tensor):
            assert w == g
            continue
        assert g.is_global, f"output is not global: {type(g)}"
        out_sbps.append(g.sbp)
        if member:
            torch.testing.assert_close(
                g.full_tensor(), w.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{m} (output {g.sbp})"
            )
    if expect_sbp is not None:
        assert out_sbps[0] == expect_sbp, f"output sbp {out_sbps[0]}, expected {expect_sbp}"
    if backward:
        pairs = [
            (w, g)
            for w, g in zip(want_leaves, got_leaves)
            if isinstance(w, torch.Tensor) and w.requires_grad and w.is_floating_point()
        ]
        if pairs:
            gen = torch.Generator().manual_seed(7)
            weights = [torch.randn(w.shape, generator=gen, dtype=w.dtype) for w, _ in pairs]
            sum(((w * c).sum() for (w, _), c in zip(pairs, weights))).backward()
            sum(((g * layout(c, placement, g.sbp)).sum() for (_, g), c in zip(pairs, weights))).backward()
            for x, y in zip(plain, mine):
                if member and isinstance(x, torch.Tensor) and x.requires_grad:
                    if x.grad is None:
                        assert y.grad is None or not y.grad.any()
                    else:
                        torch.testing.assert_close(y.grad, x.grad, atol=atol, rtol=rtol, msg=lambda m: f"gradient: {m}")
    return out_sbps
