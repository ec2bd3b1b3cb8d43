#!/usr/bin/env bash
# One go on a GPU machine (no network needed): build the kernels' extension, run the GPU tests, run
# compute-sanitizer memcheck and racecheck on a small subset, then the benchmark (against eager, torch.compile
# and Liger-Kernel, installed from the git-ignored .whl/). Every step logs into $OUT_DIR/<step>.log and runs
# even when an earlier one failed; $OUT_DIR/steps.txt lists each step's exit status and seconds; the script's
# exit status says whether any step failed.
#
#   benchmarks/kernels/run_gpu.sh                        # every step, about 6-7 minutes on an H100
#   benchmarks/kernels/run_gpu.sh build tests sanitizer  # some steps (the build is cached between calls)
#
# Environment: PY (python; default .venv/bin/python if present, else python3), OUT_DIR (default
# gpu_out/kernels), MAX_JOBS (parallel compile jobs, default 16), TORCH_CUDA_ARCH_LIST (default 9.0),
# BENCH_BUDGET (seconds after which the benchmark skips compile and Liger variants, default 90).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT_DIR:-gpu_out/kernels}
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
mkdir -p "$OUT"
steps=${*:-build tests sanitizer bench}
status=0

# step NAME TIMEOUT COMMAND...: runs COMMAND with a time limit, its output into $OUT/NAME.log
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name: $*" | tee -a "$OUT/steps.txt"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$OUT/steps.txt"
  tail -5 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  command -v nvcc ninja compute-sanitizer
} >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# The sanitizer runs, small sizes through every kernel: memcheck over warp rows, block rows, the one-element
# path, streaming rows, masks and dropout, each op's backward included; racecheck over the kernels that share
# memory (block reductions, the column sums of the backwards) in warp, block and streaming shapes. No caching
# allocator, so that an access past a tensor's end leaves its allocation.
MEMCHECK="test_forward_and_backward and (3x7-float32-misaligned or 48x256-bfloat16-aligned or 5x8192-float16-aligned or 2x20000-float32-aligned) or test_dropout_is_the_philox_rule and 17x1000-bfloat16 or test_softmax_masks and float32 and mask_and_causal"
RACECHECK="test_forward_and_backward and (48x256-bfloat16-aligned or 5x8192-float16-aligned or 2x20000-float32-aligned)"

for s in $steps; do
  case $s in
    build)  # the JIT build (ninja, MAX_JOBS in parallel), cached under ~/.cache/torch_extensions
      step build 600 $PY -c "import sbp_torch.kernels as K; K.enable_cuda_kernels(verbose=True); print('built')"
      ;;
    tests)
      step tests 400 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py
      ;;
    sanitizer)
      if command -v compute-sanitizer >/dev/null; then
        step memcheck 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
          $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "$MEMCHECK"
        step racecheck 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --error-exitcode 1 \
          $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "$RACECHECK"
      else
        echo "== sanitizer: compute-sanitizer not found" | tee -a "$OUT/steps.txt"
        status=1
      fi
      ;;
    bench)  # Liger-Kernel and its one missing dependency (packaging) from .whl/, on the path of this step only
      site=$(mktemp -d)
      if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-deps --no-index --target "$site" .whl/*.whl >"$OUT/liger_install.log" 2>&1 ||
          echo "Liger-Kernel install failed: see liger_install.log" | tee -a "$OUT/steps.txt"
      fi
      step bench 500 env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
        $PY -m benchmarks.kernels.bench --out "$OUT" --budget "${BENCH_BUDGET:-90}"
      ;;
    *) echo "unknown step $s (build, tests, sanitizer, bench)"; exit 2 ;;
  esac
done
exit $status
