"""Layer, group and batch normalization on global tensors against plain torch: splits that keep the
statistics local, and synchronized batch norm (statistics all-reduced) for batch splits in training."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import check_cases
from world import run_on_world

pytestmark = pytest.mark.gloo

GEN = torch.Generator().manual_seed(0)
TOKENS = torch.randn(5, 3, 6, generator=GEN, dtype=torch.float64)
GAIN = torch.rand(6, generator=GEN, dtype=torch.float64) + 0.5
SHIFT = torch.randn(6, generator=GEN, dtype=torch.float64)
GAIN_2D = torch.rand(3, 6, generator=GEN, dtype=torch.float64) + 0.5
IMAGES = torch.randn(5, 4, 3, 3, generator=GEN, dtype=torch.float64)
CHANNEL_GAIN = torch.rand(4, generator=GEN, dtype=torch.float64) + 0.5
CHANNEL_SHIFT = torch.randn(4, generator=GEN, dtype=torch.float64)
RUNNING_MEAN = torch.randn(4, generator=GEN, dtype=torch.float64)
RUNNING_VAR = torch.rand(4, generator=GEN, dtype=torch.float64) + 0.5


def layer_norm(x, w=None, b=None):
    return F.layer_norm(x, (6,), w, b)


def layer_norm_2d(x, w):
    return F.layer_norm(x, (3, 6), w)


def group_norm(x, w, b):
    return F.group_norm(x, 2, w, b)


def batch_norm_eval(x, w, b, mean, var):
    return F.batch_norm(x, mean.detach(), var.detach(), w, b, training=False)


def batch_norm_train(x, w, b):
    return F.batch_norm(x, None, None, w, b, training=True)


def batch_norm_running(x, w, b, mean, var):
    """Training with running statistics: they are returned too, to compare their in-place update."""
    mean, var = mean.detach(), var.detach()
    return F.batch_norm(x, mean, var, w, b, training=True, momentum=0.3), mean, var


AFFINE = [GAIN, SHIFT]
CHANNEL_AFFINE = [CHANNEL_GAIN, CHANNEL_SHIFT]
STATS = [RUNNING_MEAN, RUNNING_VAR]

# (function, inputs, input sbps, output sbp, gradient sbps of the floating inputs) on a 1-D placement
CASES_1D = [
    (layer_norm, [TOKENS] + AFFINE, [S(0), B, B], S(0), [S(0), P, P]),
    (layer_norm, [TOKENS] + AFFINE, [S(1), B, B], S(1), [S(1), P, P]),
    (layer_norm, [TOKENS], [S(1)], S(1), [S(1)]),
    (layer_norm_2d, [TOKENS, GAIN_2D], [S(0), B], S(0), [S(0), P]),
    (group_norm, [IMAGES] + CHANNEL_AFFINE, [S(0), B, B], S(0), [S(0), P, P]),
    (batch_norm_eval, [IMAGES] + CHANNEL_AFFINE + STATS, [S(0), B, B, B, B], S(0), [S(0), P, P, None, None]),
    (batch_norm_eval, [IMAGES] + CHANNEL_AFFINE + STATS, [S(1)] + [S(0)] * 4, S(1), [S(1), S(0), S(0), None, None]),
    (batch_norm_train, [IMAGES] + CHANNEL_AFFINE, [S(1), S(0), S(0)], S(1), [S(1), S(0), S(0)]),
    (batch_norm_train, [IMAGES] + CHANNEL_AFFINE, [S(0), B, B], S(0), [S(0), B, B]),
    (batch_norm_train, [IMAGES] + CHANNEL_AFFINE, [S(3), B, B], S(3), [S(3), B, B]),
    (batch_norm_running, [IMAGES] + CHANNEL_AFFINE + STATS, [S(0), B, B, B, B], S(0), [S(0), B, B, None, None]),
]

CASES_2D = [
    (layer_norm, [TOKENS] + AFFINE, [(S(0), S(1)), (B, B), (B, B)], (S(0), S(1)), [(S(0), S(1)), (P, P), (P, P)]),
    (
        group_norm,
        [IMAGES] + CHANNEL_AFFINE,
        [(S(0), S(0)), (B, B), (B, B)],
        (S(0), S(0)),
        [(S(0), S(0)), (P, P), (P, P)],
    ),
    (
        batch_norm_train,
        [IMAGES] + CHANNEL_AFFINE,
        [(S(0), S(1)), (B, S(0)), (B, S(0))],
        (S(0), S(1)),
        [(S(0), S(1)), (B, S(0)), (B, S(0))],
    ),
    (
        batch_norm_running,
        [IMAGES] + CHANNEL_AFFINE + STATS,
        [(S(0), S(2))] + [(B, B)] * 4,
        (S(0), S(2)),
        [(S(0), S(2)), (B, B), (B, B), None, None],
    ),
]


def normalization_1d(n):
    check_cases(CASES_1D, st.placement("cpu", list(range(n))), "1-D")


def normalization_2d():
    check_cases(CASES_2D, st.placement("cpu", [[0, 1], [2, 3]]), "2-D")


def test_normalization_1d():
    run_on_world(2, normalization_1d, 2)
    run_on_world(3, normalization_1d, 3)


def test_normalization_2x2():
    run_on_world(4, normalization_2d)


def batch_norm_legit(x, w, b, mean, var):
    """The schema-annotated variant (what decompositions call): writes the statistics, returns new tensors."""
    mean, var = mean.detach().clone(), var.detach().clone()
    out = torch.ops.aten._native_batch_norm_legit(x, w, b, mean, var, True, 0.3, 1e-5)
    return out[0], mean, var


def running_statistics_kept_in_place(n):
    """Running statistics laid out unlike the rule's signatures must still be updated where they live (a
    boxed copy of them once took the update and the module's own buffers kept their old values)."""
    p = st.placement("cpu", list(range(n)))
    inputs = [IMAGES] + CHANNEL_AFFINE + STATS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # these layouts take the fallback
        check_op(batch_norm_running, inputs, p, [S(0), B, B, S(0), S(0)])
        check_op(batch_norm_running, inputs, p, [S(1), S(0), S(0), B, P])
        check_op(batch_norm_legit, inputs, p, [S(0), B, B, B, B])
        check_op(batch_norm_legit, inputs, p, [S(0), B, B, S(0), B])
        # one channel: a channel split would leave a rank none (torch's kernel dies of SIGFPE there)
        one = [IMAGES[:, :1], CHANNEL_GAIN[:1], CHANNEL_SHIFT[:1], RUNNING_MEAN[:1], RUNNING_VAR[:1]]
        check_op(batch_norm_running, one, p, [S(1), S(0), S(0), S(0), S(0)])
        check_op(batch_norm_train, one[:3], p, [S(1), S(0), S(0)])


