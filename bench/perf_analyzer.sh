#!/usr/bin/env bash
# perf_analyzer, Triton's load tool, against the service's Open Inference Protocol, over HTTP (binary
# tensors), gRPC (raw contents, --protocol grpc) or gRPC's stream (ModelStreamInfer, --protocol grpc-stream): W2 (dot_product, 8 x 128 x 128 x 64, random 1-D valid
# lengths), a concurrency sweep; with each point,
# perf_analyzer's server-side breakdown (queue, compute input/infer/output), read from the service's
# statistics extension (GET /v2/models/dot_product/stats).
#
#   bench/perf_analyzer.sh [--protocol http|grpc|grpc-stream] [--url http://HOST:PORT [--grpc-url HOST:PORT] | --repository DIR]
#                          [--concurrency "1 2 4 8 16"] [--seconds 1] [--stability 50] [--max-memory-gb 16]
#                          [--max-trials 6] [--shared-memory none|system] [--out FILE]
#
# --shared-memory system: the tensors go through system shared memory (perf_analyzer registers its regions;
# the service it starts has ATTEND_SHARED_MEMORY=true), not in the requests and responses.
#
# Without --url it starts `python -m service` on a free port, pinned to core 0 (one ONNX Runtime thread; on
# the CPU execution provider unless ATTEND_DEVICE says otherwise, e.g. cuda on a GPU machine),
# as bench/run.py does; perf_analyzer runs on core 1. The exit status is perf_analyzer's own (its
# Python wrapper exits 0 even when the binary cannot start, so the binary is called directly), or 3
# when perf_analyzer passed --max-memory-gb (it keeps every response it receives, ~1.6 MB a W2
# request; once in a while a point ran on until the kernel killed it at 23 GB). Hence windows of 1 s:
# at the ~400-600 W2 requests/s the service answers now, 6 windows of 5 s would be ~19 GB of responses.
# Its stabilisation (the last 3 windows within --stability percent) fails now and then at 30% on a
# shared 2-core machine, hence 50.
#
# perf_analyzer 2.60 comes as a wheel for glibc 2.38 or newer; on Debian 12 (glibc 2.36) pip quietly
# installs a 2 KB placeholder instead. So the real wheel is downloaded for its platform, and the binary
# runs through Debian 13's own loader, libc and libstdc++, unpacked into a private folder
# ($ATTEND_TOOLS/perf-analyzer-<version>; the system's libc is not touched).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=2.60.0
TOOLS=${ATTEND_TOOLS:-/var/tmp/attend-tools}/perf-analyzer-$VERSION
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)  # a machine without the venv (scripts/gpu_check.sh)
URL=""
REPOSITORY=model_repository
CONCURRENCY="1 2 4 8 16"
SECONDS_PER_POINT=1
STABILITY=50
MAX_MEMORY_GB=16
MAX_TRIALS=6
OUT=""
SHARED_MEMORY=none
PROTOCOL=http
GRPC_URL=""
while [ $# -gt 0 ]; do
    case $1 in
        --url) URL=$2; shift 2 ;;
        --protocol) PROTOCOL=$2; shift 2 ;;
        --grpc-url) GRPC_URL=$2; shift 2 ;;
        --repository) REPOSITORY=$2; shift 2 ;;
        --concurrency) CONCURRENCY=$2; shift 2 ;;
        --seconds) SECONDS_PER_POINT=$2; shift 2 ;;
        --stability) STABILITY=$2; shift 2 ;;
        --max-memory-gb) MAX_MEMORY_GB=$2; shift 2 ;;
        --max-trials) MAX_TRIALS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --shared-memory) SHARED_MEMORY=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

case $PROTOCOL in
    http|grpc|grpc-stream) ;;
    *) echo "--protocol is http, grpc or grpc-stream, not $PROTOCOL" >&2; exit 2 ;;
esac
case $SHARED_MEMORY in
    none|system) ;;
    *) echo "--shared-memory is none or system, not $SHARED_MEMORY" >&2; exit 2 ;;
esac
if [ "$PROTOCOL" != http ] && [ -n "$URL" ] && [ -z "$GRPC_URL" ]; then
    echo "--protocol $PROTOCOL with --url needs --grpc-url HOST:PORT (the service's ATTEND_GRPC_PORT)" >&2; exit 2
fi

