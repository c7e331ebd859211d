"""What must agree inside a rendered overlay: probes, ports, resources and the roles' flags.

Each check takes a ``Rendered`` overlay and returns its problems (empty: it holds). The flags are
the role CLIs' (``mii-server replica MODEL --port P [--tensor-parallel T]``, ``mii-server
load-balancer --replicas ADDRS --port P``, ``mii-server gateway --load-balancer HOST:PORT
[--rest-port P] [--openai-port P]``, with ``--host`` and ``--config`` on every role and
``--metrics-port`` on the replica); the health service names are the server's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from mii_server.serving.control.deployment import DeploymentConfig
from mii_server.serving.grpc_common import SERVICE_NAME

from .manifests import (
    ROLES,
    Obj,
    Rendered,
    container_port,
    containers,
    flag,
    mount_source,
    pod_spec,
    positionals,
    probe_port,
    selector_matches,
)

GPU = "nvidia.com/gpu"
# Serve() kwargs the pods set by flag (or never, like the key file): the config file must not.
LAYOUT_KEYS = frozenset(
    ("host", "port_number", "replica_num", "tensor_parallel", "device_map", "registry_dir")
    + ("metrics_port", "enable_metrics", "api_key_file", "model_name_or_path")
    + ("enable_restful_api", "restful_api_host", "restful_api_port")
    + ("enable_openai_api", "openai_api_host", "openai_api_port")
)
MIN_STARTUP_S = 60  # a replica gets at least this long to load before liveness starts
MIN_GPU_STARTUP_S = 20 * 60  # a real checkpoint from network storage, then CUDA graph capture
MIN_DRAIN_S = 30  # the grace left after the preStop sleep for open streams to finish
# Secrets and volume claims a real deployment brings itself (never committed); the overlay's
# kustomization.yaml must say how to create them.
OPERATOR_PROVIDED = {"Secret": "mii-server-api-keys", "PersistentVolumeClaim": "mii-server-models"}

Check = Callable[[Rendered], list[str]]


def _args(container: Obj) -> list[str]:
    return [str(a) for a in container.get("args", [])]


def _int_flag(container: Obj, name: str, default: int | None = None) -> int | None:
    value = flag(_args(container), name)
    return default if value is None else int(value)


def _gpus(container: Obj) -> int:
    resources = container.get("resources", {})
    return int(resources.get("limits", {}).get(GPU, 0))


def _startup_budget(container: Obj) -> int:
    probe = container.get("startupProbe")
    if probe is None:
        return 0
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


def _service_for(r: Rendered, workload: Obj, target_port: int) -> tuple[Obj, int] | None:
    """(Service, its port) of a Service selecting ``workload``'s pods whose port leads to ``target_port``."""
    for svc in r.services_selecting(workload):
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if any(container_port(c, target) == target_port for c in containers(workload)):
                return svc, int(p["port"])
    return None


def roles_run_their_subcommand(r: Rendered) -> list[str]:
    """Each role's containers run that role's subcommand and bind every interface (pods are reached by IP)."""
    problems = []
    for role in ROLES:
        for c in containers(r.role(role)):
            args = _args(c)
            if not args or args[0] != role:
                problems.append(f"{role}/{c['name']}: args start {args[:1]}, not the subcommand {role!r}")
            if flag(args, "--host") != "0.0.0.0":
                problems.append(f"{role}/{c['name']}: --host is {flag(args, '--host')!r}, not 0.0.0.0")
    return problems


def replica_probes_match_port(r: Rendered) -> list[str]:
    """The replica's grpc probes ask its --port: startup and readiness the model service, liveness ""."""
    problems = []
    for c in containers(r.role("replica")):
        port = _int_flag(c, "--port")
        if container_port(c, "grpc") != port:
            problems.append(
                f"replica: container port 'grpc' is {container_port(c, 'grpc')}, --port is {port}"
            )
        wanted = {"startupProbe": SERVICE_NAME, "readinessProbe": SERVICE_NAME, "livenessProbe": ""}
        for name, service in wanted.items():
            probe = c.get(name)
            if probe is None or "grpc" not in probe:
                problems.append(f"replica: {name} is not a grpc probe")
                continue
            if probe["grpc"]["port"] != port:
                problems.append(f"replica: {name} asks port {probe['grpc']['port']}, --port is {port}")
            if probe["grpc"].get("service", "") != service:
                problems.append(
                    f"replica: {name} asks service {probe['grpc'].get('service')!r}, not {service!r}"
                )
        floor = MIN_GPU_STARTUP_S if _gpus(c) else MIN_STARTUP_S
        if _startup_budget(c) < floor:
            problems.append(
                f"replica: the startup probe allows {_startup_budget(c)} s to load, under {floor} s"
            )
        deadline = r.role("replica")["spec"].get("progressDeadlineSeconds", 600)
        if deadline <= _startup_budget(c):
            problems.append(f"replica: a rollout gives up after {deadline} s, before loading may end")
    return problems


