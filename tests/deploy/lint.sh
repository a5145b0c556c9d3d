#!/usr/bin/env bash
# Static checks of deploy/kubernetes (no cluster needed): every resource against Kubernetes' own schemas,
# strictly (an unknown or misspelt field fails), with kubernetes-validate from PyPI (offline: the schemas
# ship in the package); the RayService's pod templates the same way (its CRD schema is KubeRay's, not
# shipped); then what the schemas cannot see (tests/deploy/check_manifests.py). The tool (~110 MB of
# schemas) goes to a venv of its own ($ATTEND_K8S_TOOLS, default /var/tmp/attend-k8s-tools), made once.
set -euo pipefail
cd "$(dirname "$0")/../.."

TOOLS=${ATTEND_K8S_TOOLS:-/var/tmp/attend-k8s-tools}
PINS=(kubernetes-validate==1.37.0)
if ! "$TOOLS/bin/python" -m pip show -q "${PINS[@]%%==*}" >/dev/null 2>&1 \
   || [ "$(cat "$TOOLS/.pins" 2>/dev/null)" != "${PINS[*]}" ]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "${PINS[@]}"
    echo "${PINS[*]}" >"$TOOLS/.pins"
fi

"$TOOLS/bin/python" tests/deploy/check_manifests.py --self-test
"$TOOLS/bin/python" tests/deploy/check_manifests.py
