#!/usr/bin/env bash
# Run the OpInfo sweep for sbp_torch and DTensor on every mesh, then regenerate docs/coverage.md.
#
#   tests/opinfo/run_coverage.sh [OUT_DIR]          (default OUT_DIR: tests/opinfo/results)
#   RUNS="sbp:2 dtensor:3" K=3 tests/opinfo/run_coverage.sh   (other runs; the report shows those that exist)
#
# By default: sbp_torch on the meshes 2, 3 and 2x2, DTensor on 2 and 2x2: about 12 minutes on 2 cores
# (dtensor:3 adds about 3.5).
#
# Each run resumes after a collective timeout or a crash (the hung entry is recorded as a timeout), up to
# MAX_RESTARTS times. Runs go one after another: the ranks of one run already fill two cores.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-tests/opinfo/results}
RUNS=${RUNS:-"sbp:2 sbp:3 sbp:2x2 dtensor:2 dtensor:2x2"}
K=${K:-3}
MAX_RESTARTS=${MAX_RESTARTS:-10}
mkdir -p "$OUT"
start=$SECONDS
for run in $RUNS; do
  backend=${run%%:*}
  mesh=${run#*:}
  nproc=$(( ${mesh%%x*} * ${mesh#*x} ))
  [ "$mesh" = "${mesh#*x}" ] && nproc=$mesh
  json="$OUT/${backend}_${mesh}.json"
  rm -f "$json" "$OUT/${backend}_${mesh}.log"
  t0=$SECONDS
  for ((try = 0; try <= MAX_RESTARTS; try++)); do
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "$nproc" tests/opinfo/opinfo_sweep.py \
      --mesh "$mesh" --backend "$backend" --k "$K" --out "$json" --resume >> "$OUT/${backend}_${mesh}.log" 2>&1
    .venv/bin/python -c "import json, sys; sys.exit(not json.load(open('$json'))['meta']['complete'])" 2>/dev/null && break
  done
  echo "$((SECONDS - t0)) s: $(grep "^$backend mesh $mesh:" "$OUT/${backend}_${mesh}.log" | tail -n 1)"
done
.venv/bin/python tests/opinfo/coverage_report.py "$OUT" docs/coverage.md
echo "all runs and the report: $((SECONDS - start)) s"