def test_running_statistics_are_updated_in_their_own_layout():
    run_on_world(2, running_statistics_kept_in_place, 2)


# name: (the layer, whether its input takes a gradient)
RAW_INPUT_LAYERS = {
    "batch norm, raw input": (lambda: nn.BatchNorm1d(4), False),
    "batch norm eval, raw input": (lambda: nn.BatchNorm1d(4).eval(), False),
    "batch norm, no affine": (lambda: nn.BatchNorm1d(4, affine=False), True),
    "instance norm, raw input": (lambda: nn.InstanceNorm1d(4, affine=True), False),
}


def _trained(layer, source, input_grad: bool) -> list:
    """The output of ``layer`` on ``source`` and the gradients a weighted sum of it gives."""
    out = layer(source)
    weights = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(1))
    if isinstance(source, st.GlobalTensor):
        weights = weights.to_global(source.placement, B)
    (out * weights).sum().backward()
    return [out.detach()] + ([source.grad] if input_grad else [q.grad for q in layer.parameters()])


def layers_on_raw_input() -> list:
    """Normalization layers whose input does not require grad (the first layer on data: autograd asks for the
    parameters' gradients alone), and batch norm without affine parameters (the input's gradient alone), trained
    and evaluated on broadcast and split batches: (name, layout, the output and each gradient, in full)."""
    p = st.placement("cpu", [0, 1])
    x = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(0))
    results = []
    for name, (make, input_grad) in RAW_INPUT_LAYERS.items():
        for sbp in (B, S(0), S(2)):
            source = x.to_global(p, B).to_global(sbp=sbp).detach().requires_grad_(input_grad)
            got = _trained(make().to_global(p), source, input_grad)
            results.append((name, repr(sbp), [g.full_tensor() for g in got]))
    return results


def test_normalization_layers_on_input_that_takes_no_gradient():
    x = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(0))
    want = {
        name: _trained(make(), x.clone().requires_grad_(input_grad), input_grad)
        for name, (make, input_grad) in RAW_INPUT_LAYERS.items()
    }
    for results in run_on_world(2, layers_on_raw_input):
        for name, sbp, got in results:
            for k, (a, b) in enumerate(zip(got, want[name], strict=True)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}, {sbp}, value {k}")
