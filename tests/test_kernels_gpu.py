"""The CUDA kernels, forward and backward, against float64 references: fresh random inputs per check, outputs
poisoned by a NaN fill before the kernels write them, fp32/fp16/bf16, odd sizes (rows not a multiple of the
16-byte vector, 1 x 1 up to 2 x 20000), misaligned starts (views one element into a buffer), broadcast and
causal softmax masks, the dropout mask against the Philox rule. Skips without a GPU (and without nvcc to JIT
the extension). Run by scripts/gpu.sh (stages kernel_tests, memcheck, racecheck)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or shutil.which("nvcc") is None, reason="needs a CUDA GPU and nvcc"
    ),
]

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
SIZES = [(1, 1), (3, 7), (17, 1000), (64, 4099), (5, 8192), (2, 20000), (48, 256)]
ops = torch.ops.sbp_torch


@pytest.fixture(scope="module")
def kernels():
    from sbp_torch import kernels as K

    K.enable_cuda_kernels()
    return K


@pytest.fixture(autouse=True)
def poisoned_allocations():
    """Fill the caching allocator's free blocks with NaN before each test, so that an output element the
    kernel did not write shows as NaN (the extension allocates from the same cache)."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]
    del blocks
    yield


def _fresh(shape, dtype, misaligned=False):
    """Random values of ``dtype``; ``misaligned``: a view starting one element into its buffer (not 16-byte
    aligned), which the kernels must take on their one-element path."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.randn(n + 1, device="cuda", dtype=torch.float64).to(dtype)
    return (buf[1:] if misaligned else buf[:n]).view(shape)


def _check(got, want, dtype, what=""):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    assert not got.isnan().any() or want.isnan().any(), f"{what}: an output element was not written"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _forward_backward(fn, inputs, grad):
    """fn's output and the gradients of its floating inputs for output gradient ``grad``."""
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves if t.is_floating_point()]


def _compare(name, fused, unfused, inputs, dtype, misaligned=False):
    """fused on the dtype's inputs against unfused on their float64 values, forward and every gradient (for a
    fresh output gradient, misaligned like the inputs)."""
    grad = _fresh(inputs[0].shape, dtype, misaligned)
    out, grads = _forward_backward(fused, inputs, grad)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    want, want_grads = _forward_backward(unfused, wide, grad.double())
    _check(out, want, dtype, f"{name} forward")
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        _check(g, w, dtype, f"{name} gradient of input {i}")


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _softmax(x, mask=None, scale=1.0, causal=False):
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    return torch.softmax(s, -1)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward(kernels, shape, dtype, misaligned):
    K = kernels
    for _ in range(2):  # fresh inputs per check
        x, v, b = _fresh(shape, dtype, misaligned), _fresh(shape[-1:], dtype), _fresh(shape[-1:], dtype)
        for approximate in ("tanh", "none"):
            _compare(
                f"bias_gelu {approximate}",
                lambda x, v: K.bias_gelu(x, v, approximate),
                lambda x, v: F.gelu(x + v, approximate=approximate),
                [x, v],
                dtype,
                misaligned,
            )
        _compare("layer_norm", K.layer_norm, lambda x, v, b: F.layer_norm(x, shape[-1:], v, b), [x, v, b], dtype)
        _compare("rms_norm", K.rms_norm, _rms, [x, v], dtype, misaligned)
        _compare("softmax", lambda x: K.scale_mask_softmax(x, None, 0.5), lambda x: _softmax(x, None, 0.5), [x], dtype)
        mask = torch.rand(shape[-1:], device="cuda") < 0.3
        mask[0] = False  # no row fully excluded
        _compare(
            "softmax with a mask",
            lambda x: K.scale_mask_softmax(x, mask, 0.7),
            lambda x: _softmax(x, mask, 0.7),
            [x],
            dtype,
            misaligned,
        )
        target = torch.randint(0, shape[-1], shape[:1], device="cuda")
        xr, xg = x.double().requires_grad_(), x.clone().requires_grad_()
        want, got = F.cross_entropy(xr, target), K.cross_entropy(xg, target)
        want.backward()
        got.backward()
        _check(got, want, dtype, "cross_entropy")
        _check(xg.grad, xr.grad, dtype, "cross_entropy gradient")


@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "shape, mask_shape, causal",
    [
        ((2, 3, 5, 7), (2, 1, 1, 7), False),  # a padding mask per sample
        ((2, 3, 17, 17), None, True),
        ((2, 3, 16, 64), (16, 64), True),  # a [queries, keys] mask and causal, 8-byte mask rows
        ((4, 33, 40), (4, 1, 40), False),
        ((3, 1000), (3, 1000), False),
        ((2, 2, 6, 6), (6, 1), False),  # broadcast along the keys: the glue copies it
    ],
    ids=["padding", "causal", "mask_and_causal", "heads", "full", "key_broadcast"],
)
def test_softmax_masks(kernels, shape, mask_shape, causal, dtype):
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, device="cuda") < 0.3
        mask[..., 0] = False  # no row fully excluded
    _compare(
        "scale_mask_softmax",
        lambda x: kernels.scale_mask_softmax(x, mask, 0.3, causal),
        lambda x: _softmax(x, mask, 0.3, causal),
        [_fresh(shape, dtype)],
        dtype,
    )


def test_softmax_fully_excluded_row_is_nan(kernels):
    x = _fresh((2, 8), torch.float32)
    mask = torch.zeros(2, 8, dtype=torch.bool, device="cuda")
    mask[1] = True
    y = kernels.scale_mask_softmax(x, mask)
    assert y[1].isnan().all() and not y[0].isnan().any()


