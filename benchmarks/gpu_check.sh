#!/usr/bin/env bash
# Every GPU test and the GPU benchmarks, on the device machine (one GPU), in under 8 minutes:
#   benchmarks/gpu_check.sh                  # figures and logs in ${OUT:-benchmarks/results/gpu}
# Runs python3 from PATH (the system one, with CUDA torch) on this checkout (PYTHONPATH); installs nothing.
# Steps: nvidia-smi; versions and what is there (CuPy, cuFile with a GdsFile round trip, DALI);
# the tests marked gpu (pytest, if installed); benchmarks/bench_gpu.py.  A failing step does not stop
# the others; the last lines say what ran, passed, was skipped and why.  Exit 0 only if nothing that
# ran failed.  STAGINGLOADER_NVME_DIR: the folder for GDS (default: the one bench_gpu.py --probe finds);
# GPU_CHECK_BUDGET_S: seconds for all steps (default 460; the benchmark gets min(300, what is left)).
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${GPU_CHECK_BUDGET_S:-460}  # seconds for all the steps together (worst case stays under 8 minutes)

LINES=()
FAILED=0
record() {  # STATUS STEP DETAIL
    LINES+=("$(printf '%-8s %-28s %s' "$1" "$2" "$3")")
    [[ $1 == FAILED ]] && FAILED=1
    return 0
}

step_nvidia_smi() {
    echo "==== nvidia-smi"
    if ! command -v nvidia-smi >/dev/null; then
        record SKIPPED nvidia-smi "not on PATH"
        return
    fi
    local q=index,name,driver_version,memory.total,memory.used,utilization.gpu,pcie.link.gen.current,pcie.link.width.current
    local csv rc
    csv=$(timeout -k 5 30 nvidia-smi --query-gpu=$q --format=csv 2>&1)
    rc=$?
    echo "$csv"
    if [[ $rc -eq 0 ]]; then
        record PASSED nvidia-smi "$(echo "$csv" | sed -n 2p)"
    else
        record FAILED nvidia-smi "exit $rc: $(echo "$csv" | tail -n 1)"
    fi
}

NVME_DIR=${STAGINGLOADER_NVME_DIR:-}
CUDA=0
step_probe() {
    echo "==== versions, and what this machine has"
    local args=(--probe --out "$OUT/probe.json")
    [[ -n $NVME_DIR ]] && args+=(--nvme-dir "$NVME_DIR")
    timeout -k 5 90 "$PY" benchmarks/bench_gpu.py "${args[@]}"
    local rc=$?
    if [[ $rc -ne 0 || ! -s $OUT/probe.json ]]; then
        record FAILED probe "bench_gpu.py --probe exit $rc"
        return
    fi
    local key value
    while IFS=$'\t' read -r key value; do
        case $key in
            cuda) [[ $value == True ]] && CUDA=1 ;;
            nvme) [[ -z $NVME_DIR ]] && NVME_DIR=$value ;;
            *) record INFO "$key" "$value" ;;
        esac
    done < <("$PY" - "$OUT/probe.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m, g = d["machine"], d.get("gds_probe", {})
print(f"cuda\t{m.get('cuda_available', False)}")
print(f"versions\tpython {m['python']}, torch {m.get('torch')}, CUDA {m.get('torch_cuda')}, GPU {m.get('gpu', 'none')}")
print(f"cupy\t{m.get('cupy')}")
print(f"dali\t{m.get('dali')}")
c = m.get("cufile", {})
print(f"cufile config\tallow_compat_mode: {c.get('allow_compat_mode')}; nvidia-fs loaded: {c.get('nvidia_fs_loaded')}")
if "folder" in g:
    print(f"nvme\t{g['folder']}")
    print(f"gds round trip\t{g.get('roundtrip')} ({g['folder']}: {g.get('fs')} on {g.get('device')})")
else:
    print(f"gds round trip\tnot tried: {g.get('skipped')}")
print(f"stagingloader\t{m.get('stagingloader')}")
EOF
    )
    record PASSED probe "versions and devices in $OUT/probe.json"
}

WHEELS=${GPU_CHECK_WHEELS:-$REPO/.gpu-wheels}
step_deps() {  # stagingloader needs xxhash, fsspec, tqdm; the tests pytest: from carried wheels if absent
    local missing
    missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("xxhash", "fsspec", "tqdm", "pytest", "pytest_timeout")
               if importlib.util.find_spec(m) is None).replace("pytest_timeout", "pytest-timeout"))
EOF
    )
    if [[ -z $missing ]]; then
        return
    fi
    if [[ ! -d $WHEELS ]]; then
        record INFO deps "missing for $PY: $missing (run 'make gpu-wheels' where there is network, carry .gpu-wheels)"
        return
    fi
    local venv=${TMPDIR:-/tmp}/stagingloader-gpu-venv
    if "$PY" -m venv --system-site-packages "$venv" >/dev/null 2>&1 &&
        "$venv/bin/python" -m pip install -q --no-index --find-links "$WHEELS" $missing >/dev/null 2>&1; then
        PY=$venv/bin/python
        record INFO deps "installed from $WHEELS into $venv: $missing"
    else
        record INFO deps "missing for $PY: $missing; installing from $WHEELS failed"
    fi
}

