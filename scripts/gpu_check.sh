#!/usr/bin/env bash
# The checks only a GPU machine can run, in one go, each step bounded by its own time limit so that a
# slow one leaves the others their time, and all of them by BUDGET: what ONNX Runtime sees there, the
# gpu-marked tests, Triton's perf_analyzer against the service on CUDA (HTTP and gRPC), and
# `bench/run.py --device cuda` (the service against the plain server, both on CUDA). Each step's output
# goes to OUT/<step>.txt, its exit status to OUT/summary.txt; the bench's results to OUT/bench-cuda.json
# (`bench/run.py --report` renders them).
#
#   scripts/gpu_check.sh [OUT]     (default: gpu-check)
#
# Needs onnxruntime-gpu importable by PYTHON (../shared/GPU.md), wrk, perf_analyzer where
# bench/perf_analyzer.sh looks for it (ATTEND_TOOLS), and an exported REPOSITORY (the tests use a copy of
# it: ATTEND_TEST_REPOSITORY). Settings, from the environment: PYTHON (python3), REPOSITORY
# (model_repository), ROWS (W1,W2,W3,W4,W2bin,W1grpc,W2grpc), ROUNDS (3), DURATION (2), CONCURRENCY (1,16),
# BUDGET (seconds for every step together, 540).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHON=$PY PYTHONUNBUFFERED=1
REPOSITORY=$(realpath "${REPOSITORY:-model_repository}")
ROWS=${ROWS:-W1,W2,W3,W4,W2bin,W1grpc,W2grpc}  # gRPC rows need tritonclient (scripts/gpu_bundle.sh packs it)
status=0
END=$(($(date +%s) + ${BUDGET:-540}))

step() {  # step NAME SECONDS COMMAND...: the command's output in OUT/NAME.txt, its exit status in OUT/summary.txt
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    [ "$limit" -le $((END - started)) ] || limit=$((END - started))
    if [ "$limit" -lt 10 ]; then echo "$name: not run, BUDGET spent" | tee -a "$OUT/summary.txt" >&2; status=1; return; fi
    echo "== $name (at most ${limit}s)" >&2
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - started)) s" | tee -a "$OUT/summary.txt" >&2
    [ "$rc" = 0 ] || status=1
}

step environment 60 bash -ec "nvidia-smi; $PY -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'"
step pytest-gpu 150 env ATTEND_TEST_REPOSITORY="$REPOSITORY" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/service/test_gpu.py
if grep -q skipped "$OUT/pytest-gpu.txt"; then  # here a skip is a failure: CUDA could not be used
    echo "pytest-gpu: tests skipped" | tee -a "$OUT/summary.txt" >&2
    status=1
fi
for protocol in http grpc; do
    step "perf-analyzer-$protocol" 90 env ATTEND_DEVICE=cuda bash bench/perf_analyzer.sh --protocol "$protocol" \
        --repository "$REPOSITORY" --concurrency "1 4 16" --max-memory-gb 32
done
step bench 420 "$PY" bench/run.py --device cuda --repository "$REPOSITORY" --rows "$ROWS" \
    --rounds "${ROUNDS:-3}" --duration "${DURATION:-2}" --concurrency "${CONCURRENCY:-1,16}" \
    --results "$OUT/bench-cuda.json"
cat "$OUT/summary.txt"
exit $status
