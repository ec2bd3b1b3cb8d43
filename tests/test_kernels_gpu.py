"""The CUDA kernels against float64 references: fresh random inputs per check, outputs poisoned by a NaN
fill before the kernel writes them, fp32/fp16/bf16, odd sizes. Skips without a GPU (and without nvcc to JIT
the extension). Never run in this project yet: no session has had a GPU."""

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
SIZES = [(1, 1), (3, 7), (17, 1000), (64, 4099)]


@pytest.fixture(scope="module")
def kernels():
    from sbp_torch import kernels as K

    K.enable_cuda_kernels()
    return K


def _fresh(shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float64).to(dtype)


def _check(got, want, dtype):
    assert not got.isnan().any() or want.isnan().any(), "an output element was not written"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True)
def poisoned_allocations():
    """Fill the caching allocator's free blocks with NaN before each test, so that an output element the
    kernel did not write shows as NaN (the extension allocates from the same cache)."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]
    del blocks
    yield


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SIZES)
def test_forward_and_backward(kernels, dtype, shape):
    K = kernels
    for _ in range(2):  # fresh inputs per check
        x, v, b = _fresh(shape, dtype), _fresh(shape[-1:], dtype), _fresh(shape[-1:], dtype)
        for approximate in ("tanh", "none"):
            _check(K.bias_gelu(x, v, approximate), F.gelu(x.double() + v.double(), approximate=approximate), dtype)
        _check(K.layer_norm(x, v, b), F.layer_norm(x.double(), shape[-1:], v.double(), b.double()), dtype)
        _check(
            K.rms_norm(x, v),
            x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * v.double(),
            dtype,
        )
        _check(K.scale_mask_softmax(x, None, 0.5), torch.softmax(x.double() * 0.5, -1), dtype)
        target = torch.randint(0, shape[-1], shape[:1], device="cuda")
        xr = x.double().requires_grad_()
        want = F.cross_entropy(xr, target)
        xg = x.clone().requires_grad_()
        got = K.cross_entropy(xg, target)
        _check(got, want, dtype)
        want.backward()
        got.backward()
        _check(xg.grad, xr.grad, dtype)


def test_dropout_mask_is_the_philox_rule(kernels):
    """The CUDA mask equals the counter-based rule of sbp_torch._philox at the generator's offset."""
    from sbp_torch._layout._philox import random_values

    x = _fresh((5, 7), torch.float32)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.cuda.manual_seed(4)
    seed, offset = gen.initial_seed(), gen.get_offset()
    out = kernels.bias_dropout_add(x, torch.zeros(7, device="cuda"), torch.zeros_like(x), 0.3)
    keep = random_values("uniform", torch.arange(35, device="cuda").view(5, 7), seed, offset, torch.float32) < 0.7
    torch.testing.assert_close(out, x * keep / 0.7)
