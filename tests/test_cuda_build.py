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


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_stream_scheduler_glue_compiles(tmp_path):
    """csrc/streams.cpp needs only pybind11 (torch ships it), Python's and CUDA's headers: CI compiles it (nvcc
    hands a .cpp file to the host compiler with CUDA's include path)."""
    import sysconfig

    import torch

    includes = [Path(torch.__file__).parent / "include", sysconfig.get_paths()["include"]]
    cmd = [NVCC, "-std=c++17", "-c", "-DTORCH_EXTENSION_NAME=_streams_cuda", *(f"-I{i}" for i in includes),
           str(CUDA_DIR.parent / "csrc" / "streams.cpp"), "-o", str(tmp_path / "streams.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_without_a_cuda_torch_the_python_stream_scheduler_serves():
    """Where the C++ stream scheduler is neither installed nor buildable, CUDA pipelines fall back to its
    Python twin, and asking for the C++ one names what is available."""
    import torch

    from sbp_torch import _cuda_extensions, _cuda_streams

    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch: the C++ scheduler may be built here")
    assert not _cuda_extensions.can_build()
    with pytest.raises(ImportError, match="needs a CUDA build of torch"):
        _cuda_extensions.load("_streams_cuda")
    assert _cuda_streams.scheduler_class() is _cuda_streams.PythonStreamScheduler
    with pytest.raises(ValueError, match=r"'C\+\+' is not available here; available: \['Python'\]"):
        _cuda_streams.scheduler_class("C++")
