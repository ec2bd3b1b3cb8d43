#!/usr/bin/env bash
# One go on a GPU machine with no network: build the fused kernels' CUDA extension (just in time, ninja), run the GPU
# tests and time, in the order below, each stage with its own time limit and all of them within DEADLINE seconds of
# the start (a stage that would start with under 30 s left is skipped). Every stage runs even when an earlier one
# failed. Logs, results and a summary go to ${OUT_DIR:-gpu_out}: summary.txt (each stage's exit status and seconds),
# logs.tgz (every log, and the benchmark tables as written into docs/benchmarks/ there), and the result files
# (kernels.json, gpt_cuda.json) beside them.
#
#   scripts/gpu.sh                                  # every stage
#   scripts/gpu.sh kernel_tests model_tests         # some stages, in the order given
#   DEADLINE=400 scripts/gpu.sh                     # a shorter run
#
# Stages:
#   native         the C hit paths (csrc/hit_module.c and its parts), in place, for this machine's Python
#   build          the kernels' extension (sbp_torch/kernels/_extension.py), cached for the later stages
#   kernel_tests   tests/test_kernels_gpu.py: every fused forward and backward against float64
#   model_tests    tests/test_models_gpu.py: transformers models with sdpa attention laid out on the GPU
#   step_graph     the test of tests/test_models_gpu.py for compile_step(cuda_graphs=True) alone
#   kernel_bench   benchmarks/kernels/bench.py: against eager, torch.compile and Liger-Kernel (from .whl/)
#   gpt_cuda       the benchmark suite gpt_cuda (--quick unless GPT_FULL=1): a GPT-2 step, eager, compiled, CUDA graphs
#   gpu_profile    diagnostics/gpu_profile.py: an eager step's issue time, GPU busy time and kernels, plain against
#                  sbp_torch (written to docs/benchmarks/gpu_profile.md)
#   sync_check     diagnostics/sync_check.py: the host synchronisations of global GPT steps under CUDA's sync debug
#                  mode, each with its stack; fails on any that sbp_torch adds to the plain step's
#   memcheck       compute-sanitizer memcheck over a few kernel tests
#   racecheck      compute-sanitizer racecheck over the kernels that share memory
#   pipeline       tests/test_pipeline_cuda.py and the pipeline_cuda benchmark
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT_DIR:-gpu_out}
DEADLINE=${DEADLINE:-540}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
stages=${*:-native build kernel_tests model_tests kernel_bench gpt_cuda sync_check memcheck}
begin=$(date +%s)
status=0

# stage NAME LIMIT COMMAND...: COMMAND with a time limit (cut to what DEADLINE leaves), its output in logs/NAME.log
stage() {
  local name=$1 limit=$2 left start rc
  shift 2
  left=$((DEADLINE - ($(date +%s) - begin)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, ${left} s left" | tee -a "$OUT/summary.txt"
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  start=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  tail -4 "$LOGS/$name.log"
  [ $rc -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import transformers; print('transformers', transformers.__version__)"
  command -v nvcc ninja compute-sanitizer
} >"$LOGS/device.txt" 2>&1
cat "$LOGS/device.txt" | tee "$OUT/summary.txt"

# The memcheck cases: warp rows, block rows, the one-element path, streaming rows, masks and dropout, backward included.
MEMCHECK="test_forward_and_backward and (3x7-float32-misaligned or 48x256-bfloat16-aligned or 2x20000-float32-aligned)"
RACECHECK="test_forward_and_backward and (48x256-bfloat16-aligned or 5x8192-float16-aligned)"
KERNELS="import sbp_torch.kernels as K; K.enable_cuda_kernels(verbose=True); print('built')"

for s in $stages; do
  case $s in
    native) stage native 60 env SBP_TORCH_NO_CUDA_BUILD=1 $PY setup.py -q build_ext --inplace ;;
    build) stage build 240 $PY -c "$KERNELS" ;;
    kernel_tests) stage kernel_tests 180 $PY -m pytest -q -p no:cacheprovider -rfE --maxfail=40 tests/test_kernels_gpu.py ;;
    model_tests) stage model_tests 240 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_models_gpu.py ;;
    step_graph) stage step_graph 180 $PY -m pytest -q -p no:cacheprovider -rfE tests/test_models_gpu.py -k cuda_graph ;;
    gpu_profile) stage gpu_profile 150 $PY diagnostics/gpu_profile.py ;;
    kernel_bench)
      site=$(mktemp -d)
      $PY -m pip install -q --no-deps --no-index --target "$site" .whl/*.whl >"$LOGS/liger_install.log" 2>&1 ||
        echo "Liger-Kernel install failed: see logs/liger_install.log" | tee -a "$OUT/summary.txt"
      stage kernel_bench 240 env PYTHONPATH="$site" $PY -m benchmarks.kernels.bench --out "$OUT" \
        --budget "${BENCH_BUDGET:-60}"
      ;;
    gpt_cuda)
      quick=--quick
      [ "${GPT_FULL:-0}" = 1 ] && quick=
      stage gpt_cuda 360 $PY -m benchmarks.run --suite gpt_cuda $quick
      cp docs/benchmarks/gpt_cuda.json "$OUT/" 2>/dev/null
      ;;
    sync_check) stage sync_check 120 $PY diagnostics/sync_check.py ;;
    memcheck)
      stage memcheck 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "$MEMCHECK"
      ;;
    racecheck)
      stage racecheck 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --error-exitcode 1 \
        $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "$RACECHECK"
      ;;
    pipeline)
      stage pipeline_tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_pipeline_cuda.py
      stage pipeline_bench 200 $PY -m benchmarks.run --suite pipeline_cuda
      ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
echo "total: $(($(date +%s) - begin)) s" | tee -a "$OUT/summary.txt"
cp docs/benchmarks/kernels.* docs/benchmarks/gpt_cuda.* docs/benchmarks/pipeline_cuda.* docs/benchmarks/gpu_profile.md \
  "$LOGS/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
exit $status
