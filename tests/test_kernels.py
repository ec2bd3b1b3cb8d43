"""sbp_torch.kernels: the reference implementations against the unfused PyTorch expressions (forward and
backward, float32/float64, odd sizes, non-contiguous inputs), and the custom ops on global tensors on 2 and 3
ranks under each signature of their rule, forward and backward, against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_torch as st
from sbp_torch import kernels as K
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op
from strict_check import strict_recording_moves
from world import run_on_world

GEN = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=GEN, dtype=dtype)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _softmax_unfused(x, mask=None, scale=1.0, causal=False):
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1)


def _target(rows, classes, ignore=-100):
    t = torch.randint(0, classes, (rows,), generator=GEN)
    t[1] = ignore
    return t


# (fused, unfused, input builder(dtype)) over odd sizes
REFERENCE_CASES = {
    "bias_gelu_tanh": (
        lambda x, b: K.bias_gelu(x, b),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
        lambda dt: [_randn(3, 5, 7, dtype=dt), _randn(7, dtype=dt)],
    ),
    "bias_gelu_erf": (
        lambda x, b: K.bias_gelu(x, b, "none"),
        lambda x, b: F.gelu(x + b),
        lambda dt: [_randn(5, 7, dtype=dt), _randn(7, dtype=dt)],
    ),
    "layer_norm": (
        K.layer_norm,
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        lambda dt: [_randn(3, 5, 9, dtype=dt), _randn(9, dtype=dt), _randn(9, dtype=dt)],
    ),
    "rms_norm": (K.rms_norm, _rms, lambda dt: [_randn(5, 9, dtype=dt), _randn(9, dtype=dt)]),
    "softmax_mask": (
        lambda x, m: K.scale_mask_softmax(x, m, 0.7),
        lambda x, m: _softmax_unfused(x, m, 0.7),
        lambda dt: [_randn(2, 3, 5, 7, dtype=dt), torch.rand(1, 3, 1, 7, generator=GEN) < 0.3],
    ),
    "softmax_causal": (
        lambda x: K.scale_mask_softmax(x, None, 0.5, True),
        lambda x: _softmax_unfused(x, None, 0.5, True),
        lambda dt: [_randn(2, 5, 5, dtype=dt)],
    ),
    "cross_entropy_mean": (K.cross_entropy, F.cross_entropy, lambda dt: [_randn(7, 13, dtype=dt) * 3, _target(7, 13)]),
    "cross_entropy_sum": (
        lambda x, t: K.cross_entropy(x, t, 2, "sum"),
        lambda x, t: F.cross_entropy(x, t, ignore_index=2, reduction="sum"),
        lambda dt: [_randn(7, 13, dtype=dt), _target(7, 13, 2)],
    ),
    "cross_entropy_none": (
        lambda x, t: K.cross_entropy(x, t, reduction="none"),
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        lambda dt: [_randn(7, 13, dtype=dt), _target(7, 13)],
    ),
}


def _compare(fused, unfused, inputs, atol=None, rtol=None):
    a = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    b = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    got, want = fused(*a), unfused(*b)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    weight = torch.randn(want.shape, generator=GEN, dtype=want.dtype)
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(x.grad, y.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_reference_equals_unfused(name, dtype):
    fused, unfused, build = REFERENCE_CASES[name]
    _compare(fused, unfused, build(dtype))


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_non_contiguous_inputs(name):
    """Transposed views give the same results as their contiguous copies."""
    fused, unfused, build = REFERENCE_CASES[name]
    inputs = [x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() >= 2 else x for x in build(torch.float64)]
    assert any(not x.is_contiguous() for x in inputs)
    _compare(fused, unfused, inputs)


def test_cross_entropy_chunks_the_vocabulary(monkeypatch):
    """Columns in several chunks (the last one short) give the one-pass result."""
    from sbp_torch.kernels import _cross_entropy

    monkeypatch.setattr(_cross_entropy, "CHUNK", 4)
    _compare(K.cross_entropy, F.cross_entropy, [_randn(6, 11) * 5, _target(6, 11)])


def test_bias_dropout_add_mask_is_the_random_rule():
    """The mask is ``torch.rand`` of the logical shape < 1 - p (the CPU rule of sbp_torch._random); the
    gradient goes through the same mask; without training, nothing is drawn."""
    x, b, r = _randn(5, 7), _randn(7), _randn(5, 7)
    torch.manual_seed(3)
    got = K.bias_dropout_add(x, b, r, 0.3)
    torch.manual_seed(3)
    keep = torch.rand(5, 7, dtype=x.dtype) < 0.7
    torch.testing.assert_close(got, (x + b) * keep / 0.7 + r)
    state = torch.get_rng_state()
    torch.testing.assert_close(K.bias_dropout_add(x, b, r, 0.3, training=False), x + b + r)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(3)
    _compare(lambda x, b, r: K.bias_dropout_add(x, b, r, 0.3), lambda x, b, r: (x + b) * keep / 0.7 + r, [x, b, r])


ops = torch.ops.sbp_torch


def _layer_norm_backward(g, x, w, b):
    _, mean, rstd = ops.layer_norm(x, w, b, 1e-5)
    return ops.layer_norm_backward(g, x, w, mean, rstd)


def _rms_norm_backward(g, x, w):
    return ops.rms_norm_backward(g, x, w, ops.rms_norm(x, w, 1e-6)[1])


KEEP = torch.rand(3, 5, 7, generator=GEN) < 0.6

# backward op (output gradient first, then the forward's inputs) -> its unfused forward, differentiated by autograd
BACKWARD_CASES = {
    "bias_gelu": (
        lambda g, x, b: ops.bias_gelu_backward(g, x, b, "tanh"),
        lambda x, b: F.gelu(x + b, approximate="tanh"),
    ),
    "bias_gelu_1d": (lambda g, x, b: ops.bias_gelu_backward(g, x, b, "none"), lambda x, b: F.gelu(x + b)),
    "bias_dropout_add": (
        lambda g, x, b: ops.bias_dropout_add_backward(g, KEEP, 1 / 0.6),
        lambda x, b: (x + b) * KEEP / 0.6,
    ),
    "softmax": (
        lambda g, x: ops.scale_mask_softmax_backward(g, _softmax_unfused(x, None, 0.7, True), 0.7),
        lambda x: _softmax_unfused(x, None, 0.7, True),
    ),
    "layer_norm": (_layer_norm_backward, lambda x, w, b: F.layer_norm(x, (7,), w, b)),
    "rms_norm": (_rms_norm_backward, _rms),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_CASES))
def test_backward_ops_equal_autograd_of_unfused(name):
    """Each backward op's reference gives autograd's gradients of the unfused expression, float64."""
    backward, unfused = BACKWARD_CASES[name]
    x = _randn(7) if name.endswith("_1d") else _randn(3, 5, 7)
    params = [_randn(7) for _ in range({"softmax": 0, "layer_norm": 2}.get(name, 1))]
    inputs = [x] + params
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = unfused(*leaves)
    g = torch.randn(out.shape, generator=GEN, dtype=out.dtype)
    want = torch.autograd.grad(out, leaves, g)
    got = backward(g, *inputs)
    got = (got,) if isinstance(got, torch.Tensor) else got
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_refusals():
    with pytest.raises(ValueError, match="1-D parameter"):
        K.bias_gelu(_randn(3, 4), _randn(3))
    with pytest.raises(ValueError, match="approximate"):
        K.bias_gelu(_randn(3, 4), _randn(4), "fast")
    with pytest.raises(ValueError, match="logits"):
        K.cross_entropy(_randn(2, 3, 4), _target(2, 4))
    with pytest.raises(TypeError, match="bool"):
        K.scale_mask_softmax(_randn(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="p must be"):
        K.bias_dropout_add(_randn(3, 4), _randn(4), _randn(3, 4), 1.5)


def test_fake_implementations_trace():
    """Every op runs on meta tensors (what torch.compile and the dispatcher's shape inference use)."""
    x, v = torch.empty(4, 6, device="meta"), torch.empty(6, device="meta")
    t = torch.empty(4, dtype=torch.long, device="meta")
    assert K.bias_gelu(x, v).shape == (4, 6)
    assert K.layer_norm(x, v, v).shape == K.rms_norm(x, v).shape == (4, 6)
    assert K.scale_mask_softmax(x, None, 1.0, True).shape == (4, 6)
    assert K.cross_entropy(x, t).shape == () and K.cross_entropy(x, t, reduction="none").shape == (4,)


# ---------------------------------------------------------------------------------------------------------
# global tensors

X3 = _randn(5, 4, 7)
BIAS = _randn(7)
LOGITS = _randn(7, 11) * 3
TARGET = _target(7, 11)

# (function, inputs, sbps on a 1-D placement, expected output sbp)
GLOBAL_CASES = [
    (lambda x, b: K.bias_gelu(x, b), [X3, BIAS], [S(0), B], S(0)),
    (lambda x, b: K.bias_gelu(x, b, "none"), [X3, BIAS], [S(1), B], S(1)),
    (lambda x, b: K.bias_gelu(x, b), [X3, BIAS], [S(2), S(0)], S(2)),
    (lambda x, b: K.bias_gelu(x, b), [X3, BIAS], [B, B], B),
    (K.layer_norm, [X3, BIAS, BIAS * 0.5], [S(0), B, B], S(0)),
    (K.layer_norm, [X3, BIAS, BIAS * 0.5], [S(1), B, B], S(1)),
    (K.rms_norm, [X3, BIAS], [S(1), B], S(1)),
    (K.rms_norm, [X3, BIAS], [B, B], B),
    (lambda x: K.scale_mask_softmax(x, None, 0.5), [X3], [S(1)], S(1)),
    (lambda x, m: K.scale_mask_softmax(x, m), [X3, torch.rand(4, 7, generator=GEN) < 0.3], [S(1), S(0)], S(1)),
    (lambda x, m: K.scale_mask_softmax(x, m), [X3, torch.rand(4, 7, generator=GEN) < 0.3], [S(0), B], S(0)),
    (lambda x: K.scale_mask_softmax(x, None, 1.0, True), [_randn(3, 5, 5)], [S(0)], S(0)),
    (K.cross_entropy, [LOGITS, TARGET], [S(1), B], B),
    (lambda x, t: K.cross_entropy(x, t, reduction="sum"), [LOGITS, TARGET], [S(1), B], B),
    (lambda x, t: K.cross_entropy(x, t, reduction="none"), [LOGITS, TARGET], [S(1), B], B),
    (K.cross_entropy, [LOGITS, TARGET], [S(0), S(0)], P),
    (lambda x, t: K.cross_entropy(x, t, reduction="sum"), [LOGITS, TARGET], [S(0), S(0)], P),
    (lambda x, t: K.cross_entropy(x, t, reduction="none"), [LOGITS, TARGET], [S(0), S(0)], S(0)),
]


def _dropout(x, b, r):
    return K.bias_dropout_add(x, b, r, 0.4)


def _seeded_dropout(x, b, r):
    """check_op calls this twice (plain, global): the same seed makes the same logical mask."""
    torch.manual_seed(5)
    return _dropout(x, b, r)


def _dropout_case(p, sbps, expect):
    """The logical dropout result on global tensors equals the one-process result after the same seed."""
    torch.manual_seed(5)
    want = _dropout(X3, BIAS, X3 * 2)
    torch.manual_seed(5)
    got = _dropout(*[x.to_global(p, (B,)).to_global(sbp=(s,)) for x, s in zip([X3, BIAS, X3 * 2], sbps)])
    assert got.sbp == (expect,)
    torch.testing.assert_close(got.full_tensor(), want)


GRAD3 = _randn(5, 4, 7)
_, MEAN3, RSTD3 = ops.layer_norm(X3, BIAS, BIAS * 0.5, 1e-5)
RMS_RSTD3 = ops.rms_norm(X3, BIAS, 1e-6)[1]
MASK3 = torch.rand(5, 4, 7, generator=GEN) < 0.6

# backward ops called on global tensors: (op, inputs, their sbps, the outputs' sbps): a row split makes the
# parameters' gradients partial sums; a feature split splits them
BACKWARD_GLOBAL_CASES = [
    (ops.layer_norm_backward, [GRAD3, X3, BIAS, MEAN3, RSTD3], [S(1), S(1), B, S(1), S(1)], (S(1), P, P)),
    (ops.rms_norm_backward, [GRAD3, X3, BIAS, RMS_RSTD3], [S(0), S(0), B, S(0)], (S(0), P)),
    (lambda g, x, b: ops.bias_gelu_backward(g, x, b, "tanh"), [GRAD3, X3, BIAS], [S(2), S(2), S(0)], (S(2), S(0))),
    (lambda g, m: ops.bias_dropout_add_backward(g, m, 2.0), [GRAD3, MASK3], [S(0), S(0)], (S(0), P)),
    (lambda g, y: ops.scale_mask_softmax_backward(g, y, 0.5), [GRAD3, X3.softmax(-1)], [S(1), S(1)], (S(1),)),
]


def kernels_on_world(n):
    p = st.placement("cpu", list(range(n)))
    for i, (fn, inputs, sbps, expect) in enumerate(GLOBAL_CASES):
        try:
            check_op(fn, inputs, p, [(s,) for s in sbps], expect_sbp=(expect,), atol=1e-9, rtol=1e-7)
        except Exception as err:
            raise AssertionError(f"case {i}: {err}") from err
    for i, (fn, inputs, sbps, expect) in enumerate(BACKWARD_GLOBAL_CASES):
        got = check_op(fn, inputs, p, [(s,) for s in sbps], backward=False, atol=1e-9, rtol=1e-7)
        assert tuple(s for (s,) in got) == expect, f"backward case {i}: {got}"
    for sbps, expect in [([S(0), B, S(0)], S(0)), ([S(2), S(0), S(2)], S(2)), ([B, B, B], B)]:
        _dropout_case(p, sbps, expect)
    check_op(_seeded_dropout, [X3, BIAS, X3 * 2], p, [(S(1),), (B,), (S(1),)], expect_sbp=(S(1),))


@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 3])
def test_kernels_on_global_tensors(n):
    run_on_world(n, kernels_on_world, n)