@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 7), (17, 1000), (64, 4099), (2, 20000), (8, 4096)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_dropout_is_the_philox_rule(kernels, shape, dtype, misaligned):
    """The CUDA mask equals sbp_torch/_layout/_philox.py's rule at the generator's offset (compared as torch
    compares in the dtype), the generator advances as random_region advances it, and the values and
    gradients follow from the mask."""
    from sbp_torch._layout._philox import random_values

    p = 0.3
    x, r, v = _fresh(shape, dtype, misaligned), _fresh(shape, dtype, misaligned), _fresh(shape[-1:], dtype)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.cuda.manual_seed(4)
    seed, offset = gen.initial_seed(), gen.get_offset()
    out, keep = ops.bias_dropout_add(x, v, r, p, True)
    assert gen.get_offset() == offset + ((x.numel() + 3) // 4 + 3) // 4 * 4
    index = torch.arange(x.numel(), device="cuda").view(shape)
    assert torch.equal(keep, random_values("uniform", index, seed, offset, dtype) < 1 - p)

    def reseeded(x, v, r):  # _compare draws its output gradient first: the mask must come from the same offset
        torch.cuda.manual_seed(4)
        return kernels.bias_dropout_add(x, v, r, p)

    _compare(
        "bias_dropout_add",
        reseeded,
        lambda x, v, r: (x + v) * keep / (1 - p) + r,
        [x, v, r],
        dtype,
        misaligned,
    )


def test_dropout_without_drawing_is_the_sum(kernels):
    x, v, r = _fresh((5, 8), torch.float32), _fresh((8,), torch.float32), _fresh((5, 8), torch.float32)
    _check(kernels.bias_dropout_add(x, v, r, 0.5, training=False), x.double() + v.double() + r.double(), torch.float32)
    _compare(
        "p = 0",
        lambda x, v, r: kernels.bias_dropout_add(x, v, r, 0.0),
        lambda x, v, r: x + v + r,
        [x, v, r],
        torch.float32,
    )


def test_what_the_kernels_do_not_take_runs_the_reference(kernels):
    """float64, mixed dtypes, softmax over more than 4 dims, and norms whose rows do not fit a block's shared
    memory in the backward (layer norm, 2 x 65536 floats) take the torch reference."""
    K = kernels
    x, w = _fresh((3, 10), torch.float64), _fresh((10,), torch.float64)
    got, got_grads = _forward_backward(K.rms_norm, [x, w], torch.ones_like(x))
    want, want_grads = _forward_backward(_rms, [x, w], torch.ones_like(x))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grads, want_grads)
    half, w32 = _fresh((3, 10), torch.float16), _fresh((10,), torch.float32)
    torch.testing.assert_close(K.bias_gelu(half, w32), F.gelu(half + w32, approximate="tanh"))
    xs = _fresh((2, 2, 2, 3, 5), torch.float32)
    torch.testing.assert_close(K.scale_mask_softmax(xs, None, 0.5), _softmax(xs, None, 0.5))
    wide, ww, wb = _fresh((2, 65536), torch.float32), _fresh((65536,), torch.float32), _fresh((65536,), torch.float32)
    _compare(
        "wide layer_norm", K.layer_norm, lambda x, w, b: F.layer_norm(x, (65536,), w, b), [wide, ww, wb], torch.float32
    )


def test_the_kernels_run(kernels):
    """Every op launches the extension's kernels (no silent fallback to the reference)."""
    K = kernels
    x, v, b = _fresh((64, 512), torch.bfloat16), _fresh((512,), torch.bfloat16), _fresh((512,), torch.bfloat16)

    def step():
        for out in (
            K.bias_gelu(x, v),
            K.layer_norm(x, v, b),
            K.rms_norm(x, v),
            K.scale_mask_softmax(x, None, 0.5),
            K.bias_dropout_add(x, v, x, 0.1),
        ):
            out.backward(torch.ones_like(out))

    x.requires_grad_(), v.requires_grad_(), b.requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    for kernel in (
        "bias_gelu_kernel",
        "bias_gelu_backward_kernel",
        "norm_forward_kernel",
        "norm_backward_kernel",
        "softmax_kernel",
        "softmax_backward_kernel",
        "bias_dropout_add_kernel",
        "dropout_backward_kernel",
        "column_sums_kernel",
    ):
        assert kernel in names, f"{kernel} did not run"


def test_compiled_program_calls_the_kernels(kernels):
    """torch.compile of a program of the ops (their fakes give the real outputs' shapes and dtypes) equals eager,
    forward and backward."""
    K = kernels

    def program(x, v, b, r):
        h = K.layer_norm(x, v, b) + K.rms_norm(x, v)
        h = K.bias_gelu(h, b) + K.scale_mask_softmax(h, None, 0.5, causal=True)
        return K.bias_dropout_add(h, v, r, 0.0)

    inputs = [_fresh((4, 64, 64), torch.bfloat16), _fresh((64,), torch.bfloat16), _fresh((64,), torch.bfloat16)]
    inputs.append(_fresh((4, 64, 64), torch.bfloat16))
    grad = _fresh((4, 64, 64), torch.bfloat16)
    want, want_grads = _forward_backward(program, inputs, grad)
    got, got_grads = _forward_backward(torch.compile(program, dynamic=False), inputs, grad)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_grads, want_grads, atol=atol, rtol=rtol)
