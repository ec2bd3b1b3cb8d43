#!/usr/bin/env bash
# One go on a GPU machine: JIT-build the CUDA extension, run the GPU tests (and one compute-sanitizer pass),
# then time each kernel against eager torch and torch.compile. Writes results under benchmarks/kernels/out/.
# Every step runs even when an earlier one failed (each failure is worth seeing); the exit status says if any did.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT_DIR:-benchmarks/kernels/out}
mkdir -p "$OUT"
nvidia-smi | tee "$OUT/device.txt"
status=0
$PY -c "import sbp_torch.kernels as K; K.enable_cuda_kernels(verbose=True)" || exit 1          # JIT build
$PY -m pytest -q tests/test_kernels_gpu.py tests/test_kernels.py 2>&1 | tee "$OUT/tests.txt" || status=1
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck $PY -m pytest -q -x tests/test_kernels_gpu.py -k "forward and 3" 2>&1 | tail -20 | tee "$OUT/sanitizer.txt" || status=1
fi
$PY -m benchmarks.kernels.bench --out "$OUT" 2>&1 | tee "$OUT/bench.txt" || status=1
exit $status
