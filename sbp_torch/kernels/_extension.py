"""The fused kernels' CUDA extension, compiled from ``csrc/`` + ``cuda/``: prebuilt by ``setup.py`` where a CUDA
torch and nvcc were there at install time, else compiled just in time with ``torch.utils.cpp_extension.load``
(ninja) from the source tree. ``SOURCES`` is the one list of what it is built from; ``setup.py`` reads it too,
so this module imports nothing at load time."""

import importlib
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# module of sbp_torch -> its sources, relative to the repository root
SOURCES = {
    "_kernels_cuda": [
        "csrc/kernels.cpp",
        "cuda/bias_dropout_add.cu",
        "cuda/bias_gelu.cu",
        "cuda/column_sums.cu",
        "cuda/cross_entropy.cu",
        "cuda/norms.cu",
        "cuda/softmax.cu",
    ],
}
FLAGS = {"extra_cflags": ["-O2", "-std=c++17"], "extra_cuda_cflags": ["-O3", "-std=c++17"]}

_loaded: dict = {}


def can_build() -> bool:
    """Whether a just-in-time build can run here: a CUDA build of torch, nvcc, ninja and the source tree."""
    import torch

    tools = shutil.which("nvcc") is not None and shutil.which("ninja") is not None
    return torch.version.cuda is not None and tools and (ROOT / "cuda").is_dir()


def load(module: str, verbose: bool = False):
    """The extension ``sbp_torch.<module>``: prebuilt if installed, else built now (needs ``can_build()``)."""
    if module not in _loaded:
        try:
            ext = importlib.import_module(f"sbp_torch.{module}")
        except ImportError:
            if not can_build():
                raise ImportError(
                    f"sbp_torch.{module} was not built at install time and cannot be built here: "
                    f"that needs a CUDA build of torch, nvcc and ninja, and the source tree"
                ) from None
            from torch.utils.cpp_extension import load as build

            ext = build(f"sbp_torch{module}", [str(ROOT / s) for s in SOURCES[module]], verbose=verbose, **FLAGS)
        _loaded[module] = ext
    return _loaded[module]
