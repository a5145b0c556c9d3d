#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has Python 3.12, PyTorch's CUDA 13 and cuDNN 9
# wheels and nothing else of ours, and no package registry: one xz'd tar, split into pieces small enough
# to carry one at a time (.gpu/p1 .. .gpu/pN, ignored by git; PART_MIB each, default 60).
#
#   site/   onnxruntime-gpu 1.31.1 (its CUDA provider and Python binding: not the TensorRT provider, the
#           C API library or the transformers and quantization tools, which the service does not load),
#           the runtime dependencies at requirements.lock's versions, nvidia-ml-py (the gpu extra's) and
#           tritonclient (the gRPC rows' encoder); for cp312 on manylinux x86-64
#   tools/  wrk and its LuaJIT; with PERF_ANALYZER=1, perf_analyzer with its Debian 13 loader and
#           libraries, as bench/perf_analyzer.sh unpacked them (run `make perf-analyzer` once first)
#
# About 210 MiB in four pieces, against 255 MB for the onnxruntime-gpu wheel alone. On the GPU machine,
# with every piece in one folder, from the project's root:
#
#   cat /tmp/b/part.* | tar -xJf - -C /tmp/b
#   export PYTHONPATH=/tmp/b/site:$PWD PATH=/tmp/b/tools:$PATH ATTEND_TOOLS=/tmp/b/tools \
#          LD_LIBRARY_PATH=/tmp/b/tools:$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p)))")
#   scripts/gpu_check.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PART_MIB=${PART_MIB:-60}
VERSION=$(sed -n 's/^VERSION=//p' bench/perf_analyzer.sh)  # perf_analyzer's, where bench/perf_analyzer.sh unpacks it
TOOLS=${ATTEND_TOOLS:-/var/tmp/attend-tools}/perf-analyzer-$VERSION
PY=${PYTHON:-$ROOT/.venv/bin/python}
WITH_PA=${PERF_ANALYZER:-0}  # off by default: scripts/gpu_check.sh does not run it, and each MiB is carried
[ "$WITH_PA" = 0 ] || [ -x "$TOOLS/perf_analyzer" ] || { echo "no perf_analyzer in $TOOLS: run make perf-analyzer once" >&2; exit 2; }
command -v wrk >/dev/null || { echo "no wrk: apt-get install wrk" >&2; exit 2; }

WORK=$(mktemp -d /tmp/attend-gpu-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bundle/site" "$WORK/bundle/tools" "$WORK/wheels"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
pin() { grep -i "^$1==" requirements.lock; }

# The runtime's dependencies (every one pinned by the lock) and the gRPC rows' encoder.
"$PY" scripts/lock.py requirements | grep -v -e '^onnxruntime' -e '^numpy' >"$WORK/requirements.txt"
echo "$(pin tritonclient)" >>"$WORK/requirements.txt"
echo "$(pin nvidia-ml-py)" >>"$WORK/requirements.txt"  # NVML: the GPU's memory (the device budget, ATTEND_WORKERS=auto)
echo "$(pin python-rapidjson)" >>"$WORK/requirements.txt"
python3 -m pip download -q "${platform[@]}" -c requirements.lock -r "$WORK/requirements.txt" -d "$WORK/wheels" 2>&1 \
    | grep -v "is ignored" >&2 || true
python3 -m pip install -q --no-deps --no-compile --target "$WORK/bundle/site" "${platform[@]}" "$WORK"/wheels/*.whl 2>&1 \
    | grep -v -e "is ignored" -e "as the 'root' user" >&2 || true

# onnxruntime-gpu, less what the service never loads.
python3 -m pip download -q --no-deps "${platform[@]}" -d "$WORK" "onnxruntime-gpu==1.31.1" 2>&1 | grep -v "is ignored" >&2 || true
"$PY" -m zipfile -e "$WORK"/onnxruntime_gpu-*.whl "$WORK/bundle/site"
rm -rf "$WORK"/bundle/site/onnxruntime/capi/libonnxruntime.so.* "$WORK"/bundle/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
    "$WORK/bundle/site/onnxruntime/transformers" "$WORK/bundle/site/onnxruntime/quantization"

cp "$(command -v wrk)" "$(ldconfig -p | awk '/libluajit-5.1.so.2 / {print $NF; exit}')" "$WORK/bundle/tools/"
if [ "$WITH_PA" != 0 ]; then
    mkdir -p "$WORK/bundle/tools/perf-analyzer-$VERSION"
    cp -a "$TOOLS/perf_analyzer" "$TOOLS/root" "$WORK/bundle/tools/perf-analyzer-$VERSION/"
fi

grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu
echo "compressing (xz -9, a few minutes on two cores) ..." >&2
tar -C "$WORK/bundle" -cf - site tools | xz -T0 -9 | split -b "${PART_MIB}m" -d -a 1 - "$WORK/part."
i=1
for part in "$WORK"/part.*; do mkdir -p ".gpu/p$i"; mv "$part" ".gpu/p$i/"; i=$((i + 1)); done
du -sh .gpu/p*
