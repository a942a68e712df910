#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md, one after the other; results in benchmarks/results/.
#   benchmarks/run_all.sh            # the full run (~20 min on 2 cores; the first run also creates 7 GiB of data)
#   benchmarks/run_all.sh --quick    # a smoke run (~4 min)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
QUICK=()
[[ "${1:-}" == "--quick" ]] && QUICK=(--quick)
"$PY" benchmarks/bench_stage.py "${QUICK[@]}" --out "$OUT/stage.json"
"$PY" benchmarks/bench_s3.py "${QUICK[@]}" --out "$OUT/s3.json"
"$PY" benchmarks/bench_manifest.py "${QUICK[@]}" --out "$OUT/manifest.json"
echo "results: $OUT/{stage,s3,manifest}.{json,md}"
