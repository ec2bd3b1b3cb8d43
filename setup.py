"""Install sbp_torch.

The package is Python, plus optional extensions: the actor runtime's C++ core (``csrc/actors.cpp``, plain
pybind11 from torch's headers, built wherever a C++ compiler is; without it the Python runtime is used) and
the CUDA extensions (the fused kernels and the pipeline's stream scheduler), built only where torch (with CUDA)
and nvcc are already installed. torch is a runtime requirement only: a build environment without torch never
pulls a (multi-GB) CUDA build in, and an installed torch >= 2.11 is kept.
"""

import os
import runpy
import shutil

from setuptools import Extension, find_packages, setup


def _actor_core() -> list:
    """The actor runtime's core as ``sbp_torch._actors_core``, compiled against the pybind11 headers that torch
    ships (no torch headers, so it takes seconds). Optional: a failed build leaves the Python runtime."""
    if os.environ.get("SBP_TORCH_NO_CPP_BUILD"):
        return []
    try:
        import torch
    except ImportError:
        return []
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    return [Extension("sbp_torch._actors_core", ["csrc/actors.cpp"], include_dirs=[include], language="c++",
                      extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"], optional=True)]


def _extensions() -> dict:
    cuda = _cuda_extensions()
    return {**cuda, "ext_modules": _actor_core() + cuda.get("ext_modules", [])}


def _cuda_extensions() -> dict:
    """The CUDA extensions of ``sbp_torch/_cuda_extensions.py``'s ``SOURCES`` (the fused kernels and the
    pipeline's stream scheduler), only where an installed torch has CUDA and nvcc is on the PATH; otherwise
    nothing (kernels run their PyTorch reference, pipelines the Python stream scheduler, and both can be built
    just in time later)."""
    if not shutil.which("nvcc") or os.environ.get("SBP_TORCH_NO_CUDA_BUILD"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return {}
    if torch.version.cuda is None:
        return {}
    sources = runpy.run_path("sbp_torch/_cuda_extensions.py")["SOURCES"]
    flags = {"cxx": ["-O2", "-std=c++17"], "nvcc": ["-O3", "-std=c++17"]}
    exts = [CUDAExtension(f"sbp_torch.{name}", files, extra_compile_args=flags) for name, files in sources.items()]
    return {"ext_modules": exts, "cmdclass": {"build_ext": BuildExtension}}


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
    **_extensions(),
)