def replica_metrics_are_scraped(r: Rendered) -> list[str]:
    """Prometheus' annotations name the replica's --metrics-port, which the container exposes."""
    workload = r.role("replica")
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    problems = []
    for c in containers(workload):
        port = _int_flag(c, "--metrics-port")
        if port is None or container_port(c, port) != port:
            problems.append(f"replica: --metrics-port {port} is not a container port")
        named = annotations.get("prometheus.io/port") == str(port)
        if annotations.get("prometheus.io/scrape") != "true" or not named:
            problems.append(f"replica: scrape annotations {annotations} do not name port {port}")
        if annotations.get("prometheus.io/path", "/metrics") != "/metrics":
            problems.append(f"replica: scrape path {annotations['prometheus.io/path']!r} is not /metrics")
    return problems


def gpus_match_tensor_parallel(r: Rendered) -> list[str]:
    """A replica on GPUs asks for --tensor-parallel of them, runs the CUDA image, has shared memory."""
    problems = []
    for c in containers(r.role("replica")):
        tp = _int_flag(c, "--tensor-parallel", 1)
        gpus = _gpus(c)
        requests = c.get("resources", {}).get("requests", {})
        if GPU in requests and int(requests[GPU]) != gpus:
            problems.append(f"replica: requests {requests[GPU]} GPUs but limits {gpus}")
        if gpus and gpus != tp:
            problems.append(f"replica: {GPU} limit {gpus} != --tensor-parallel {tp}")
        if gpus and not c["image"].endswith(":cuda"):
            problems.append(f"replica: GPUs with the image {c['image']}, not the CUDA one")
        shm = mount_source(r.role("replica"), c, "/dev/shm")
        if (gpus or tp > 1) and (shm is None or shm[0].get("emptyDir", {}).get("medium") != "Memory"):
            problems.append("replica: tensor-parallel ranks need /dev/shm from an emptyDir in memory")
    for role in ("load-balancer", "gateway"):
        for c in containers(r.role(role)):
            if _gpus(c):
                problems.append(f"{role}/{c['name']}: asks for GPUs; it runs no model")
    return problems


def replicas_are_discovered(r: Rendered) -> list[str]:
    """A headless Service selects the replicas on --port, and the load balancer resolves exactly it."""
    replica = r.role("replica")
    port = _int_flag(containers(replica)[0], "--port")
    assert port is not None
    found = _service_for(r, replica, port)
    if found is None:
        return [f"no Service selects the replicas on port {port}"]
    svc, svc_port = found
    problems = []
    if svc["spec"].get("clusterIP") != "None":
        problems.append(
            f"Service {svc['metadata']['name']} is not headless: the load balancer must see every pod"
        )
    wanted = f"dns:///{svc['metadata']['name']}:{svc_port}"
    for c in containers(r.role("load-balancer")):
        if flag(_args(c), "--replicas") != wanted:
            problems.append(f"load-balancer: --replicas is {flag(_args(c), '--replicas')!r}, not {wanted!r}")
    return problems


