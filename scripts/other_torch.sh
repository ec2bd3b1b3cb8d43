#!/usr/bin/env bash
# The compiled-program and zoo tests on another torch release than .venv's, in a venv of its own: the package
# claims torch >= 2.11, and torch.compile's internals differ between releases.
#
#   scripts/other_torch.sh 2.11.0                  # torch 2.11.0 with transformers 5.17.0 (the GPU machines')
#   TRANSFORMERS=5.24.0 scripts/other_torch.sh 2.13.0 -k mesh
#
# The venv (default /tmp/sbp_torch-torch-VERSION, or $VENV) is made once and reused. torch comes from PyPI, which
# serves a CUDA build (several GB; it runs on CPU). sbp_torch itself runs from this checkout (PYTHONPATH), not
# installed, so the tests see the working tree. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/other_torch.sh TORCH_VERSION [pytest arguments]}
shift
venv=${VENV:-/tmp/sbp_torch-torch-$version}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version" "transformers==${TRANSFORMERS:-5.17.0}" numpy hypothesis expecttest \
    pytest pytest-timeout
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_compile.py tests/test_zoo.py "$@"
