"""The actor runtime that pipelines run on: the C++ core (``csrc/actors.cpp``, built by ``setup.py`` as
``sbp_torch._actors_core``) where it was built, else the pure-Python one (``_actors.py``), which behaves the
same and documents the model. ``SBP_TORCH_PYTHON_ACTORS=1`` or ``use("Python")`` picks the Python one."""

from __future__ import annotations

import os

from . import _actors as python_core

try:
    from . import _actors_core as cpp_core
except ImportError:  # a build without a C++ compiler
    cpp_core = None

CORES = {"Python": python_core, **({"C++": cpp_core} if cpp_core is not None else {})}
core = cpp_core if cpp_core is not None and os.environ.get("SBP_TORCH_PYTHON_ACTORS") != "1" else python_core


def use(implementation: str) -> None:
    """Run the steps of pipelines from now on with ``implementation`` ("C++" or "Python")."""
    global core
    if implementation not in CORES:
        raise ValueError(f"actor runtime {implementation!r} is not available here; available: {sorted(CORES)}")
    core = CORES[implementation]


def implementation() -> str:
    """The name of the runtime in use: "C++" or "Python"."""
    return next(name for name, module in CORES.items() if module is core)