def load_balancer_is_reachable(r: Rendered) -> list[str]:
    """At least 2 load balancers behind a Service on their --port, probed there; the gateways dial it."""
    lb = r.role("load-balancer")
    problems = []
    if lb["spec"].get("replicas", 1) < 2:
        problems.append(f"load-balancer: {lb['spec'].get('replicas', 1)} pod(s); at least 2 survive one loss")
    (c,) = containers(lb)
    port = _int_flag(c, "--port")
    assert port is not None
    if container_port(c, port) != port:
        problems.append(f"load-balancer: --port {port} is not a container port")
    for name in ("readinessProbe", "livenessProbe"):
        if name not in c:
            problems.append(f"load-balancer: no {name}")
        elif probe_port(c[name])[1] != port:
            problems.append(f"load-balancer: {name} asks port {probe_port(c[name])[1]}, --port is {port}")
    found = _service_for(r, lb, port)
    if found is None or found[0]["spec"].get("clusterIP") == "None":
        return [*problems, f"load-balancer: no load-balancing Service on port {port}"]
    wanted = f"{found[0]['metadata']['name']}:{found[1]}"
    for g in containers(r.role("gateway")):
        if flag(_args(g), "--load-balancer") != wanted:
            problems.append(
                f"gateway/{g['name']}: --load-balancer {flag(_args(g), '--load-balancer')!r}, not {wanted!r}"
            )
    return problems


def gateways_probe_their_ports(r: Rendered) -> list[str]:
    """Each gateway container serves one --rest-port / --openai-port, probed there (/health, /healthz)."""
    gw = r.role("gateway")
    problems, served = [], set()
    for c in containers(gw):
        ports = [p for p in (_int_flag(c, "--rest-port"), _int_flag(c, "--openai-port")) if p is not None]
        if len(ports) != 1:
            problems.append(
                f"gateway/{c['name']}: serves {ports}; one front end per container, each with its probes"
            )
            continue
        (port,) = ports
        served.add(port)
        if container_port(c, port) != port:
            problems.append(f"gateway/{c['name']}: port {port} is not a container port")
        for name, path in (("readinessProbe", "/health"), ("livenessProbe", "/healthz")):
            probe = c.get(name)
            if probe is None or probe_port(probe) != ("httpGet", port):
                problems.append(f"gateway/{c['name']}: {name} is not an HTTP GET on port {port}")
            elif probe["httpGet"]["path"] != path:
                problems.append(f"gateway/{c['name']}: {name} asks {probe['httpGet']['path']}, not {path}")
    services = r.services_selecting(gw)
    targets = {
        container_port(c, p.get("targetPort", p["port"]))
        for s in services
        for p in s["spec"]["ports"]
        for c in containers(gw)
    }
    missing = served - targets
    if missing:
        problems.append(f"gateway: no Service port reaches {sorted(missing)}")
    return problems


def api_keys_come_from_a_secret(r: Rendered) -> list[str]:
    """The gateways read MII_SERVER_API_KEY from a Secret; no key is a literal value or an argument."""
    problems = []
    for _, c, where in r.each_container():
        if any("api-key" in a or "api_key" in a for a in _args(c)):
            problems.append(f"{where}: an API key (or its file) in the arguments")
        for env in c.get("env", []):
            if env["name"] == "MII_SERVER_API_KEY" and "secretKeyRef" not in env.get("valueFrom", {}):
                problems.append(f"{where}: MII_SERVER_API_KEY is not from a Secret")
    for c in containers(r.role("gateway")):
        if not any(e["name"] == "MII_SERVER_API_KEY" for e in c.get("env", [])):
            problems.append(f"gateway/{c['name']}: no MII_SERVER_API_KEY from the Secret")
    return problems


