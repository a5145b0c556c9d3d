"""Checks of deploy/kubernetes, run by tests/deploy/lint.sh in its tools venv (kubernetes-validate, PyYAML;
not the project's venv, so nothing of the service is imported: its settings are read from service/config.py's
source).

    python tests/deploy/check_manifests.py               check; exit 1 with one line a problem
    python tests/deploy/check_manifests.py --self-test   the checks catch broken copies of the manifests

1. Every resource of deploy/kubernetes/attend.yaml against Kubernetes' schemas, strict (unknown fields
   fail), for the oldest version the manifests need (1.30: the preStop `sleep` action) and the newest
   the tool knows. The RayService's CRD schema is KubeRay's and does not ship with the tool: its head and
   worker pod templates are checked as `PodTemplate`s, its Serve config against deploy/ray/cluster.yaml.
2. What a schema cannot know: the probes ask the service's health routes on the port it listens on;
   the grace period covers preStop plus ATTEND_GRACE_PERIOD_S (or Serve's graceful_shutdown_timeout_s);
   the Service and the HPA point at the Deployment; memory is requested and limited, the limit room for
   the idle process and ATTEND_MAX_INFLIGHT_BYTES a worker (docs/reliability.md's sizing); every ATTEND_*
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
ATTEND = ROOT / "deploy" / "kubernetes" / "attend.yaml"
RAYSERVICE = ROOT / "deploy" / "kubernetes" / "rayservice.yaml"
CLUSTER = ROOT / "deploy" / "ray" / "cluster.yaml"
VERSIONS = ["1.30.0", kv.latest_version()]
# docs/reliability.md: a worker holds ~100-130 MiB idle, and at most its in-flight budget more (the budget
# counts what requests cost, from above; the measured peaks stayed under it).
IDLE = 160 * 2**20


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


def check_attend(docs: list[dict], fields: set[str]) -> list[str]:
    problems = []
    for doc in docs:
        problems += schema_problems(doc, f"attend.yaml {doc.get('kind')}/{doc.get('metadata', {}).get('name')}")
    by_kind = {d["kind"]: d for d in docs}
    missing = {"Deployment", "Service", "HorizontalPodAutoscaler"} - set(by_kind)
    if missing:
        return problems + [f"attend.yaml lacks {', '.join(sorted(missing))}"]
    deployment, service, hpa = by_kind["Deployment"], by_kind["Service"], by_kind["HorizontalPodAutoscaler"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = env_of(container)
    problems += unknown_settings(env, "attend.yaml Deployment", fields)
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    listen = int(env.get("ATTEND_PORT", 8000))
    if env.get("ATTEND_HOST") != "0.0.0.0":
        problems.append("Deployment: ATTEND_HOST must be 0.0.0.0 (the default listens on the pod's loopback only)")
    if listen not in ports.values():
        problems.append(f"Deployment: no container port {listen} (ATTEND_PORT)")

    def probe(name: str, path: str) -> None:
        get = container.get(name, {}).get("httpGet")
        if get is None:
            problems.append(f"Deployment: no {name} (httpGet)")
            return
        port = ports.get(get["port"], get["port"])
        if (get.get("path"), port) != (path, listen):
            problems.append(f"Deployment: {name} asks {get.get('path')} on port {get['port']}; the service answers "
                            f"{path} on {listen}")

    probe("livenessProbe", "/health/live")
    probe("readinessProbe", "/health/ready")
    probe("startupProbe", "/health/live")
    grace = float(env.get("ATTEND_GRACE_PERIOD_S", 30))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    total = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if total < pre_stop + grace:
        problems.append(f"Deployment: terminationGracePeriodSeconds {total} < preStop {pre_stop} s + "
                        f"ATTEND_GRACE_PERIOD_S {grace:g} s: requests in flight would be killed")
    resources = container.get("resources", {})
    request, limit = resources.get("requests", {}).get("memory"), resources.get("limits", {}).get("memory")
    if request is None or limit is None:
        problems.append("Deployment: memory needs a request and a limit (docs/reliability.md)")
    elif parse_memory(request) > parse_memory(limit):
        problems.append(f"Deployment: memory request {request} above its limit {limit}")
    budget, workers = env.get("ATTEND_MAX_INFLIGHT_BYTES"), int(env.get("ATTEND_WORKERS", 1))
    if budget is None:
        problems.append("Deployment: ATTEND_MAX_INFLIGHT_BYTES unset: the memory limit is derived from it")
    elif limit is not None and parse_memory(limit) < workers * (IDLE + int(budget)):
        problems.append(f"Deployment: memory limit {limit} below {workers} x (160 MiB idle + "
                        f"ATTEND_MAX_INFLIGHT_BYTES {int(budget) >> 20} MiB): a burst within the budget is killed")
    if "cpu" not in resources.get("requests", {}):
        problems.append("Deployment: no CPU request (the HPA's utilization is relative to it)")
    labels = pod["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in service["spec"]["selector"].items()):
        problems.append(f"Service: selector {service['spec']['selector']} does not select the pods ({labels})")
    if any(labels.get(k) != v for k, v in deployment["spec"]["selector"]["matchLabels"].items()):
        problems.append("Deployment: selector does not match its own pod labels")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if ports.get(target, target) != listen:
            problems.append(f"Service: port {port['port']} goes to {target}, not to the service's {listen}")
    ref = hpa["spec"]["scaleTargetRef"]
    if (ref["kind"], ref["name"]) != ("Deployment", deployment["metadata"]["name"]):
        problems.append(f"HorizontalPodAutoscaler: scales {ref['kind']}/{ref['name']}, not the Deployment")
    return problems


def check_rayservice(service: dict, cluster: dict, fields: set[str]) -> list[str]:
    problems = []
    spec = service["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    (app,) = config["applications"]
    (expected,) = cluster["applications"]
    if app["deployments"] != expected["deployments"] or app["import_path"] != expected["import_path"]:
        problems.append("rayservice.yaml: serveConfigV2's deployment differs from deploy/ray/cluster.yaml's")
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


def check(attend: list[dict], service: dict, cluster: dict) -> list[str]:
    fields = settings_fields()
    return check_attend(attend, fields) + check_rayservice(service, cluster, fields)


def load() -> tuple[list[dict], dict, dict]:
    attend = [d for d in yaml.safe_load_all(ATTEND.read_text()) if d]
    return attend, yaml.safe_load(RAYSERVICE.read_text()), yaml.safe_load(CLUSTER.read_text())


def self_test() -> int:
    """Each breakage below must be reported (and the manifests as they are must pass)."""
    attend, service, cluster = load()

    def container(docs):
        return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]

    def broken(change, expect: str) -> str | None:
        docs, rs = copy.deepcopy(attend), copy.deepcopy(service)
        change(docs, rs)
        found = check(docs, rs, cluster)
        return None if any(expect in p for p in found) else f"not caught: {expect} (found {found})"

    def typo(docs, rs):
        container(docs)["readinesProbe"] = container(docs).pop("readinessProbe")

    cases = [
        (typo, "readinesProbe"),
        (lambda d, r: container(d)["readinessProbe"]["httpGet"].update(path="/health"), "readinessProbe asks /health"),
        (lambda d, r: container(d)["env"].append({"name": "ATTEND_GRACE_PERIOD", "value": "30"}),
         "ATTEND_GRACE_PERIOD is not a setting"),
        (lambda d, r: d[0]["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30),
         "terminationGracePeriodSeconds 30 <"),
        (lambda d, r: container(d)["resources"]["requests"].update(memory="1Gi"), "above its limit"),
        (lambda d, r: container(d)["env"].append({"name": "ATTEND_WORKERS", "value": "2"}), "a burst within"),
        (lambda d, r: d[1]["spec"].update(selector={"app": "other"}), "does not select the pods"),
        (lambda d, r: d[2]["spec"]["scaleTargetRef"].update(name="other"), "not the Deployment"),
        (lambda d, r: r["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
            imagePullPolice="Always"), "imagePullPolice"),
    ]
    failures = [f for f in (broken(change, expect) for change, expect in cases) if f]
    clean = check(attend, service, cluster)
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
    problems = check(*load())
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"ok   deploy/kubernetes: attend.yaml (Deployment, Service, HPA) and rayservice.yaml's pod templates "
              f"valid for Kubernetes {' and '.join(VERSIONS)} (strict); probes, grace periods, selectors, "
              f"resources and ATTEND_* settings consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
