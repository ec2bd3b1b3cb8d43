"""Install sbp_torch.

The package is pure Python, plus an optional CUDA extension built only where torch (with CUDA) and nvcc are
already installed. torch is a runtime requirement only: a build environment without torch never pulls a
(multi-GB) CUDA build in, and an installed torch >= 2.11 is kept.
"""

import os
import shutil

from setuptools import find_packages, setup


def _cuda_extensions() -> dict:
    """The fused CUDA kernels (csrc/ + cuda/) as ``sbp_torch._kernels_cuda``, only where an installed torch
    has CUDA and nvcc is on the PATH; otherwise nothing (the ops run their PyTorch reference, and
    ``sbp_torch.kernels.enable_cuda_kernels`` can build them just in time later)."""
    if not shutil.which("nvcc") or os.environ.get("SBP_TORCH_NO_CUDA_BUILD"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return {}
    if torch.version.cuda is None:
        return {}
    sources = ["csrc/kernels.cpp"] + sorted(f"cuda/{f}" for f in os.listdir("cuda") if f.endswith(".cu"))
    ext = CUDAExtension("sbp_torch._kernels_cuda", sources, extra_compile_args={"nvcc": ["-O3", "-std=c++17"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="sbp_torch",
    version="0.1.0",
    description="OneFlow-style global tensors (placement + SBP) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sbp_torch", "sbp_torch.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy"],  # numpy only to keep torch from warning at import
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "expecttest"],  # expecttest: imported by torch's OpInfo database
        "bench": ["matplotlib"],
    },
    **_cuda_extensions(),
)
