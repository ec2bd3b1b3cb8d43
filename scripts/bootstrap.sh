#!/usr/bin/env bash
# Create .venv and install sbp_torch into it (editable), with transformers for examples/train.py; `bootstrap.sh test`
# adds the test tools.
# The venv sees system packages, so an installed torch >= 2.11 (say a CUDA build on a GPU machine with no
# network) is used as it is; otherwise the CPU build of torch 2.13.0 is installed, pinned because an open
# range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --system-site-packages .venv
if ! .venv/bin/python - <<'PY' 2>/dev/null
import sys, torch
sys.exit(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11))
PY
then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q "setuptools>=70.1"  # builds editable wheels without the separate wheel package
extras="[train]"  # transformers, which examples/train.py (the README's first command) trains
if [ "${1:-}" = "test" ]; then extras="[train,test]"; fi
.venv/bin/pip install -q --no-build-isolation -e ".${extras}"