step_pytest() {
    echo "==== tests marked gpu"
    local files=()
    mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.gpu' tests 2>/dev/null | sort)
    if ! "$PY" -c 'import pytest' 2>/dev/null; then
        record SKIPPED "gpu tests" "pytest is not installed for $PY"
        return
    fi
    if [[ ${#files[@]} -eq 0 ]]; then
        record SKIPPED "gpu tests" "no test file under tests/ is marked gpu"
        return
    fi
    [[ -n $NVME_DIR ]] && export STAGINGLOADER_NVME_DIR=$NVME_DIR
    local log=$OUT/pytest.log rc
    timeout -k 10 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
        "${files[@]}" >"$log" 2>&1
    rc=$?
    tail -n 60 "$log"
    local last passed failed skipped errors reasons missing
    last=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    count() { grep -oE "[0-9]+ $1" <<<"$last" | head -n 1 | cut -d' ' -f1; }
    passed=$(count passed); failed=$(count failed); skipped=$(count skipped); errors=$(count 'errors?')
    passed=${passed:-0}; failed=${failed:-0}; skipped=${skipped:-0}; errors=${errors:-0}
    reasons=$(grep -E '^SKIPPED' "$log" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+: //' | sort -u | head -n 3 | paste -sd ';' -)
    missing=$(grep -oE "No module named '[^']+'" "$log" | grep -vE "'(stagingloader|tests)[.']" | sort -u | paste -sd ',' -)
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        record FAILED "gpu tests" "timed out after 240 s; see $log"
    elif [[ $rc -eq 5 ]]; then
        record SKIPPED "gpu tests" "no test selected by -m gpu in ${files[*]}"
    elif [[ $failed -gt 0 || ($rc -ne 0 && -z $missing) ]]; then
        record FAILED "gpu tests" "${last:-pytest exit $rc}; see $log"
    else
        # not collected for want of a third-party module that cannot be installed here: skipped, not failed
        [[ -n $missing ]] && record SKIPPED "gpu tests" "${errors/#0/all} not collected: $missing, for $PY"
        if [[ $passed -gt 0 ]]; then
            record PASSED "gpu tests" "$last"
        elif [[ $skipped -gt 0 ]]; then
            record SKIPPED "gpu tests" "all $skipped skipped: ${reasons:-see $log}"
        fi
    fi
}

step_bench() {
    echo "==== benchmarks/bench_gpu.py"
    local left=$((BUDGET - SECONDS))
    ((left > 300)) && left=300
    if ((left < 60)); then
        record SKIPPED bench_gpu "only ${left}s left of the ${BUDGET}s budget"
        return
    fi
    local args=(--out "$OUT/gpu.json") rc
    [[ -n $NVME_DIR ]] && args+=(--nvme-dir "$NVME_DIR")
    rm -f "$OUT/gpu.json"
    timeout -k 10 "$left" "$PY" benchmarks/bench_gpu.py "${args[@]}"
    rc=$?
    if [[ ! -s $OUT/gpu.json ]]; then
        record FAILED bench_gpu "exit $rc and no $OUT/gpu.json"
        return
    fi
    [[ $rc -eq 124 || $rc -eq 137 || $rc -eq 143 ]] && record FAILED bench_gpu "timed out after ${left}s (what it finished is in gpu.json)"
    local status name detail
    while IFS=$'\t' read -r status name detail; do
        record "$status" "bench $name" "$detail"
    done < <("$PY" - "$OUT/gpu.json" <<'EOF'
import json, sys
for name, r in json.load(open(sys.argv[1])).get("results", {}).items():
    if "skipped" in r:
        print(f"SKIPPED\t{name}\t{r['skipped']}")
    elif "error" in r or "failed" in r:
        print(f"FAILED\t{name}\t{r.get('error') or r.get('failed')}")
    else:
        print(f"PASSED\t{name}\tin {r.get('seconds')} s")
EOF
    )
    [[ $rc -ne 0 && $rc -ne 1 && $rc -ne 124 && $rc -ne 137 && $rc -ne 143 ]] && record FAILED bench_gpu "exit $rc"
    return 0
}

main() {
    echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), repo $REPO, figures in $OUT"
    PY=$(command -v python3) || { record FAILED python3 "no python3 on PATH"; }
    step_nvidia_smi
    if [[ -n ${PY:-} ]]; then
        echo "python3: $PY ($("$PY" --version 2>&1))"
        step_deps
        step_probe
        ((CUDA)) || echo "(no CUDA device for $PY: the GPU tests and measurements will say they skipped)"
        step_pytest
        step_bench
    fi
    echo
    echo "==== gpu_check summary (${SECONDS}s; figures and logs in $OUT)"
    printf '%s\n' "${LINES[@]}"
    local n_pass n_fail n_skip
    n_pass=$(printf '%s\n' "${LINES[@]}" | grep -c '^PASSED')
    n_fail=$(printf '%s\n' "${LINES[@]}" | grep -c '^FAILED')
    n_skip=$(printf '%s\n' "${LINES[@]}" | grep -c '^SKIPPED')
    echo "ran $((n_pass + n_fail)): passed $n_pass, failed $n_fail; skipped $n_skip"
    return "$FAILED"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
