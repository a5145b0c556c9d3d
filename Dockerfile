# attend: export the default model repository with torch (CPU), serve it with ONNX Runtime.
#
#   docker build -t attend .                                   # GPU image (CUDA 13 + cuDNN 9 as pip wheels)
#   docker build -t attend:cpu --build-arg ORT_EXTRAS= .       # CPU-only image (no NVIDIA libraries)
#   docker build -t attend-locust --target locust .            # the load generator (tests/load/locustfile.py)
#
# Build arguments:
#   BASE_IMAGE      a Debian/Ubuntu image with python3 (3.11, for the torch wheel) and venv;
#                   default python:3.11-slim-bookworm. Not a CUDA base image: onnxruntime-gpu 1.31 needs
#                   CUDA 13 + cuDNN 9, and its [cuda,cudnn] extras bring exactly those as pinned wheels
#                   (loaded by the service with onnxruntime.preload_dlls), so one small Python base serves
#                   the export stage, the GPU image and the CPU image alike; the host gives only the driver.
#   ORT_EXTRAS      extras of onnxruntime-gpu for the runtime stage; "cuda,cudnn" (default) brings the
#                   CUDA 13 and cuDNN 9 libraries as wheels, "" builds the CPU-only image
#   TORCH_WHEELS    a folder in the build context with the torch+cpu wheel of requirements.lock; when it
#                   holds none, torch comes from TORCH_INDEX_URL (the CPU build, never the CUDA one)
#   TORCH_INDEX_URL
#
# Every package is installed at the version requirements.lock gives (pip's constraints).
#
# Only the classic builder's features are used (no RUN --mount, no heredocs, no named contexts), so it
# builds with BuildKit and with the plain engine alike.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- base: a venv on the base image's python3
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && groupadd --system --gid 10001 attend \
    && useradd --system --uid 10001 --gid attend --create-home --home-dir /home/attend \
        --shell /usr/sbin/nologin attend
WORKDIR /app
# The project's requirements, each list from pyproject.toml, each installed at the versions of
# requirements.lock (used as constraints); a code change leaves these layers alone.
COPY pyproject.toml requirements.lock ./
COPY scripts/lock.py ./scripts/lock.py
RUN python scripts/lock.py requirements >/tmp/requirements.txt \
    && python scripts/lock.py requirements export | grep -v -x -F -f /tmp/requirements.txt >/tmp/requirements-export.txt \
    && { python scripts/lock.py requirements load | grep -v -x -F -f /tmp/requirements.txt; \
         grep '^numpy' /tmp/requirements.txt; } >/tmp/requirements-load.txt

# ---------------------------------------------------------------- locust: the load generator
FROM base AS locust
# locust, and numpy at the runtime's pin (the locustfile makes its request bodies with it).
RUN pip install -c requirements.lock -r /tmp/requirements-load.txt
COPY tests/load/locustfile.py ./tests/load/locustfile.py
USER 10001:10001
ENTRYPOINT ["locust", "-f", "/app/tests/load/locustfile.py"]
CMD ["--headless", "--users", "8", "--spawn-rate", "8", "--run-time", "30s", "--only-summary", \
     "--host", "http://api:8000"]

# ---------------------------------------------------------------- export: torch (CPU) writes /models
FROM base AS export
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=tests/container/wheels
# pyproject.toml is listed so that the COPY has a source when the wheel folder is empty or absent.
COPY pyproject.toml ${TORCH_WHEELS}/torch-*.whl /tmp/wheels/
# The lock pins torch's "+cpu" build: pip can never fall back to the registry's build with GBs of CUDA wheels.
RUN if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        set -- --find-links /tmp/wheels; \
    else \
        set -- --extra-index-url "${TORCH_INDEX_URL}"; \
    fi \
    && pip install "$@" -c requirements.lock -r /tmp/requirements.txt -r /tmp/requirements-export.txt \
    && rm -rf /tmp/wheels
COPY models ./models
COPY export ./export
# The service runs as another user: make the repository world-readable whatever the build's umask gave
# the files onnx writes (it stays owned by root, read-only for the service).
RUN python -m export --repository /models && chmod -R a+rX /models

# ---------------------------------------------------------------- runtime (the default target): no torch
FROM base AS runtime
ARG ORT_EXTRAS=cuda,cudnn
# "onnxruntime-gpu[]" (ORT_EXTRAS empty) adds nothing to the pinned requirement. The GPU image also takes
# nvidia-ml-py (pyproject's gpu extra): through NVML the service reads the GPU's memory, which sizes
# ATTEND_MAX_DEVICE_BYTES's default and ATTEND_WORKERS=auto (without it: no GPU budget, and with
# ATTEND_DEVICE=cuda 8 workers, whatever the GPU holds).
RUN pip install -c requirements.lock -r /tmp/requirements.txt "onnxruntime-gpu[${ORT_EXTRAS}]" ${ORT_EXTRAS:+nvidia-ml-py} \
    && if python -c "import torch" 2>/dev/null; then echo "torch must not be in the runtime image" >&2; exit 1; fi \
    && if [ -n "${ORT_EXTRAS}" ]; then python -c "import pynvml"; fi
COPY --from=export /models /models
# The service reads export/repository.py (torch-free); the exporter modules are not imported.
COPY export ./export
COPY service ./service
ENV ATTEND_HOST=0.0.0.0 \
    ATTEND_PORT=8000 \
    ATTEND_GRPC_PORT=8001 \
    ATTEND_MODEL_REPOSITORY=/models \
    ATTEND_DEVICE=auto \
    ATTEND_WORKERS=1 \
    ATTEND_LOG_LEVEL=info \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
# HTTP (REST, /attend, the page, metrics) and gRPC (the Open Inference Protocol, grpc_service.proto).
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('ATTEND_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "service"]
