#!/usr/bin/env bash
# One go on a GPU machine with no network: install in place (building the CUDA extensions), run the GPU tests
# and time. Parts: `pipeline` (stream scheduler tests, CUDA pipelines against one process, the pipeline_cuda
# benchmark) and `kernels` (benchmarks/kernels/run_gpu.sh); default both. Logs and results go to
# ${OUT_DIR:-gpu_out}/, the benchmark tables also into docs/benchmarks/.
#
#   scripts/gpu.sh                  # everything
#   scripts/gpu.sh pipeline         # one part
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT_DIR:-gpu_out}
mkdir -p "$OUT"
parts=${*:-pipeline kernels}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
# editable install with the fused kernels' CUDA extension (setup.py); needs no network
$PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }

for part in $parts; do
  case $part in
    pipeline)
      $PY -m pytest -q tests/test_pipeline_cuda.py 2>&1 | tee "$OUT/pipeline_tests.txt" || status=1
      if command -v compute-sanitizer >/dev/null; then  # the stream scheduler's copies and orders, in one process
        compute-sanitizer --tool memcheck $PY -m pytest -q tests/test_pipeline_cuda.py \
          -k "staged_copy or arriving or refused" 2>&1 | tail -3 | tee "$OUT/pipeline_sanitizer.txt" || status=1
      fi
      $PY -m benchmarks.run --suite pipeline_cuda 2>&1 | tail -3 || status=1
      # two ranks share one GPU: measured again with MPS, whose clients run kernels side by side as on two GPUs
      if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        cp docs/benchmarks/pipeline_cuda.json "$OUT/pipeline_cuda_no_mps.json"
        $PY -m benchmarks.run --suite pipeline_cuda 2>&1 | tail -3 || status=1
        echo quit | nvidia-cuda-mps-control
        $PY - "$OUT/pipeline_cuda_no_mps.json" <<'PY'
import json, sys
path = "docs/benchmarks/pipeline_cuda.json"
doc = json.load(open(path))
doc["rows"] = json.load(open(sys.argv[1]))["rows"] + doc["rows"]
json.dump(doc, open(path, "w"), indent=1)
PY
        $PY -m benchmarks.run --suite pipeline_cuda --render
      fi
      cp docs/benchmarks/pipeline_cuda.md docs/benchmarks/pipeline_cuda.json "$OUT/" || status=1
      ;;
    kernels)
      PY=$PY OUT_DIR="$OUT/kernels" bash benchmarks/kernels/run_gpu.sh || status=1
      ;;
    *) echo "unknown part $part (pipeline, kernels)"; exit 2 ;;
  esac
done
exit $status
