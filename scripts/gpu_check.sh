#!/usr/bin/env bash
# The checks only a GPU machine can run, in one go, each step bounded in time and all of them by BUDGET
# (at most 9 minutes): what ONNX Runtime sees there, the gpu-marked tests and the files their services wrote
# (for a read-only root), the long-sequence table (bench/longseq.py: model.onnx against the fused graph and its
# fp16 form, outputs only), the scaling sweep
# (bench/scaling.py: 1 to 8 worker processes, CUDA and the CPU execution provider, the plain server beside),
# the engine's (bench/engine.py: a session a worker against one engine process owning the GPU) and what one
# worker holds (bench/worker_memory.py: the GPU memory of a worker as served, and with each candidate change).
# Each step's output goes to OUT/<step>.txt, its exit status to OUT/summary.txt, the benches' results to
# OUT/*.json. Back on a development machine, copy each to docs/ and write its tables:
#   python bench/scaling.py --report --results docs/scaling.json --out docs/benchmarks.md
#   python bench/longseq.py --report --results docs/benchmarks-longseq-cuda.json --out docs/benchmarks.md
#   python bench/engine.py --report --results docs/engine-cuda.json --out docs/benchmarks.md
#   python bench/worker_memory.py --report --results docs/worker-memory-cuda.json --out docs/benchmarks.md
#
#   scripts/gpu_check.sh [OUT]     (default: gpu-check)
#
# Needs onnxruntime-gpu importable by PYTHON (scripts/gpu_bundle.sh packs it), wrk on the PATH,
# tritonclient for the gRPC row, an exported REPOSITORY and LONGSEQ (`python bench/longseq.py --export
# DIR`; one exported before commit 517cfc6 has no fp16 graph, whose rows then read "not run").
# Settings, from the environment: PYTHON (python3), REPOSITORY (model_repository), LONGSEQ
# (build/longseq), BUDGET (seconds for every step together, 530).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHON=$PY PYTHONUNBUFFERED=1
REPOSITORY=$(realpath "${REPOSITORY:-model_repository}")
LONGSEQ=$(realpath "${LONGSEQ:-build/longseq}")
status=0
END=$(($(date +%s) + ${BUDGET:-530}))

step() {  # step NAME SECONDS COMMAND...: the command's output in OUT/NAME.txt, its exit status in OUT/summary.txt
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    [ "$limit" -le $((END - started)) ] || limit=$((END - started))
    if [ "$limit" -lt 10 ]; then echo "$name: not run, BUDGET spent" | tee -a "$OUT/summary.txt" >&2; status=1; return; fi
    echo "== $name (at most ${limit}s)" >&2
    timeout -s TERM -k 10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - started)) s" | tee -a "$OUT/summary.txt" >&2
    [ "$rc" = 0 ] || status=1
}

step environment 30 bash -ec "nvidia-smi; lscpu | grep -m1 'Model name'; nproc
  $PY -c 'import onnxruntime as o, pynvml; print(o.__version__, o.get_available_providers())'"
touch "$OUT/.started"
step pytest-gpu 100 env ATTEND_TEST_REPOSITORY="$REPOSITORY" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/service/test_gpu.py
if grep -q skipped "$OUT/pytest-gpu.txt"; then  # here a skip is a failure: CUDA could not be used
    echo "pytest-gpu: tests skipped" | tee -a "$OUT/summary.txt" >&2
    status=1
fi
# What the gpu tests' CUDA services wrote, outside OUT and /proc, /sys, /dev (files by folder): whether the GPU
# compose service and deploy/kubernetes/attend-gpu.yaml may have a read-only root, as the CPU ones have.
step writes 30 bash -c 'find / \( -path /proc -o -path /sys -o -path /dev -o -path "$1" \) -prune -o -type f \
    -newer "$1/.started" -printf "%h\n" | sort | uniq -c | sort -rn | head -80' writes "$(realpath "$OUT")"
step longseq 130 "$PY" bench/longseq.py --device cuda --repository "$LONGSEQ" --budget 105 \
    --results "$OUT/longseq-cuda.json"
step scaling 270 "$PY" bench/scaling.py --device both --processes 1,2,4,8 --budget 225 \
    --repository "$REPOSITORY" --results "$OUT/scaling.json"
step engine 100 "$PY" bench/engine.py --device cuda --processes 1,8 --concurrency 64 --seconds 2 \
    --repository "$REPOSITORY" --results "$OUT/engine.json"
step memory 95 "$PY" bench/worker_memory.py --device cuda --timeout 25 --budget 85 \
    --repository "$REPOSITORY" --results "$OUT/worker-memory-cuda.json"
cat "$OUT/summary.txt"
exit $status