def references_resolve(r: Rendered) -> list[str]:
    """Every ConfigMap, Secret and claim a pod uses is rendered, or the operator's as documented."""
    kustomization = (r.overlay_dir / "kustomization.yaml").read_text()
    problems = []
    for workload in r.of_kind("Deployment"):
        spec = pod_spec(workload)
        refs = [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
        refs += [("Secret", v["secret"]["secretName"]) for v in spec.get("volumes", []) if "secret" in v]
        refs += [
            ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
            for v in spec.get("volumes", [])
            if "persistentVolumeClaim" in v
        ]
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    refs.append(("Secret", ref["secretKeyRef"]["name"]))
                if "configMapKeyRef" in ref:
                    refs.append(("ConfigMap", ref["configMapKeyRef"]["name"]))
        for kind, name in refs:
            if r.get(kind, name) is not None:
                continue
            if OPERATOR_PROVIDED.get(kind) != name:
                problems.append(
                    f"{workload['metadata']['name']}: {kind} {name} is neither rendered nor operator-provided"
                )
            elif name not in kustomization:
                problems.append(
                    f"{r.overlay}: {kind} {name} is the operator's, but kustomization.yaml never says so"
                )
    return problems


def config_file_is_valid(r: Rendered) -> list[str]:
    """Every role reads --config from the ConfigMap: a valid deployment config, without layout keys."""
    problems = []
    for role in ROLES:
        workload = r.role(role)
        for c in containers(workload):
            where = f"{role}/{c['name']}"
            path = flag(_args(c), "--config")
            source = mount_source(workload, c, path) if path else None
            if source is None or "configMap" not in source[0]:
                problems.append(f"{where}: --config {path!r} is not on a ConfigMap volume")
                continue
            cm = r.get("ConfigMap", source[0]["configMap"]["name"])
            if cm is None or source[1] not in cm.get("data", {}):
                problems.append(f"{where}: the ConfigMap has no {source[1]!r}")
                continue
            config = json.loads(cm["data"][source[1]])
            flat = {**config, **config.get("model_config", {})}
            clash = sorted(LAYOUT_KEYS & set(flat))
            if clash:
                problems.append(f"{where}: the config sets {clash}, which the pod's flags own")
                continue
            if not config.get("served_model_name") or not config.get("deployment_name"):
                problems.append(
                    f"{where}: the config must name deployment_name and served_model_name (for the gateways)"
                )
            if role == "replica":
                model = (positionals(_args(c))[1:] or [""])[0]
                tp = _int_flag(c, "--tensor-parallel", 1)
                try:
                    DeploymentConfig.from_kwargs(model, tensor_parallel=tp, **config)
                except Exception as err:  # noqa: BLE001 - any refusal is the problem to report
                    problems.append(f"{where}: the config is refused: {type(err).__name__}: {err}")
    return problems


def terminations_drain(r: Rendered) -> list[str]:
    """Every container sleeps in preStop (out of the endpoints first); the grace leaves time to drain."""
    problems = []
    for workload, c, where in r.each_container():
        grace = int(pod_spec(workload).get("terminationGracePeriodSeconds", 30))
        sleep = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds")
        if not sleep:
            problems.append(f"{where}: no preStop sleep")
        elif grace < int(sleep) + MIN_DRAIN_S:
            problems.append(
                f"{where}: grace {grace} s leaves under {MIN_DRAIN_S} s after a {sleep} s preStop"
            )
    for workload in r.of_kind("Deployment"):
        if workload["spec"].get("strategy", {}).get("type", "RollingUpdate") != "RollingUpdate":
            problems.append(f"{workload['metadata']['name']}: not a rolling update")
    return problems


def disruption_budgets_cover_roles(r: Rendered) -> list[str]:
    """A PodDisruptionBudget keeps each role from being drained all at once."""
    budgets = r.of_kind("PodDisruptionBudget")
    problems = []
    for role in ROLES:
        labels = r.role(role)["spec"]["template"]["metadata"]["labels"]
        if not any(selector_matches(b["spec"]["selector"]["matchLabels"], labels) for b in budgets):
            problems.append(f"{role}: no PodDisruptionBudget selects its pods")
    return problems


def pods_are_locked_down(r: Rendered) -> list[str]:
    """Non-root, no privilege escalation, and requests plus a memory limit on every container."""
    problems = []
    for workload in r.of_kind("Deployment"):
        pod = pod_spec(workload).get("securityContext", {})
        if not pod.get("runAsNonRoot") or pod.get("runAsUser", 0) == 0:
            problems.append(f"{workload['metadata']['name']}: may run as root")
    for _, c, where in r.each_container():
        if c.get("securityContext", {}).get("allowPrivilegeEscalation", True):
            problems.append(f"{where}: allows privilege escalation")
        res = c.get("resources", {})
        if not {"cpu", "memory"} <= set(res.get("requests", {})) or "memory" not in res.get("limits", {}):
            problems.append(f"{where}: needs cpu and memory requests and a memory limit")
    return problems


CHECKS: list[Check] = [
    roles_run_their_subcommand,
    replica_probes_match_port,
    replica_metrics_are_scraped,
    gpus_match_tensor_parallel,
    replicas_are_discovered,
    load_balancer_is_reachable,
    gateways_probe_their_ports,
    api_keys_come_from_a_secret,
    references_resolve,
    config_file_is_valid,
    terminations_drain,
    disruption_budgets_cover_roles,
    pods_are_locked_down,
]