def vocab_parallel_moves_no_logits(mesh_ranks, logits_sbp, target_sbp):
    """Cross entropy on logits split over the vocabulary (and, on a mesh, the rows too), forward and backward
    in strict mode with every all-gather and all-to-all recorded: nothing wider than a row moves."""
    p = st.placement("cpu", mesh_ranks)
    logits = LOGITS.to_global(p, (B,) * p.ndim).to_global(sbp=logits_sbp).detach().requires_grad_()
    target = TARGET.to_global(p, (B,) * p.ndim).to_global(sbp=target_sbp)
    with strict_recording_moves() as moved:
        loss = K.cross_entropy(logits, target)
        loss.backward()
    assert not [m for m in moved if len(m[1]) > 1 and m[1][-1] > 1], f"logits moved: {moved}"
    assert logits.grad.sbp == logits_sbp
    plain = LOGITS.clone().requires_grad_()
    want = F.cross_entropy(plain, TARGET)
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want.detach())
    torch.testing.assert_close(logits.grad.full_tensor(), plain.grad)


@pytest.mark.gloo
def test_vocab_parallel_cross_entropy_moves_no_logits():
    run_on_world(2, vocab_parallel_moves_no_logits, [0, 1], (S(1),), (B,))
    run_on_world(4, vocab_parallel_moves_no_logits, [[0, 1], [2, 3]], (S(0), S(1)), (S(0), B))