# ------------------------------------------------------------------ the tool: wheel + Debian 13 runtime
if [ ! -x "$TOOLS/perf_analyzer" ] || [ ! -e "$TOOLS/root/usr/lib64/ld-linux-x86-64.so.2" ]; then
    echo "fetching perf_analyzer $VERSION and Debian 13's libc into $TOOLS" >&2
    rm -rf "$TOOLS" && mkdir -p "$TOOLS"/{apt/lists,apt/cache,debs,root}
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
        --python-version 3.11 -d "$TOOLS" "perf-analyzer==$VERSION" 2>&1 | grep -v "is ignored" >&2 || true
    "$PYTHON" -m zipfile -e "$TOOLS"/perf_analyzer-"$VERSION"-*.whl "$TOOLS/wheel"
    install -m 755 "$TOOLS/wheel/perf_analyzer/bin/perf_analyzer" "$TOOLS/perf_analyzer"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
        >"$TOOLS/apt/sources.list"
    apt=(-o "Dir::Etc::SourceList=$TOOLS/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
         -o "Dir::State::Lists=$TOOLS/apt/lists" -o "Dir::Cache=$TOOLS/apt/cache" -o Debug::NoLocking=1)
    apt-get "${apt[@]}" update -qq >&2
    (cd "$TOOLS/debs" && apt-get "${apt[@]}" download libc6 libstdc++6 libgcc-s1 libssl3t64 zlib1g >&2 2>/dev/null)
    for deb in "$TOOLS"/debs/*.deb; do dpkg-deb -x "$deb" "$TOOLS/root"; done
fi
LIBS=$TOOLS/root/usr/lib/x86_64-linux-gnu
perf_analyzer() {
    taskset -c 1 "$TOOLS/root/usr/lib64/ld-linux-x86-64.so.2" --library-path "$LIBS" "$TOOLS/perf_analyzer" "$@"
}
perf_analyzer --version >&2

# ------------------------------------------------------------------ the data: W2, one batch element a row
RUN=$(mktemp -d /tmp/attend-perf-analyzer.XXXXXX)
SERVICE_PID=""
cleanup() {
    if [ -n "$SERVICE_PID" ]; then kill -TERM "$SERVICE_PID" 2>/dev/null || true; wait "$SERVICE_PID" 2>/dev/null || true; fi
    rm -rf "$RUN"
}
trap cleanup EXIT
"$PYTHON" - "$RUN/data.json" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
import numpy as np
from run import workloads

w2 = workloads()["W2"][1]
rows = []
for b in range(8):  # perf_analyzer stacks -b 8 of these: the batch axis is not in the config's dims
    row = {name: {"content": np.array(w2[name][b], dtype=np.float32).ravel().tolist(), "shape": [128, 64]}
           for name in ("queries", "keys", "values")}
    row["valid_lens"] = {"content": [int(w2["valid_lens"][b])] * 128, "shape": [128]}
    rows.append(row)
json.dump({"data": rows}, open(sys.argv[1], "w"))
EOF

# ------------------------------------------------------------------ the service
if [ "$PROTOCOL" != http ]; then SERVED="the service's gRPC at $GRPC_URL"; else SERVED="the service at $URL"; fi
if [ -z "$URL" ]; then
    SERVED="\`python -m service\` (core 0, one ONNX Runtime thread, ATTEND_DEVICE=${ATTEND_DEVICE:-cpu})"
    PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    [ -d "$REPOSITORY" ] || "$PYTHON" -m export --repository "$REPOSITORY" >&2
    GRPC_PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    GRPC_URL=127.0.0.1:$GRPC_PORT
    ATTEND_SHARED_MEMORY=$([ "$SHARED_MEMORY" = system ] && echo true || echo false) \
    ATTEND_PORT=$PORT ATTEND_GRPC_PORT=$GRPC_PORT ATTEND_MODEL_REPOSITORY=$REPOSITORY ATTEND_INTRA_OP_THREADS=1 \
        ATTEND_LOG_LEVEL=warning ATTEND_DEVICE=${ATTEND_DEVICE:-cpu} taskset -c 0 "$PYTHON" -m service 2>"$RUN/service.log" &
    SERVICE_PID=$!
    URL=http://127.0.0.1:$PORT
    for _ in $(seq 1 100); do
        curl -sf "$URL/v2/health/ready" >/dev/null && break
        kill -0 "$SERVICE_PID" 2>/dev/null || { cat "$RUN/service.log" >&2; exit 1; }
        sleep 0.2
    done
fi

# ------------------------------------------------------------------ the sweep
# tensors as raw_input_contents, outputs as raw_output_contents over gRPC; a stream per concurrent client
case $PROTOCOL in
    grpc) FLAGS="-i grpc"; TARGET=(-u "$GRPC_URL" -i grpc) ;;
    grpc-stream) FLAGS="-i grpc --streaming"; TARGET=(-u "$GRPC_URL" -i grpc --streaming) ;;
    http) FLAGS="-i http"; TARGET=(-u "${URL#http://}" -i http --input-tensor-format binary --output-tensor-format binary) ;;
esac
if [ "$SHARED_MEMORY" = system ]; then  # W2's largest output, its weights: 8 x 128 x 128 x 4 bytes
    FLAGS+=" --shared-memory system"; TARGET+=(--shared-memory system --output-shared-memory-size 524288)
fi
SERVER=""
TABLE="| concurrency | requests/s (batch 8) | inferences/s | p50 ms | p90 ms | p99 ms |
| ---: | ---: | ---: | ---: | ---: | ---: |"
# perf_analyzer keeps ~1.6 MB per W2 request it sends (24 GB when the kernel killed it after 12
# windows of 3 s): 6 windows a point keep it to a few GB.
for c in $CONCURRENCY; do
    status=0
    taskset -c 1 "$TOOLS/root/usr/lib64/ld-linux-x86-64.so.2" --library-path "$LIBS" "$TOOLS/perf_analyzer" \
        -m dot_product "${TARGET[@]}" -b 8 --input-data "$RUN/data.json" \
        --shape queries:128,64 --shape keys:128,64 --shape values:128,64 --shape valid_lens:128 \
        --concurrency-range "$c:$c" --measurement-interval "$((SECONDS_PER_POINT * 1000))" --max-trials "$MAX_TRIALS" \
        --stability-percentage "$STABILITY" -f "$RUN/c$c.csv" >"$RUN/c$c.log" 2>&1 &
    pa=$!
    # Its memory, watched: stopped at MAX_MEMORY_GB rather than left to the kernel's OOM killer,
    # which takes the machine's other processes' memory with it first.
    over=0
    while kill -0 "$pa" 2>/dev/null; do
        rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pa/status" 2>/dev/null || true)
        if [ "${rss:-0}" -gt $((MAX_MEMORY_GB * 1024 * 1024)) ]; then
            over=$rss
            kill -KILL "$pa" 2>/dev/null || true
            break
        fi
        sleep 0.25
    done
    wait "$pa" || status=$?
    if [ "$over" != 0 ]; then
        cat "$RUN/c$c.log" >&2
        echo "perf_analyzer stopped at concurrency $c: it held $((over / 1024)) MiB, over --max-memory-gb $MAX_MEMORY_GB" >&2
        exit 3
    fi
    if [ "$status" != 0 ]; then
        cat "$RUN/c$c.log" >&2
        echo "perf_analyzer exited with $status at concurrency $c" >&2
        exit "$status"
    fi
    # Its server-side breakdown, from the service's statistics (GET /v2/models/dot_product/stats), as it printed it.
    SERVER+=$'\n'"Concurrency $c:"$'\n'$(sed -n '/^  Server: *$/,/Avg request latency/p' "$RUN/c$c.log")
    TABLE+=$'\n'$("$PYTHON" - "$RUN/c$c.csv" <<'EOF'
import csv, sys
row = next(csv.DictReader(open(sys.argv[1])))
inferences = float(row["Inferences/Second"])
ms = {k: float(row[f"{k} latency"]) / 1e3 for k in ("p50", "p90", "p99")}
print(f"| {row['Concurrency']} | {inferences / 8:.0f} | {inferences:.0f} | {ms['p50']:.2f} | {ms['p90']:.2f} | "
      f"{ms['p99']:.2f} |")
EOF
)
done
COMMAND="bench/perf_analyzer.sh --protocol $PROTOCOL --shared-memory $SHARED_MEMORY --concurrency \"$CONCURRENCY\" --seconds $SECONDS_PER_POINT --stability $STABILITY --max-trials $MAX_TRIALS"
if [ "$PROTOCOL" != http ]; then TENSORS="raw contents in and out"; else TENSORS="binary tensors in and out"; fi
if [ "$SHARED_MEMORY" = system ]; then TENSORS="tensors in system shared memory"; fi
TEXT="perf_analyzer $VERSION (\`$FLAGS -b 8\`, $TENSORS, \`--input-data\` of W2's rows) against $SERVED; perf_analyzer on core 1. Command: \`$COMMAND\`.

$TABLE

perf_analyzer's server-side breakdown (the service's statistics extension), per concurrency:
$SERVER"
echo "$TEXT"
if [ -n "$OUT" ]; then echo "$TEXT" >"$OUT"; fi
