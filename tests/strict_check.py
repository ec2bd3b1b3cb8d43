"""Proof that ops run on their inputs' layouts: strict mode (no broadcast fallback) and the layouts that
outputs and gradients come out in. Use inside ``run_on_world`` bodies, next to ``op_check.check_op`` (which
compares the values)."""

from __future__ import annotations

import contextlib

import torch

import sbp_torch as st

from op_check import check_op, layout


def strict(fn):
    """``fn`` run in strict mode: an op without a fitting signature raises instead of gathering."""

    def run(*args, **kwargs):
        with st.strict():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def recording_collectives(*names):
    """The calls of the named collectives of ``sbp_torch._comm`` (``"all_reduce"``, ...), recorded as
    ``(name, input shape)`` in the yielded list while the block runs (for a collective of several tensors, as
    ``start_reduce_scatter_parts``, the number of tensors stands for the shape)."""
    from sbp_torch import _comm as _collectives

    calls = []
    originals = {name: getattr(_collectives, name) for name in names}

    def recording(name, collective):
        def run(x, *args):
            calls.append((name, tuple(x.shape) if isinstance(x, torch.Tensor) else len(x)))
            return collective(x, *args)

        return run

    for name, collective in originals.items():
        setattr(_collectives, name, recording(name, collective))
    try:
        yield calls
    finally:
        for name, collective in originals.items():
            setattr(_collectives, name, collective)


@contextlib.contextmanager
def strict_recording_moves():
    """Strict mode, with every all-gather and all-to-all recorded as ``(collective name, input shape)`` in
    the yielded list: for tests that some tensor never moves whole."""
    with st.strict(), recording_collectives("all_gather", "all_to_all") as moved:
        yield moved


def gradient_layouts(fn, inputs, placement, sbps):
    """Run ``fn`` forward and backward on global inputs, all in strict mode, and return the output's SBP and
    the SBPs of the gradients of the floating inputs (None where no gradient arrived).

    The output's gradient is given directly, laid out as ``gradient_sbp`` of the output, so the backward
    runs only the op's own backward ops (no ``ones_like``/``expand`` of a loss).
    """
    wants_grad = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in inputs]
    as_global = [
        layout(x, placement, s).detach().requires_grad_(w) if isinstance(x, torch.Tensor) else x
        for x, s, w in zip(inputs, sbps, wants_grad)
    ]
    out = strict(fn)(*as_global)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    grad = layout(grad, placement, st.gradient_sbp(out.sbp))
    strict(out.backward)(grad)
    return out.sbp, [None if x.grad is None else x.grad.sbp for x, w in zip(as_global, wants_grad) if w]


def _as_tuple(sbp):
    return sbp if isinstance(sbp, tuple) or sbp is None else (sbp,)


def _first_output(fn):
    def first(*args):
        out = fn(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    return first


def check_cases(cases, placement, kind: str) -> None:
    """Each case ``(fn, inputs, input sbps, output sbp, gradient sbps)``: the values against torch
    (``check_op``), then, in strict mode, the layout of the (first) output and of each floating input's
    gradient (None where none arrives). One SBP stands for a 1-tuple."""
    for i, (fn, inputs, sbps, expect, expect_grads) in enumerate(cases):
        expect = _as_tuple(expect)
        expect_grads = [_as_tuple(g) for g in expect_grads]
        sbps = [_as_tuple(s) for s in sbps]
        try:
            check_op(fn, inputs, placement, sbps, expect_sbp=expect)
            out_sbp, grads = gradient_layouts(_first_output(fn), inputs, placement, sbps)
            assert (out_sbp, grads) == (expect, expect_grads), f"output, gradients: {out_sbp}, {grads}"
        except Exception as err:
            raise AssertionError(f"{kind} case {i}: {err}") from err
