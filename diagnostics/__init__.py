"""Diagnostics: scripts that answer a question about sbp_torch's behaviour rather than time it against another
library (the benchmarks in ``benchmarks/`` do that).

* ``cache_bound.py``: a long run of new shapes on 2 ranks; the op path's caches stay at their bound.
* ``sync_check.py``: the host synchronisations of global GPT steps on one GPU under CUDA's sync debug mode; fails on
  any that sbp_torch adds to the plain step's (``scripts/gpu.sh``, stage ``sync_check``).
* ``profile_dispatch.py``: where the time of one cached op goes on the CPU (cProfile, and the call part by part).
* ``gpu_profile.py``: where an eager global step's time goes on one GPU (``scripts/gpu.sh``, stage ``gpu_profile``).

Each runs as a script from the repository root (``python diagnostics/NAME.py``). What one writes goes where the
benchmarks write (``benchmarks.harness.DOCS``, ``docs/benchmarks/``), with the harness's machine line and tables;
no benchmark imports a diagnostic.
"""
