"""Install sbp_torch.

The package is Python, plus two optional extensions:

* the hit paths in C (``csrc/hit_module.c``: the dispatcher's, ``csrc/dispatch_hit.c``, and the frontend's local
  calls, ``csrc/local_calls_hit.c``), against Python's C API alone: built wherever a C compiler is, and left out (a
  warning, the Python path runs) where none is;
* the fused kernels' CUDA code, built only where torch (with CUDA) and nvcc are already installed (elsewhere the
  kernels run their PyTorch reference, and can be built just in time later).

torch is a runtime requirement only: a build environment without torch never pulls a (multi-GB) CUDA build in, and
an installed torch >= 2.11 is kept.
"""

import os
import runpy
import shutil

from setuptools import Extension, find_packages, setup

TRANSFORMERS = "transformers==5.24.0"
# Hidden symbols: the parts share names (hit.h) that no other library loaded into the process may take.
DISPATCH_HIT = Extension(
    "sbp_torch._dispatch._hit",
    ["csrc/hit_module.c", "csrc/dispatch_hit.c", "csrc/local_calls_hit.c"],
    depends=["csrc/hit.h"],
    extra_compile_args=["-O2", "-fvisibility=hidden"],
    optional=True,
)


def _extensions() -> dict:
    """The hit paths' extension; with it the CUDA extension of ``sbp_torch/kernels/_extension.py``'s
    ``SOURCES``, only where an installed torch has CUDA and nvcc is on the PATH."""
    plain = {"ext_modules": [DISPATCH_HIT]}
    if not shutil.which("nvcc") or os.environ.get("SBP_TORCH_NO_CUDA_BUILD"):
        return plain
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return plain
    if torch.version.cuda is None:
        return plain
    sources = runpy.run_path("sbp_torch/kernels/_extension.py")["SOURCES"]
    flags = {"cxx": ["-O2", "-std=c++17"], "nvcc": ["-O3", "-std=c++17"]}
    exts = [CUDAExtension(f"sbp_torch.{name}", files, extra_compile_args=flags) for name, files in sources.items()]
    return {"ext_modules": [DISPATCH_HIT, *exts], "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="sbp_torch",
    version="0.1.0",
    description="OneFlow-style global tensors (placement + SBP) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["sbp_torch", "sbp_torch.*"]),
    python_requires=">=3.10",
    # numpy: torch warns at import without it, and the planner uses it; scipy: the planner's integer program
    install_requires=["torch>=2.11", "numpy", "scipy>=1.9"],
    extras_require={
        # transformers, for examples/train.py and the zoo (pinned: the zoo's models train as they are in that version)
        "train": [TRANSFORMERS],
        # expecttest: imported by torch's OpInfo database; ruff and import-linter: the lint tests
        "test": ["pytest>=7", "pytest-timeout", "hypothesis>=6", "expecttest", "ruff", "import-linter", TRANSFORMERS],
        "bench": ["matplotlib"],
    },
    **_extensions(),
)
