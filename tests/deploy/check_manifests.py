"""Checks of deploy/kubernetes, run by tests/deploy/lint.sh in its tools venv (kubernetes-validate, PyYAML;
not the project's venv, so nothing of the service is imported: its settings are read from service/config.py's
source).

    python tests/deploy/check_manifests.py               check; exit 1 with one line a problem
    python tests/deploy/check_manifests.py --self-test   the checks catch broken copies of the manifests

1. Every resource of deploy/kubernetes/attend.yaml and attend-gpu.yaml against Kubernetes' schemas, strict
   (unknown fields fail), for the oldest version the manifests need (1.30: the preStop `sleep` action) and
   the newest the tool knows. The CRD schemas of KServe and KubeRay do not ship with the tool: kserve.yaml's
   predictor (less KServe's own fields) is checked as a PodSpec, the RayService's head and worker pod
   templates as `PodTemplate`s, its Serve config against deploy/ray/cluster.yaml. A file of
   deploy/kubernetes that this script does not know fails the check.
2. What a schema cannot know: the probes ask the service's health routes on the port it listens on;
   the grace period covers preStop plus ATTEND_GRACE_PERIOD_S (or Serve's graceful_shutdown_timeout_s, or
   KServe's timeout); the Service, PodDisruptionBudget and HPA point at their Deployment's pods and at no
   other file's, and the budget lets a drain evict a pod; memory is requested and limited, the limit room for
   the idle process and ATTEND_MAX_INFLIGHT_BYTES a worker (docs/reliability.md's sizing); a GPU goes with
   ATTEND_DEVICE=cuda, the CUDA image and a toleration of the nvidia.com/gpu taint; KServe's predictor keeps
   to Knative's subset of a pod (one port named http1 or h2c, no lifecycle, no startupProbe); every ATTEND_*
   variable is a setting of service/config.py (a misspelt one would be silently ignored by the service).
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import yaml
from kubernetes_validate import utils as kv

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"
VERSIONS = ["1.30.0", kv.latest_version()]
# docs/reliability.md: a worker holds ~100-130 MiB idle, and at most its in-flight budget more (the budget
# counts what requests cost, from above; the measured peaks stayed under it).
IDLE = 160 * 2**20
CUDA_IDLE = 800 * 2**20  # a CUDA worker's resident memory before any request (docs/benchmarks.md, scaling)


def settings_fields() -> set[str]:
    """The fields of service/config.py's Settings, from its source (the ATTEND_ prefix makes the names)."""
    tree = ast.parse((ROOT / "service" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def schema_problems(resource: dict, where: str) -> list[str]:
    problems = []
    for version in VERSIONS:
        try:
            kv.validate(resource, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{where}: not valid for Kubernetes {e.version}: {path}: {e.message}")
        except kv.SchemaNotFoundError as e:
            problems.append(f"{where}: {e.message}")
    return problems


def as_pod_template(template: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def parse_memory(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor)
    return int(quantity)


def unknown_settings(names, where: str, fields: set[str]) -> list[str]:
    return [f"{where}: {n} is not a setting of service/config.py" for n in names
            if n.startswith("ATTEND_") and n[len("ATTEND_"):].lower() not in fields]


# Each file of a Deployment: the kinds it must hold (a HorizontalPodAutoscaler is checked where there is one).
DEPLOYMENT_FILES = {
    "attend.yaml": {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"},
    "attend-gpu.yaml": {"Deployment", "Service", "PodDisruptionBudget"},
}
# spec.predictor's fields that are KServe's (ComponentExtensionSpec, PredictorExtensionSpec's model kinds); the
# rest of it is a Kubernetes PodSpec, checked as one.
KSERVE_FIELDS = {
    "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType", "containerConcurrency",
    "timeout", "canaryTrafficPercent", "labels", "annotations", "logger", "batcher", "deploymentStrategy",
    "autoScaling", "workerSpec", "storageUris", "model",
}


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def grpc_port(env: dict[str, str]) -> int:
    """The port the service's gRPC server listens on in a container with this environment; 0: off."""
    return int(env.get("ATTEND_GRPC_PORT", 8001))


def check_container(container: dict, pod_spec: dict, where: str, fields: set[str], *,
                    probes=("livenessProbe", "readinessProbe", "startupProbe")) -> list[str]:
    """What the service needs of its container, wherever it runs: listening beyond loopback on a declared
    port, probes on its health routes, its settings real, memory sized from its in-flight budget, and a GPU
    only with ATTEND_DEVICE=cuda (and the other way round)."""
    problems = []
    env = env_of(container)
    problems += unknown_settings(env, where, fields)
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    listen = int(env.get("ATTEND_PORT", 8000))
    if env.get("ATTEND_HOST") != "0.0.0.0":
        problems.append(f"{where}: ATTEND_HOST must be 0.0.0.0 (the default listens on the pod's loopback only)")
    if listen not in ports.values():
        problems.append(f"{where}: no container port {listen} (ATTEND_PORT)")
    grpc = grpc_port(env)
    if grpc and grpc not in ports.values():
        problems.append(f"{where}: gRPC listens on {grpc} (ATTEND_GRPC_PORT, default 8001) but no container port "
                        f"declares it; declare it, or set ATTEND_GRPC_PORT to 0 to turn gRPC off")
    for name in probes:
        path = "/health/ready" if name == "readinessProbe" else "/health/live"
        get = container.get(name, {}).get("httpGet")
        if get is None:
            problems.append(f"{where}: no {name} (httpGet)")
            continue
        port = ports.get(get["port"], get["port"])
        if (get.get("path"), port) != (path, listen):
            problems.append(f"{where}: {name} asks {get.get('path')} on port {get['port']}; the service answers "
                            f"{path} on {listen}")
    resources = container.get("resources", {})
    request, limit = resources.get("requests", {}).get("memory"), resources.get("limits", {}).get("memory")
    if request is None or limit is None:
        problems.append(f"{where}: memory needs a request and a limit (docs/reliability.md)")
    elif parse_memory(request) > parse_memory(limit):
        problems.append(f"{where}: memory request {request} above its limit {limit}")
    budget, workers = env.get("ATTEND_MAX_INFLIGHT_BYTES"), int(env.get("ATTEND_WORKERS", 1))
    if budget is None:
        problems.append(f"{where}: ATTEND_MAX_INFLIGHT_BYTES unset: the memory limit is derived from it")
    elif limit is not None and parse_memory(limit) < workers * (idle := CUDA_IDLE if env.get("ATTEND_DEVICE") ==
                                                                "cuda" else IDLE) + workers * int(budget):
        problems.append(f"{where}: memory limit {limit} below {workers} x ({idle >> 20} MiB idle + "
                        f"ATTEND_MAX_INFLIGHT_BYTES {int(budget) >> 20} MiB): a burst within the budget is killed")
    if "cpu" not in resources.get("requests", {}):
        problems.append(f"{where}: no CPU request (the autoscaler's utilization is relative to it)")
    gpus = int(resources.get("limits", {}).get("nvidia.com/gpu", 0))
    device = env.get("ATTEND_DEVICE", "auto")
    if gpus and device != "cuda":
        problems.append(f"{where}: a GPU is asked for but ATTEND_DEVICE is {device}: set cuda, so that a pod whose "
                        f"GPU cannot be used stops instead of serving on the CPU")
    if device == "cuda":
        if not gpus:
            problems.append(f"{where}: ATTEND_DEVICE=cuda without resources.limits nvidia.com/gpu: no GPU is given")
        if container.get("image", "").endswith(":cpu"):
            problems.append(f"{where}: ATTEND_DEVICE=cuda on {container['image']}, the CPU-only image (no CUDA)")
        if not any(t.get("key") == "nvidia.com/gpu" for t in pod_spec.get("tolerations", [])):
            problems.append(f"{where}: no toleration of the nvidia.com/gpu taint (GPU nodes are often tainted)")
    return problems


def check_deployment_file(name: str, docs: list[dict], fields: set[str]) -> list[str]:
    problems = []
    for doc in docs:
        problems += schema_problems(doc, f"{name} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}")
    by_kind = {d["kind"]: d for d in docs}
    missing = DEPLOYMENT_FILES[name] - set(by_kind)
    if missing:
        return problems + [f"{name} lacks {', '.join(sorted(missing))}"]
    deployment, service, pdb = by_kind["Deployment"], by_kind["Service"], by_kind["PodDisruptionBudget"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    where = f"{name} Deployment"
    problems += check_container(container, pod["spec"], where, fields)
    env = env_of(container)
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    listen = int(env.get("ATTEND_PORT", 8000))
    grace = float(env.get("ATTEND_GRACE_PERIOD_S", 30))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    total = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if total < pre_stop + grace:
        problems.append(f"{where}: terminationGracePeriodSeconds {total} < preStop {pre_stop} s + "
                        f"ATTEND_GRACE_PERIOD_S {grace:g} s: requests in flight would be killed")
    labels = pod["metadata"]["labels"]
    if not selects(service["spec"].get("selector", {}), labels):
        problems.append(f"{name} Service: selector {service['spec'].get('selector')} does not select the pods "
                        f"({labels})")
    if not selects(deployment["spec"]["selector"]["matchLabels"], labels):
        problems.append(f"{where}: selector does not match its own pod labels")
    served = {listen, grpc_port(env)} - {0}
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if ports.get(target, target) not in served:
            problems.append(f"{name} Service: port {port['port']} goes to {target}, not to one the service listens "
                            f"on ({', '.join(map(str, sorted(served)))})")
    replicas = deployment["spec"].get("replicas", 1)
    hpa = by_kind.get("HorizontalPodAutoscaler")
    if hpa is not None:
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) != ("Deployment", deployment["metadata"]["name"]):
            problems.append(f"{name} HorizontalPodAutoscaler: scales {ref['kind']}/{ref['name']}, not the Deployment")
        replicas = hpa["spec"].get("minReplicas", 1)
    pdb_spec = pdb["spec"]
    if not selects(pdb_spec.get("selector", {}).get("matchLabels", {}), labels):
        problems.append(f"{name} PodDisruptionBudget: selector {pdb_spec.get('selector')} does not select the "
                        f"Deployment's pods ({labels})")
    min_available, max_unavailable = pdb_spec.get("minAvailable"), pdb_spec.get("maxUnavailable")
    if isinstance(min_available, int) and min_available >= replicas:
        problems.append(f"{name} PodDisruptionBudget: minAvailable {min_available} with {replicas} pods at least: "
                        f"no pod may ever be evicted, node drains hang")
    if max_unavailable in (0, "0%"):
        problems.append(f"{name} PodDisruptionBudget: maxUnavailable 0: no pod may ever be evicted, node drains hang")
    return problems


def check_shared_selectors(files: dict[str, list[dict]]) -> list[str]:
    """A Service or PodDisruptionBudget of one file must not take in the pods of another file's Deployment
    (the CPU Service would send requests to GPU pods, or the other way round)."""
    problems = []
    pods = {name: next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
            for name, docs in files.items() if any(d["kind"] == "Deployment" for d in docs)}
    for name, docs in files.items():
        for doc in docs:
            selector = {"Service": lambda d: d["spec"].get("selector", {}),
                        "PodDisruptionBudget": lambda d: d["spec"].get("selector", {}).get("matchLabels", {})}.get(
                doc["kind"])
            if selector is None:
                continue
            for other, labels in pods.items():
                if other != name and selects(selector(doc), labels):
                    problems.append(f"{name} {doc['kind']}/{doc['metadata']['name']}: also selects {other}'s pods "
                                    f"({labels}): give each Deployment its own app.kubernetes.io/name")
    return problems


def check_kserve(isvc: dict, fields: set[str]) -> list[str]:
    """KServe's CRD schema is not kubernetes-validate's: the predictor less KServe's own fields is a PodSpec,
    checked as a PodTemplate; then Knative's subset of it (Serverless mode), and the service's own needs."""
    where = "kserve.yaml InferenceService"
    if (isvc.get("apiVersion"), isvc.get("kind")) != ("serving.kserve.io/v1beta1", "InferenceService"):
        return [f"kserve.yaml: {isvc.get('apiVersion')} {isvc.get('kind')}, not serving.kserve.io/v1beta1 "
                f"InferenceService"]
    predictor = isvc.get("spec", {}).get("predictor", {})
    pod_spec = {k: v for k, v in predictor.items() if k not in KSERVE_FIELDS}
    problems = schema_problems(as_pod_template({"spec": pod_spec}, "kserve-predictor"), f"{where} predictor")
    containers = pod_spec.get("containers", [])
    if len(containers) != 1 or containers[0].get("name") != "kserve-container":
        return problems + [f"{where}: the predictor needs one container named kserve-container (KServe's name for "
                           f"the serving container), not {[c.get('name') for c in containers]}"]
    (container,) = containers
    problems += check_container(container, pod_spec, f"{where} predictor", fields,
                                probes=("livenessProbe", "readinessProbe"))
    # Knative's subset of a pod (knative.dev/serving pkg/apis/serving: fieldmask.go, k8s_validation.go).
    ports = container.get("ports", [])
    if len(ports) != 1:
        problems.append(f"{where}: {len(ports)} container ports; Knative serves exactly one")
    elif ports[0].get("name", "") not in ("", "http1", "h2c"):
        problems.append(f"{where}: port name {ports[0]['name']}: Knative allows only http1 or h2c")
    if grpc_port(env_of(container)):
        problems.append(f"{where}: ATTEND_GRPC_PORT is not 0: Knative routes the one port above, so gRPC would "
                        f"listen where nothing reaches it (set it to 0)")
    for field in ("lifecycle", "startupProbe"):
        if field in container:
            problems.append(f"{where}: {field} is not in Knative's subset of a container (Serverless mode refuses it)")
    for field in ("terminationGracePeriodSeconds", "securityContext", "initContainers"):
        if field in pod_spec:
            problems.append(f"{where}: predictor {field} is not in Knative's default subset of a pod")
    timeout = predictor.get("timeout", 300)
    grace = float(env_of(container).get("ATTEND_GRACE_PERIOD_S", 30))
    if timeout < grace:
        problems.append(f"{where}: timeout {timeout} s (the pods' grace period under Knative) < ATTEND_GRACE_PERIOD_S "
                        f"{grace:g} s")
    return problems


def check_rayservice(service: dict, cluster: dict, fields: set[str]) -> list[str]:
    problems = []
    spec = service["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    (app,) = config["applications"]
    (expected,) = cluster["applications"]
    if app["deployments"] != expected["deployments"] or app["import_path"] != expected["import_path"]:
        problems.append("rayservice.yaml: serveConfigV2's deployment differs from deploy/ray/cluster.yaml's")
    if config.get("grpc_options") != cluster.get("grpc_options"):
        problems.append("rayservice.yaml: serveConfigV2's grpc_options differ from deploy/ray/cluster.yaml's")
    for env, where in ((app, "rayservice.yaml serveConfigV2"), (expected, "deploy/ray/cluster.yaml")):
        problems += unknown_settings(env.get("runtime_env", {}).get("env_vars", {}), where, fields)
    cluster_config = spec["rayClusterConfig"]
    groups = [("head", cluster_config["headGroupSpec"])] + [
        (g["groupName"], g) for g in cluster_config.get("workerGroupSpecs", [])]
    drain = expected["deployments"][0].get("graceful_shutdown_timeout_s", 20)
    for name, group in groups:
        template = group["template"]
        problems += schema_problems(as_pod_template(template, name), f"rayservice.yaml {name} pod template")
        for container in template["spec"]["containers"]:
            if "memory" not in container.get("resources", {}).get("limits", {}):
                problems.append(f"rayservice.yaml {name}: no memory limit")
        if name != "head" and template["spec"].get("terminationGracePeriodSeconds", 30) < drain:
            problems.append(f"rayservice.yaml {name}: terminationGracePeriodSeconds below Serve's "
                            f"graceful_shutdown_timeout_s {drain}")
    return problems


def check(m: dict) -> list[str]:
    """m: each file of deploy/kubernetes by name (a list of its documents), and "cluster.yaml": deploy/ray's."""
    fields = settings_fields()
    problems = []
    for name in DEPLOYMENT_FILES:
        problems += check_deployment_file(name, m[name], fields)
    problems += check_shared_selectors({name: m[name] for name in DEPLOYMENT_FILES})
    (isvc,) = m["kserve.yaml"]
    problems += check_kserve(isvc, fields)
    (rayservice,) = m["rayservice.yaml"]
    return problems + check_rayservice(rayservice, m["cluster.yaml"], fields)


def load() -> dict:
    m = {name: [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
         for name in (*DEPLOYMENT_FILES, "kserve.yaml", "rayservice.yaml")}
    unchecked = sorted(p.name for p in KUBERNETES.glob("*.y*ml") if p.name not in m)
    if unchecked:
        sys.exit(f"FAIL deploy/kubernetes: {', '.join(unchecked)} not checked: add them to check_manifests.py")
    m["cluster.yaml"] = yaml.safe_load(CLUSTER.read_text())
    return m


def self_test() -> int:
    """Each breakage below must be reported (and the manifests as they are must pass)."""
    manifests = load()

    def doc(m, name, kind):
        return next(d for d in m[name] if d["kind"] == kind)

    def container(m, name="attend.yaml"):
        return doc(m, name, "Deployment")["spec"]["template"]["spec"]["containers"][0]

    def predictor(m):
        return m["kserve.yaml"][0]["spec"]["predictor"]

    def broken(change, expect: str) -> str | None:
        m = copy.deepcopy(manifests)
        change(m)
        found = check(m)
        return None if any(expect in p for p in found) else f"not caught: {expect} (found {found})"

    def typo(m):
        container(m)["readinesProbe"] = container(m).pop("readinessProbe")

    def gpu_labels_as_cpu(m):
        labels = {"app.kubernetes.io/name": "attend"}
        deployment = doc(m, "attend-gpu.yaml", "Deployment")
        deployment["spec"]["template"]["metadata"]["labels"] = deployment["spec"]["selector"]["matchLabels"] = labels

    def kserve_typo(m):
        predictor(m)["minReplica"] = predictor(m).pop("minReplicas")

    cases = [
        (typo, "readinesProbe"),
        (lambda m: container(m)["ports"].pop(), "no container port declares it"),
        (lambda m: doc(m, "attend.yaml", "Service")["spec"]["ports"][1].update(targetPort=9000),
         "port 8001 goes to 9000"),
        (lambda m: container(m)["readinessProbe"]["httpGet"].update(path="/health"), "readinessProbe asks /health"),
        (lambda m: container(m)["env"].append({"name": "ATTEND_GRACE_PERIOD", "value": "30"}),
         "ATTEND_GRACE_PERIOD is not a setting"),
        (lambda m: doc(m, "attend.yaml", "Deployment")["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds 30 <"),
        (lambda m: container(m)["resources"]["requests"].update(memory="1Gi"), "above its limit"),
        (lambda m: container(m)["env"].append({"name": "ATTEND_WORKERS", "value": "2"}), "a burst within"),
        (lambda m: doc(m, "attend.yaml", "Service")["spec"].update(selector={"app": "other"}),
         "does not select the pods"),
        (lambda m: doc(m, "attend.yaml", "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"].update(name="other"),
         "not the Deployment"),
        # PodDisruptionBudget
        (lambda m: doc(m, "attend.yaml", "PodDisruptionBudget")["spec"].update(
            selector={"matchLabels": {"app.kubernetes.io/name": "atend"}}), "does not select the Deployment's pods"),
        (lambda m: doc(m, "attend.yaml", "PodDisruptionBudget")["spec"].update(minAvailable=2), "drains hang"),
        (lambda m: m["attend.yaml"].remove(doc(m, "attend.yaml", "PodDisruptionBudget")),
         "attend.yaml lacks PodDisruptionBudget"),
        # the GPU Deployment: checked as the CPU one, and its own rules
        (lambda m: container(m, "attend-gpu.yaml")["livenessProbe"]["httpGet"].update(port=8080),
         "attend-gpu.yaml Deployment: livenessProbe asks"),
        (lambda m: next(e for e in container(m, "attend-gpu.yaml")["env"] if e["name"] == "ATTEND_DEVICE").update(
            value="auto"), "but ATTEND_DEVICE is auto"),
        (lambda m: container(m, "attend-gpu.yaml")["resources"]["limits"].pop("nvidia.com/gpu"),
         "without resources.limits nvidia.com/gpu"),
        (lambda m: container(m, "attend-gpu.yaml").update(image="attend:cpu"), "the CPU-only image"),
        (lambda m: doc(m, "attend-gpu.yaml", "Deployment")["spec"]["template"]["spec"].pop("tolerations"),
         "no toleration"),
        (lambda m: container(m, "attend-gpu.yaml")["resources"]["limits"].update(memory="400Mi"),
         "attend-gpu.yaml Deployment: memory limit 400Mi below"),
        (gpu_labels_as_cpu, "attend.yaml Service/attend: also selects attend-gpu.yaml's pods"),
        # KServe
        (kserve_typo, "minReplica"),
        (lambda m: [e for e in predictor(m)["containers"][0]["env"] if e["name"] == "ATTEND_GRPC_PORT"][0].update(
            value="8001"), "ATTEND_GRPC_PORT is not 0"),
        (lambda m: predictor(m)["containers"][0]["ports"][0].update(name="http"), "Knative allows only http1"),
        (lambda m: predictor(m)["containers"][0].update(lifecycle={"preStop": {"sleep": {"seconds": 5}}}),
         "lifecycle is not in Knative's subset"),
        (lambda m: predictor(m)["containers"][0]["readinessProbe"]["httpGet"].update(port=8080),
         "predictor: readinessProbe asks"),
        (lambda m: predictor(m)["containers"][0]["env"].append({"name": "ATTEND_MAX_INFLIGHT", "value": "1"}),
         "ATTEND_MAX_INFLIGHT is not a setting"),
        (lambda m: predictor(m)["containers"][0]["resources"]["limits"].update(memory="256Mi"),
         "predictor: memory limit 256Mi below"),
        # RayService
        (lambda m: m["rayservice.yaml"][0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
            "containers"][0].update(imagePullPolice="Always"), "imagePullPolice"),
        (lambda m: m["rayservice.yaml"][0]["spec"].update(serveConfigV2=m["rayservice.yaml"][0]["spec"][
            "serveConfigV2"].replace("port: 8001", "port: 9000")), "grpc_options differ"),
    ]
    failures = [f for f in (broken(change, expect) for change, expect in cases) if f]
    clean = check(manifests)
    if clean:
        failures.append(f"the manifests as they are fail: {clean}")
    for failure in failures:
        print(f"self-test: {failure}", file=sys.stderr)
    print(f"self-test: {len(cases) - len([f for f in failures if f.startswith('not caught')])}/{len(cases)} "
          f"breakages caught")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv == ["--self-test"]:
        return self_test()
    problems = check(load())
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"ok   deploy/kubernetes: attend.yaml, attend-gpu.yaml (Deployment, Service, PodDisruptionBudget, HPA), "
              f"kserve.yaml's predictor and rayservice.yaml's pod templates valid for Kubernetes "
              f"{' and '.join(VERSIONS)} (strict); probes, grace periods, selectors, resources, GPU and "
              f"ATTEND_* settings consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
