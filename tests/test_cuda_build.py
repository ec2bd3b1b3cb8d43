"""Every cuda/*.cu compiles with ``nvcc -c`` (one architecture, in parallel): CI has nvcc but no GPU, so a
kernel that does not build fails here. Skips when nvcc is absent."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
NVCC = shutil.which("nvcc")


def _compile(source: Path, out_dir: Path) -> tuple[Path, int, str]:
    cmd = [NVCC, "-std=c++17", "-arch=sm_90", "-O2", "-c", str(source), "-o", str(out_dir / f"{source.stem}.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return source, done.returncode, done.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_kernel_compiles(tmp_path):
    sources = sorted(CUDA_DIR.glob("*.cu"))
    assert sources, "no CUDA sources"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda s: _compile(s, tmp_path), sources))
    failed = [f"{s.name}:\n{err}" for s, rc, err in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)


def test_without_a_cuda_torch_the_kernels_cannot_be_built_and_say_why():
    """Where the kernels' extension is neither installed nor buildable, loading it names what it needs."""
    import torch

    from sbp_torch.kernels import _extension

    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch: the extension may be built here")
    assert not _extension.can_build()
    with pytest.raises(ImportError, match="needs a CUDA build of torch"):
        _extension.load("_kernels_cuda")


def test_the_extension_is_built_from_every_source():
    """setup.py and the just-in-time build compile _extension.SOURCES: a new .cu file must be listed there."""
    from sbp_torch.kernels import _extension

    root = CUDA_DIR.parent
    on_disk = {str(p.relative_to(root)) for p in [*CUDA_DIR.glob("*.cu"), *(root / "csrc").glob("*.cpp")]}
    assert on_disk == set(_extension.SOURCES["_kernels_cuda"])
