#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md, one after the other; results in benchmarks/results/.
#   benchmarks/run_all.sh            # the full run (~25 min on 2 cores; the first run also writes 7 GiB of data)
#   benchmarks/run_all.sh --quick    # a smoke run (~4 min)
# On a shared machine, run bench_stage.py with --redo-busy 0.1 (see docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
QUICK=()
[[ "${1:-}" == "--quick" ]] && QUICK=(--quick)
OUT=${OUT:-benchmarks/results${QUICK:+/quick}}
"$PY" benchmarks/bench_stage.py "${QUICK[@]}" --out "$OUT/stage.json"
"$PY" benchmarks/bench_s3.py "${QUICK[@]}" --out "$OUT/s3.json"
"$PY" benchmarks/bench_s3_clients.py "${QUICK[@]}" | tee "$OUT/s3_clients.md"
"$PY" benchmarks/bench_manifest.py "${QUICK[@]}" --out "$OUT/manifest.json"
echo "results: $OUT/{stage,s3,manifest}.{json,md} $OUT/s3_clients.md"
